"""The audit core (sans-IO): the schedule and ranges a recomputation follows, token judgement with its
tolerance, stage records (what a worker keeps, bounded) and attribution of a failed audit."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from meshllm.engine.sampler import Sampler
from meshllm.split.audit import (
    EXPIRED,
    BadRecord,
    Recorder,
    StageRecord,
    TokenChecker,
    attribute,
    audit_ranges,
    check_record,
    rows_close,
    schedule,
)
from meshllm.split.frames import Hop, Sampling

W = 4


def test_schedule_is_the_chains_prefill_chunks_then_one_call_per_position() -> None:
    assert schedule(600, 603, 256) == [(0, 256), (256, 512), (512, 600), (600, 601), (601, 602), (602, 603)]
    assert schedule(5, 5, 256) == [(0, 5)]


def test_ranges_cut_stages_to_the_memory_bound_and_never_cross_a_stage() -> None:
    chain = [Hop("a", "x:1", 0, 3), Hop("b", "x:2", 3, 8)]
    cost = lambda a, b: 10 * (b - a)  # noqa: E731
    assert audit_ranges(chain, cost, 1000) == [(0, 3), (3, 8)]
    assert audit_ranges(chain, cost, 20) == [(0, 2), (2, 3), (3, 5), (5, 7), (7, 8)]
    assert audit_ranges(chain, cost, 1) == [(i, i + 1) for i in range(8)]  # one layer even over the bound


def test_greedy_tokens_are_judged_within_eps_of_the_max() -> None:
    logits = np.array([0.0, 5.0, 4.995, 1.0], np.float32)
    checker = TokenChecker(Sampling(), prompt=[], eps=0.01)
    assert checker.check(logits, 1) and checker.check(logits, 2)  # 2 is within eps: a near tie
    assert not checker.check(logits, 3)
    assert checker.first_bad == 2 and checker.expected == 1
    assert checker.check(logits, 1) and checker.first_bad == 2 and checker.judged == 4


def test_sampled_tokens_must_be_the_seeded_draw() -> None:
    sampling = Sampling(temperature=0.9, top_k=30, seed=42)
    rng = np.random.default_rng(0)
    rows = [rng.standard_normal(300).astype(np.float32) * 3 for _ in range(40)]
    sampler, history, drawn = Sampler(sampling, step=sampling.step), [], []
    for row in rows:
        drawn.append(sampler(row, history))
        history.append(drawn[-1])
    honest = TokenChecker(sampling, prompt=[])
    assert all(honest.check(row, t) for row, t in zip(rows, drawn, strict=True))
    forged = list(drawn)
    forged[17] = int(np.argsort(rows[17])[0])  # the least likely token: never within the slack
    checker = TokenChecker(sampling, prompt=[])
    results = [checker.check(row, t) for row, t in zip(rows, forged, strict=True)]
    assert checker.first_bad == 17 and checker.expected == drawn[17] and results.count(False) == 1


def test_penalties_use_the_prompt_as_history() -> None:
    sampling = Sampling(presence_penalty=10.0)
    logits = np.array([0.0, 5.0, 4.0], np.float32)
    assert TokenChecker(sampling, prompt=[1]).check(logits, 2)  # 1 was in the prompt: penalised below 2
    assert not TokenChecker(sampling, prompt=[0]).check(logits, 2)


def test_rows_close_is_relative_to_the_rows_magnitude() -> None:
    a = np.full((3, W), 100.0, np.float32)
    assert rows_close(a + 0.05, a) and not rows_close(a + 0.5, a)
    assert not rows_close(a[:2], a)


def record(i: int, inputs: np.ndarray, outputs: np.ndarray | None = None, tokens: list[int] | None = None,
           complete: bool = True) -> StageRecord:
    return StageRecord(model="m", session="s", coordinator="c", layer_start=i, layer_end=i + 1, width=W,
                       positions=len(inputs), inputs=inputs.astype(np.float32).tobytes(),
                       outputs=b"" if outputs is None else outputs.astype(np.float32).tobytes(),
                       tokens=tokens or [], complete=complete)


N = 5
H = [np.random.default_rng(i).standard_normal((N, W)).astype(np.float32) for i in range(3)]
"""Honest outputs of stages 0, 1, 2 of a 4-stage chain (stage 3 is the last)."""
TOKENS = [7, 8, 9]


def honest_records() -> list[StageRecord | str]:
    return [record(1, H[0], H[1]), record(2, H[1], H[2]), record(3, H[2], tokens=TOKENS)]


def judge(records: list[StageRecord | str], received: list[int] = TOKENS) -> tuple[tuple[int, ...], str]:
    verdict = attribute(honest=H, received=received, records=records, first_bad=1, n_prompt=3)
    return verdict.stages, verdict.kind


def test_attribution_names_the_stage_whose_output_is_not_its_layers() -> None:
    records = honest_records()
    records[1] = record(2, H[1], H[2] + 1.0)  # stage 2 forged its output ...
    records[2] = record(3, H[2] + 1.0, tokens=TOKENS)  # ... and stage 3 honestly computed on it
    assert judge(records) == ((2,), "forged")


def test_attribution_of_the_last_stage() -> None:
    assert judge(honest_records()) == ((3,), "forged")  # its input is honest, its tokens are not
    assert judge(honest_records(), received=[7, 1, 9]) == ((3,), "lied")  # it sent other tokens than it records


def test_attribution_of_inputs_that_do_not_match() -> None:
    # stage 1 claims the coordinator sent something else (and computed on it, as the stages after it)
    records: list[StageRecord | str] = [record(1, H[0] * 2, H[1] + 1), record(2, H[1] + 1, H[2] + 1),
                                        record(3, H[2] + 1, tokens=TOKENS)]
    assert judge(records) == ((1,), "lied")
    # stage 2 claims an input stage 1 does not record sending: one of the two lies
    records = [record(1, H[0], H[1]), record(2, H[1] + 1, H[2] + 1), record(3, H[2] + 1, tokens=TOKENS)]
    assert judge(records) == ((1, 2), "dispute")


def test_missing_and_short_records() -> None:
    records = honest_records()
    records[0] = "no answer"
    stages, kind = judge(records)
    assert stages == (1, 3) and kind == "unaccountable"  # the silent stage, and the forger still found
    records = honest_records()
    records[1] = record(2, H[1][:2], H[2][:2], complete=False)  # too long to keep: not judged
    assert judge(records) == ((3,), "forged")
    records[1] = record(2, H[1][:2], H[2][:2])  # complete but short: it ran fewer positions than it did
    assert judge(records)[1] == "unaccountable"


def test_a_failure_no_record_explains_is_unattributed() -> None:
    records = honest_records()
    records[2] = record(3, H[2] + 1.0, tokens=TOKENS)  # fed what stage 2 does not record sending
    assert judge(records) == ((2, 3), "dispute")
    short = [record(i, h[:2], h[:2], complete=False) for i, h in enumerate(H, start=1)]
    assert judge(short) == ((1, 2, 3), "unattributed")  # no record covers the request: every worker goes
    assert judge([EXPIRED, EXPIRED, EXPIRED]) == ((1, 2, 3), "unattributed")  # asked too late to judge


def test_check_record_refuses_records_that_do_not_fit_the_query() -> None:
    hop = Hop("w", "x:1", 1, 2)
    good = record(1, H[0], H[1])
    check_record(good, model="m", session="s", coordinator="c", hop=hop, width=W, last=False)
    for bad, kwargs in [
        (good, {"session": "other"}), (good, {"width": W + 1}), (good, {"last": True}),
        (good, {"hop": Hop("w", "x:1", 1, 3)}),
        (msgspec.structs.replace(good, positions=N + 1), {}),
        (msgspec.structs.replace(good, tokens=[1]), {}),
    ]:
        args = {"model": "m", "session": "s", "coordinator": "c", "hop": hop, "width": W, "last": False, **kwargs}
        with pytest.raises(BadRecord):
            check_record(bad, **args)  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def rows(n: int, v: float = 1.0) -> np.ndarray:
    return np.full((n, W), v, np.float32)


def test_recorder_keeps_rows_trims_windows_and_answers_only_the_coordinator() -> None:
    rec = Recorder()
    rec.start("s", coordinator="c", model="m", layers=(1, 2), width=W, last=False)
    rec.step("s", 0, rows(3), rows(3, 2.0), window=False)
    rec.step("s", 3, rows(4), rows(4, 3.0), window=True)  # a window of 4 positions, 1 kept ...
    rec.step("s", 4, rows(1, 5.0), rows(1, 6.0), window=False)  # ... the next step trims the other 3
    got = rec.get("s", "c")
    assert got is not None and got.positions == 5 and got.complete
    assert got.rows("inputs")[:, 0].tolist() == [1, 1, 1, 1, 5]
    assert got.rows("outputs")[:, 0].tolist() == [2, 2, 2, 3, 6]
    assert rec.get("s", "intruder") is None and rec.get("other", "c") is None
    rec.step("s", 9, rows(1), rows(1), window=False)  # a gap: the record is no longer whole
    assert not rec.get("s", "c").complete  # type: ignore[union-attr]


def test_recorder_tokens_of_the_last_stage() -> None:
    rec = Recorder()
    rec.start("s", coordinator="c", model="m", layers=(2, 3), width=W, last=True)
    rec.step("s", 0, rows(3), np.zeros((1, 9)), window=False)  # a prompt chunk that samples nothing
    rec.step("s", 3, rows(2), [5], window=False)  # the final chunk: one token
    rec.step("s", 5, rows(4), [6, 7], window=True)  # a window rejected at its second position
    got = rec.get("s", "c")
    assert got is not None and got.positions == 7 and got.tokens == [5, 6, 7] and got.outputs == b""


def test_recorder_is_bounded_in_time_and_bytes() -> None:
    clock = Clock()
    rec = Recorder(ttl_s=10.0, session_bytes=1000, total_bytes=1500, clock=clock)
    rec.start("a", coordinator="c", model="m", layers=(1, 2), width=W, last=False)
    rec.step("a", 0, rows(20), rows(20), window=False)  # 640 bytes
    rec.step("a", 20, rows(20), rows(20), window=False)  # would pass 1000: not kept
    assert rec.get("a", "c").positions == 20 and not rec.get("a", "c").complete  # type: ignore[union-attr]
    rec.start("b", coordinator="c", model="m", layers=(1, 2), width=W, last=False)
    rec.step("b", 0, rows(20), rows(20), window=False)
    rec.start("d", coordinator="c", model="m", layers=(1, 2), width=W, last=False)
    rec.step("d", 0, rows(20), rows(20), window=False)  # 1920 bytes in all: the oldest goes
    assert rec.get("a", "c") is None and rec.get("b", "c") is not None and rec.nbytes <= 1500
    clock.now = 11.0
    assert rec.get("b", "c") is None and rec.get("d", "c") is None and rec.nbytes == 0


def test_audit_policy_audits_every_request_until_probation_then_decays_to_the_rate() -> None:
    from meshllm.split.audit import PROBATION, AuditPolicy

    policy = AuditPolicy(0.05)
    assert policy.probability(["new"]) == 1.0
    for _ in range(PROBATION):
        policy.record_pass(["old", "new"])
    assert policy.probability(["old"]) == 1.0  # 8 / 8
    for _ in range(PROBATION):
        policy.record_pass(["old"])
    assert policy.probability(["old"]) == 0.5
    assert policy.probability(["old", "stranger"]) == 1.0  # the least-known worker decides
    for _ in range(1000):
        policy.record_pass(["old"])
    assert policy.probability(["old"]) == 0.05
    policy.forget(["old"])
    assert policy.probability(["old"]) == 1.0
    assert AuditPolicy(0.0).probability(["new"]) == 0.0
