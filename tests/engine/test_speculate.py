"""The speculation core: n-gram drafts, expected tokens, acceptance, the window choice, the acceptance rule."""

from __future__ import annotations

import numpy as np
import pytest

from meshllm.engine.base import SamplingParams
from meshllm.engine.sampler import Sampler
from meshllm.engine.speculate import (
    Acceptance,
    ChainCosts,
    NgramDrafter,
    SpecStats,
    WindowPolicy,
    batch_cost,
    expected_tokens,
    verify_window,
)


def test_draft_continues_the_latest_occurrence_of_the_longest_suffix() -> None:
    d = NgramDrafter([1, 2, 3, 4, 5, 9, 9, 2, 3, 4, 6, 7, 1, 2, 3])
    # suffix [1, 2, 3] occurred at the start, followed by 4, 5, 9; [2, 3] alone would pick the later 4, 6
    assert d.draft(3) == [4, 5, 9]
    assert d.draft(0) == []
    d.extend([4, 6])  # now [3, 4, 6] recurs: its continuation wins over the older [1, 2, 3, 4]
    assert d.draft(2) == [7, 1]


def test_no_draft_without_a_repeated_ngram() -> None:
    assert NgramDrafter([5, 6, 7, 8]).draft(4) == []
    assert NgramDrafter([]).draft(4) == []
    assert NgramDrafter([5, 6, 5]).draft(4) == []  # one-token matches are below min_n
    assert NgramDrafter([5, 6, 5], min_n=1).draft(2) == [6, 5]


def test_a_loop_keeps_looping_past_the_end() -> None:
    d = NgramDrafter([7, 1, 2, 3, 1, 2, 3, 1, 2])
    assert d.draft(7) == [3, 1, 2, 3, 1, 2, 3]


def test_incremental_extend_equals_one_call() -> None:
    tokens = list(np.random.default_rng(0).integers(0, 6, 300))
    whole = NgramDrafter(tokens)
    parts = NgramDrafter()
    for i in range(0, 300, 7):
        parts.extend(tokens[i : i + 7])
    assert whole.tokens == parts.tokens and whole.draft(8) == parts.draft(8)


def test_expected_tokens() -> None:
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_acceptance_counts_one_rejection_per_short_pass() -> None:
    acc = Acceptance(prior=0.5, prior_weight=2.0, decay=1.0)
    assert acc.rate == 0.5
    acc.observe(drafted=8, accepted=8)
    acc.observe(drafted=8, accepted=2)  # 2 kept, then one mismatch; the 5 after it were never judged
    assert acc.rate == pytest.approx((10 + 1) / (11 + 2))


def costs(fixed: float, per_position: float, per_token: float) -> ChainCosts:
    """Chain costs measured from one plain pass with these parts."""
    c = ChainCosts()
    c.observe(fixed + per_position + per_token, 1, 1, per_position, per_token)
    return c


def test_window_is_wide_when_the_pass_is_latency_bound_and_narrow_when_compute_bound() -> None:
    policy = WindowPolicy("auto")
    policy.acceptance = Acceptance(prior=0.8, prior_weight=1e9)
    latency_bound = costs(0.065, 0.0055, 0.0136)
    compute_bound = costs(0.001, 0.020, 0.002)
    wide, narrow = policy.window(16, latency_bound), policy.window(16, compute_bound)
    assert wide >= 6 and narrow <= 1
    assert policy.window(3, latency_bound) == 3  # never more than the drafter found


def test_auto_stops_drafting_what_is_rejected_and_on_does_not() -> None:
    c = costs(0.01, 0.02, 0.002)
    auto, on = WindowPolicy("auto"), WindowPolicy("on")
    for policy in (auto, on):
        for _ in range(20):
            policy.observe(drafted=4, accepted=0)
    assert auto.window(8, c) == 0
    assert on.window(8, c) == 1
    assert WindowPolicy("off").window(8, c) == 0
    with pytest.raises(ValueError):
        WindowPolicy("sometimes")  # type: ignore[arg-type]


def test_chain_costs_split_a_pass_into_its_parts() -> None:
    costs = ChainCosts()
    assert not costs.measured
    costs.observe(total_s=0.100, positions=5, tokens=2, upstream_s=0.025, last_s=0.020)
    assert (costs.fixed, costs.per_position, costs.per_token) == pytest.approx((0.055, 0.005, 0.010))
    assert costs(4, 2.0) == pytest.approx(0.100)
    costs.observe(total_s=0.100, positions=5, tokens=2, upstream_s=0.025, last_s=0.020)
    costs.observe(total_s=2.000, positions=5, tokens=2, upstream_s=0.500, last_s=0.400)  # a stall
    assert costs.per_token == pytest.approx(0.010)  # medians: one spike moves nothing


def test_stats() -> None:
    stats = SpecStats("auto")
    stats.observe(drafted=0, accepted=0, tokens=1)
    stats.observe(drafted=6, accepted=3, tokens=4)
    assert stats.status() == {"mode": "auto", "passes": 2, "verify_passes": 1, "drafted": 6, "accepted": 3,
                              "acceptance": 0.5, "tokens_per_pass": 2.5, "window": 6}


