"""Identity costs: signatures, certificates, envelopes and the owner keystore.

Each figure is the median of several rounds; every round measures every figure, side by side in
one process (this hardware is shared and noisy). Measured: Ed25519 sign/verify of a 1 KiB
domain-tagged body, node certificate issue and verify, envelope seal and open (plain and
encrypted, 256 B payload, open including the replay cache), the owner keystore unlock at its
default argon2id limits, and the wire sizes.

Usage: ``python bench/identity.py [--runs 5] [--n 2000] [--out bench/results/identity.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from meshllm.identity.certs import certificate_token, issue_certificate, verify_certificate
from meshllm.identity.envelope import EnvelopeReceiver, seal
from meshllm.identity.keys import NodeKey
from meshllm.identity.keystore import DEFAULT_MEMLIMIT, DEFAULT_OPSLIMIT, create_keystore, unlock_keystore
from meshllm.identity.signing import encode_signed, sign_bytes, verify_bytes

NOW = 1_800_000_000.0
PAYLOAD = os.urandom(256)


def rates(runs: int, n: int, setups: dict[str, Callable[[], Callable[[int], object]]]) -> dict[str, float]:
    """Median operations per second of each setup's operation over ``runs`` rounds of ``n`` calls.

    Every round measures every figure once, so load from other work on the machine spreads over
    all figures instead of skewing whichever happened to run during it. Setup is not timed.
    """
    samples: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(runs):
        for name, setup in setups.items():
            op = setup()
            start = time.perf_counter()
            for i in range(n):
                op(i)
            samples[name].append(n / (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in samples.items()}


def measure(runs: int, n: int) -> dict[str, float]:
    """Every figure in the table, keyed by a stable name."""
    alice, bob = NodeKey.ephemeral(), NodeKey.ephemeral()
    body = os.urandom(1024)
    sig = sign_bytes(alice.signing_key, "bench", body)
    cert = issue_certificate(alice.signing_key, bob.node_id, NOW, label="bench-node")
    cert_bytes = encode_signed(cert)

    def opening(recipient: str | None) -> Callable[[], Callable[[int], object]]:
        def setup() -> Callable[[int], object]:
            batch = [seal(alice, "bench", PAYLOAD, NOW, recipient) for _ in range(n)]
            receiver = EnvelopeReceiver(bob, max_entries=n + 1)
            return lambda i: receiver.open(batch[i], "bench", NOW)
        return setup

    out = rates(runs, n, {
        "sign_per_s": lambda: lambda i: sign_bytes(alice.signing_key, "bench", body),
        "verify_per_s": lambda: lambda i: verify_bytes(alice.public, "bench", body, sig),
        "cert_issue_per_s": lambda: lambda i: issue_certificate(alice.signing_key, bob.node_id, NOW),
        "cert_verify_per_s": lambda: lambda i: verify_certificate(cert_bytes, bob.node_id, NOW),
        "seal_plain_per_s": lambda: lambda i: seal(alice, "bench", PAYLOAD, NOW),
        "seal_encrypted_per_s": lambda: lambda i: seal(alice, "bench", PAYLOAD, NOW, bob.node_id),
        "open_plain_per_s": opening(None),
        "open_encrypted_per_s": opening(bob.node_id),
    })
    out |= {
        "cert_bytes": len(cert_bytes),
        "cert_token_chars": len(certificate_token(cert)),
        "envelope_plain_overhead_bytes": len(seal(alice, "bench", PAYLOAD, NOW)) - len(PAYLOAD),
        "envelope_encrypted_overhead_bytes": len(seal(alice, "bench", PAYLOAD, NOW, bob.node_id)) - len(PAYLOAD),
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "owner.keystore"
        create_keystore(path, "bench passphrase")
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            unlock_keystore(path, "bench passphrase")
            times.append(time.perf_counter() - start)
    out["keystore_unlock_ms"] = statistics.median(times) * 1000
    return out


ROWS = [
    ("Ed25519 sign, 1 KiB + domain tag", "sign_per_s", "/s"),
    ("Ed25519 verify, 1 KiB + domain tag", "verify_per_s", "/s"),
    ("node certificate issue", "cert_issue_per_s", "/s"),
    ("node certificate verify (decode + checks)", "cert_verify_per_s", "/s"),
    ("envelope seal, plain, 256 B", "seal_plain_per_s", "/s"),
    ("envelope seal, encrypted, 256 B", "seal_encrypted_per_s", "/s"),
    ("envelope open, plain (with replay cache)", "open_plain_per_s", "/s"),
    ("envelope open, encrypted (with replay cache)", "open_encrypted_per_s", "/s"),
    (f"keystore unlock (argon2id ops={DEFAULT_OPSLIMIT}, mem={DEFAULT_MEMLIMIT >> 20} MiB)",
     "keystore_unlock_ms", "ms"),
    ("node certificate size", "cert_bytes", "B"),
    ("certificate token length", "cert_token_chars", "chars"),
    ("envelope overhead, plain", "envelope_plain_overhead_bytes", "B"),
    ("envelope overhead, encrypted", "envelope_encrypted_overhead_bytes", "B"),
]


def table(results: dict[str, float]) -> str:
    """The results as a Markdown table."""
    lines = ["| measure | value |", "|---|---|"]
    for label, key, unit in ROWS:
        value = results[key]
        text = f"{value:,.0f}" if unit != "ms" else f"{value:.1f}"
        lines.append(f"| {label} | {text} {unit} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per figure; the median is reported")
    parser.add_argument("--n", type=int, default=2000, help="operations per run")
    parser.add_argument("--out", type=Path, default=Path("bench/results/identity.json"))
    args = parser.parse_args()
    results = measure(args.runs, args.n)
    print(table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "runs": args.runs, "n": args.n, "machine": platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version()}
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
