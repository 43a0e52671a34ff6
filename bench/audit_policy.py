"""How many forged answers a split forger gets through before an audit catches it, by how long it waits.

A stage forger that is honest for its first ``h`` requests through a new chain, then forges every
answer, is run against the node's real audit decision (:class:`~meshllm.split.audit.AuditPolicy`
plus the auditor's own rule: the first request of every chain is audited) many times over; an audit
catches a forged request after its answer reached the client, so the count includes the caught one.
Side by side: the policy before issue 29 (the chain's first request, then the base rate alone).

    .venv/bin/python bench/audit_policy.py [--trials 20000] [--rate 0.05] [--out bench/results/audit_policy.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
from pathlib import Path

from meshllm.split.audit import AUDIT_RATE, PROBATION, AuditPolicy

WAITS = (1, 2, 4, 8, 16, 32, 64, 160)
"""Honest requests before the forger starts (1: honest on the chain's first, always audited, request)."""
CAP = 100_000
"""A trial stops here (only a policy that never audits gets this far)."""


def forged_through(rate: float, wait: int, rng: random.Random, *, new: bool) -> int:
    """Forged answers that reach clients until (and including) the first audited one."""
    policy = AuditPolicy(rate)
    forger = ["forger"]
    for n in range(CAP):
        p = 1.0 if n == 0 else (policy.probability(forger) if new else rate)
        audited = rng.random() < p
        if n < wait:
            if audited:
                policy.record_pass(forger)
            continue
        if audited:
            return n - wait + 1
    return CAP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=AUDIT_RATE)
    parser.add_argument("--seed", type=int, default=29)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results") / "audit_policy.json")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows = []
    print(f"forged answers before an audit catches the forger (rate {args.rate}, probation {PROBATION}, "
          f"{args.trials} trials each)")
    print(f"{'honest first':>12} | {'before: mean':>12} {'median':>6} {'p95':>5} | {'now: mean':>9} {'median':>6} "
          f"{'p95':>5} | {'ratio':>5}")
    for wait in WAITS:
        old = sorted(forged_through(args.rate, wait, rng, new=False) for _ in range(args.trials))
        new = sorted(forged_through(args.rate, wait, rng, new=True) for _ in range(args.trials))
        row = {"honest_first": wait,
               "before": {"mean": statistics.fmean(old), "median": statistics.median(old),
                          "p95": old[int(0.95 * len(old))]},
               "now": {"mean": statistics.fmean(new), "median": statistics.median(new),
                       "p95": new[int(0.95 * len(new))]}}
        rows.append(row)
        b, n = row["before"], row["now"]
        print(f"{wait:>12} | {b['mean']:>12.2f} {b['median']:>6.0f} {b['p95']:>5} | {n['mean']:>9.2f} "
              f"{n['median']:>6.0f} {n['p95']:>5} | {b['mean'] / n['mean']:>5.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"when": datetime.datetime.now(datetime.UTC).isoformat(), "rate": args.rate,
                                    "probation": PROBATION, "trials": args.trials, "rows": rows}, indent=2))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