LOGITS = np.log(np.array([0.5, 0.25, 0.125, 0.0625, 0.0625], dtype=np.float32))


def verify(sampler: Sampler, logits: np.ndarray, history: list[int], draft: int) -> tuple[int, bool]:
    """One drafted position through :func:`verify_window`: the token it yields and whether the draft was kept."""
    out = verify_window([draft], lambda i: sampler(logits, history) if i == 0 else -1)  # -1: the bonus position
    return out[0], len(out) == 2


def test_window_keeps_the_agreeing_prefix_then_the_models_token() -> None:
    model = [5, 6, 7, 9, 10]
    asked: list[int] = []

    def produce(i: int) -> int:
        asked.append(i)
        return model[i]

    assert verify_window([5, 6, 8, 9], produce) == [5, 6, 7] and asked == [0, 1, 2]  # nothing after a rejection
    assert verify_window([5, 6], lambda i: model[i]) == [5, 6, 7]  # all kept: the model's next token too
    assert verify_window([], lambda i: model[i]) == [5]  # a plain step
    assert verify_window([5, 6, 7], lambda i: None if i == 1 else model[i]) == [5]  # the text ended at 1


def test_greedy_verify_keeps_exactly_the_argmax() -> None:
    s = Sampler(SamplingParams(temperature=0.0))
    assert verify(s, LOGITS, [], 0) == (0, True)
    assert verify(s, LOGITS, [], 3) == (0, False)
    # penalties apply as in plain sampling: a repeated token loses its lead
    p = Sampler(SamplingParams(temperature=0.0, presence_penalty=2.0))
    assert verify(p, LOGITS, [0], 1) == (1, True) and p(LOGITS, [0]) == 1


@pytest.mark.parametrize(("params", "draft"), [
    (SamplingParams(temperature=1.0, seed=1), 2),
    (SamplingParams(temperature=1.0, seed=2), 0),
    (SamplingParams(temperature=0.7, top_k=3, seed=3), 4),  # a draft outside the top-k is never kept
    (SamplingParams(temperature=1.0, top_p=0.8, seed=4), 1),
])
def test_sampled_verify_is_the_speculative_rule_coupled_to_the_plain_draw(params: SamplingParams, draft: int) -> None:
    """With the same seed every verified token is the one plain sampling draws, so the draft is kept with
    probability p(draft) and a replacement follows p without the draft: the standard rule's properties."""
    n = 4000
    plain, spec = Sampler(params), Sampler(params)
    tokens = [plain(LOGITS) for _ in range(n)]
    outcomes = [verify(spec, LOGITS, [], draft) for _ in range(n)]
    assert [t for t, _ in outcomes] == tokens
    assert all(kept == (t == draft) for t, kept in outcomes)
    assert 0 < sum(kept for _, kept in outcomes) < n or params.top_k  # both outcomes happen (top-k: never kept)


def test_batch_cost_backs_off_when_the_call_is_already_wide() -> None:
    """Alone, a window is priced at its call's time; beside many slots its gain is a smaller share of the
    step's tokens, so the same acceptance and call costs give a narrower window, then none."""
    def call(rows: int) -> float:  # a call streams the weights once (10 ms) and computes 2 ms a row
        return 0.010 + 0.002 * rows

    assert batch_cost(call, 1, 0.0)(3, 2.5) == pytest.approx(call(4))
    windows = []
    for busy in (1, 2, 8):
        policy = WindowPolicy("auto")
        policy.acceptance = Acceptance(prior=0.7, prior_weight=1e9)
        windows.append(policy.window(8, batch_cost(call, busy, busy - 1.0)))
    assert windows[0] > windows[1] > 0 and windows[2] == 0, windows
    # the other slots' windows count: beside one that already yields 3 tokens, a second window pays less
    policy = WindowPolicy("auto")
    policy.acceptance = Acceptance(prior=0.7, prior_weight=1e9)
    assert policy.window(8, batch_cost(call, 2 + windows[1], 1.0 + 2.0)) < windows[1]


def test_auto_wants_a_clear_gain_before_it_drafts() -> None:
    """A window predicted barely faster than a plain step (5 %) is not worth the noise in the costs."""
    c = costs(0.005, 0.010, 0.016)
    for margin, expect_drafts in ((0.1, False), (0.0, True)):
        policy = WindowPolicy("auto", margin=margin)
        policy.acceptance = Acceptance(prior=0.72, prior_weight=1e9)
        assert (policy.window(8, c) > 0) == expect_drafts


def test_declined_drafts_are_judged_for_free_by_the_plain_tokens() -> None:
    """auto learns that drafts are good without verifying any, then starts verifying them."""
    c = costs(0.005, 0.005, 0.017)
    policy = WindowPolicy("auto", prior=0.3)
    draft = [5, 6, 7, 8]
    assert policy.window(4, c) == 0
    for _ in range(6):
        policy.decline(draft)
        policy.decline([9, 9])  # one pending judgement at a time
        for token in draft:
            policy.produced([token])
    assert policy.acceptance.rate > 0.8 and policy.window(4, c) > 0
    policy.decline([1, 2, 3])
    policy.produced([1])
    policy.produced([4])  # the second drafted token was wrong: 1 kept, 1 rejection
    assert policy._shadow is None
