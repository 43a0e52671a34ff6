"""The stage core in memory: per-session order, dtype and plan membership, one frame of a lane at a
time, and every session's end (Stop, cancel, failure, a lost lane) at any moment of its life."""

from __future__ import annotations

import pytest
from core_helpers import CHAIN, LAST_CHAIN, UP, WIDTH, Harness, open_frame, prefill, raw, rows, step

from meshllm.split import Hop
from meshllm.split.frames import MAX_BATCH, Batch, Decode, Error, Open, Ping, Pong, Reset, Stop, Tokens
from meshllm.split.stage_core import (
    MAX_SESSIONS_PER_OWNER,
    HostedRange,
    LaneId,
    PassOut,
    ResetKV,
    RunPass,
    RunPrefill,
    StepOut,
)

NEXT = LaneId("next", 100)
"""The lane the harness dials to the next stage."""


def errors(actions: list[object]) -> list[Error]:
    return [a.frame for a in actions if isinstance(getattr(a, "frame", None), Error)]  # type: ignore[attr-defined]


def refused(h: Harness, frame: object, lane: LaneId = UP) -> Error:
    before = dict(h.core.sessions)
    positions = {sid: (s.low_pos, s.next_pos) for sid, s in before.items()}
    (error,) = errors(h.receive_raw(raw(frame), lane))
    assert h.core.sessions == before and positions == {s: (x.low_pos, x.next_pos) for s, x in before.items()}
    return error


def opened(*sessions: str) -> Harness:
    h = Harness()
    for sid in sessions:
        h.open(sid)
    return h


def test_steps_advance_in_order_and_errors_touch_one_session() -> None:
    h = opened("a")
    h.receive(step("a", 0))
    assert refused(h, step("a", 0)).code == "out-of-order"
    assert refused(h, step("a", 1, dtype="f16")).code == "bad-dtype"
    h.receive(step("a", 1))  # the refusals left the session where it was
    error = refused(h, step("b", 0))
    assert (error.code, error.session, error.stage) == ("not-in-plan", "b", 1)


def test_open_from_a_node_outside_the_plan_is_refused() -> None:
    error = refused(Harness(), open_frame("a"), LaneId("stranger", 9))
    assert error.code == "not-in-plan" and error.session == "a"


@pytest.mark.parametrize(("frame", "hosted", "code"), [
    (open_frame("a", [Hop("coord", "x:1", 0, 2), Hop("other", "x:2", 2, 4)]), None, "not-in-plan"),  # not me
    (Open(session="a", model="m", layer_start=2, layer_end=3, chain=[Hop("coord", "x:1", 0, 2),
          Hop("me", "x:2", 2, 3), Hop("n", "x:3", 3, 6)], index=1), None, "wrong-stage"),
    (open_frame("a"), HostedRange((2, 4), owner="coord", chain=LAST_CHAIN), "not-in-plan"),  # not the placed chain
    (open_frame("a"), HostedRange((2, 4), owner="someone"), "not-in-plan"),  # placed by another coordinator
])
def test_opens_outside_what_was_placed_here_are_refused(frame: Open, hosted: HostedRange | None, code: str) -> None:
    h = Harness()
    if hosted is not None:
        h.core.unhost("m", None)
        h.core.host("m", hosted)
    assert refused(h, frame).code == code and not h.jobs


def test_a_coordinator_may_keep_only_so_many_sessions() -> None:
    h = Harness(hosted=HostedRange((2, 4), owner="coord", chain=CHAIN))
    for i in range(MAX_SESSIONS_PER_OWNER):
        h.open(f"s{i}")
    assert refused(h, open_frame("one-more")).code == "busy"
    assert refused(h, open_frame("s0")).code == "duplicate"


def test_stop_forgets_the_session_and_travels_on() -> None:
    h = opened("a")
    h.receive(Stop(session="a"))
    assert h.core.sessions == {} and h.forgotten == ["a"] and h.sent_on(NEXT)[-1] == Stop(session="a")
    assert refused(h, step("a", 0)).code == "not-in-plan"


def test_after_a_verify_window_the_next_step_may_start_at_any_kept_length() -> None:
    h = opened("a")
    h.receive(step("a", 0))
    h.receive(step("a", 1, [7, 8, 9]))  # positions 1..4; the last stage keeps 0 to 3 drafts
    assert refused(h, step("a", 1)).code == "out-of-order"  # the window's first token is always kept
    assert refused(h, step("a", 6)).code == "out-of-order"
    h.receive(step("a", 3))  # two kept: the next step trims positions 3 and 4
    assert refused(h, step("a", 3)).code == "out-of-order"  # and after a Decode, exactly one position
    h.receive(step("a", 4, [5]))
    h.receive(step("a", 6, [1, 2]))  # everything kept: the next step follows the window's end
    h.receive(step("a", 9))


def test_a_verify_window_must_carry_one_position_more_than_its_drafts() -> None:
    h = opened("a")
    error = refused(h, step("a", 0, [7, 8], n=2))
    assert error.code == "bad-frame" and error.session == "a"
    h.receive(step("a", 0, [7, 8]))


def test_a_batch_moves_every_session_it_holds() -> None:
    h = opened("a", "b")
    h.receive(Batch(steps=[step("a", 0), step("b", 0, [5, 6])]))
    h.receive(Batch(steps=[step("a", 1), step("b", 2)]))  # b kept one draft of its window
    found = errors(h.receive_raw(raw(Batch(steps=[step("a", 1), step("b", 3)]))))  # a is at 2: refused whole
    assert [(e.session, e.code) for e in found] == [("a", "out-of-order"), ("b", "out-of-order")]
    h.run_all()
    passes = [f for f in h.sent_on(NEXT) if isinstance(f, Batch)]
    assert [[s.session for s in p.steps] for p in passes] == [["a", "b"], ["a", "b"]]


@pytest.mark.parametrize(("bad", "code"), [
    (Batch(steps=[step("a", 0), step("a", 1)]), "duplicate"),
    (Batch(steps=[step("a", 0), step("zz", 0)]), "not-in-plan"),  # a session this lane never opened
    (Batch(steps=[step("a", 0), step("b", 7)]), "out-of-order"),
    (Batch(steps=[step("a", 0), step("b", 0, n=2)]), "bad-frame"),  # a Decode of two positions
    (Batch(steps=[step("a", 0), step("b", 0, [1], n=3)]), "bad-frame"),  # a window of the wrong size
    (Batch(steps=[step("a", 0), Decode(session="b", pos=0, n_tokens=1, dtype="f32", shape=(1, WIDTH),
                                       activations=rows(2))]), "bad-size"),  # more bytes than its shape
])
def test_a_bad_batch_is_refused_whole_and_moves_nothing(bad: Batch, code: str) -> None:
    h = opened("a", "b")
    found = errors(h.receive_raw(raw(bad)))
    assert {e.session for e in found} == {s.session for s in bad.steps} and all(e.code == code for e in found)
    assert not h.jobs
    h.receive(Batch(steps=[step("a", 0), step("b", 0)]))  # both sessions are still where they were
    assert h.jobs


def test_too_large_and_garbled_batches_name_their_sessions() -> None:
    h = opened("a", "b")
    wide = Batch(steps=[step("a", 0), step("b", 0)])
    found = errors(h.receive_raw(raw(wide), max_activation_bytes=20))
    assert [(e.session, e.code) for e in found] == [("a", "too-large"), ("b", "too-large")]
    too_many = raw({"type": "batch", "steps": [{"type": "decode", "session": f"s{i}"} for i in range(MAX_BATCH + 1)]})
    assert len(errors(h.receive_raw(too_many))) == MAX_BATCH
    garbled = raw({"type": "batch", "steps": [{"type": "decode", "session": "a", "pos": "x"}, {"session": "b"}]})
    assert [e.session for e in errors(h.receive_raw(garbled))] == ["a", "b"]
    assert errors(h.receive_raw(raw({"type": "batch", "steps": []})))[0].code == "bad-frame"
    (lane_error,) = errors(h.receive_raw(b"\xc1"))  # not msgpack: the lane answers for itself
    assert lane_error.session == "" and lane_error.stage == 1


def test_pings_are_answered_at_once_with_the_session_length() -> None:
    h = opened("a")
    h.receive(prefill("a", 0, 5))
    h.receive(step("a", 5))  # queued behind the prefill, which is still computing
    (pong,) = [a.frame for a in h.receive(Ping(nonce=3, session="a"))]  # type: ignore[attr-defined]
    assert pong == Pong(nonce=3, pos=0)
    h.finish()
    assert h.receive(Ping(nonce=4, session="a"))[0].frame == Pong(nonce=4, pos=5)  # type: ignore[attr-defined]
    assert h.receive(Ping(nonce=5, session="zz"))[0].frame == Pong(nonce=5, pos=-1)  # type: ignore[attr-defined]


def test_a_lanes_frames_run_one_at_a_time_in_order() -> None:
    h = opened("a")
    h.receive(prefill("a", 0, 3))
    h.receive(step("a", 3))
    h.receive(Reset(session="a"))
    h.receive(prefill("a", 0, 2))
    kinds = []
    while h.jobs:
        assert len(h.jobs) == 1  # never two jobs of one lane at once
        kinds.append(type(h.jobs[0]).__name__)
        h.finish()
    assert kinds == ["RunPrefill", "RunPass", "ResetKV", "RunPrefill"]
    assert [type(f).__name__ for f in h.sent_on(NEXT)] == ["Open", "Prefill", "Decode", "Reset", "Prefill"]


def test_the_last_stage_answers_the_coordinator_with_tokens() -> None:
    h = Harness()
    h.open("a", LAST_CHAIN)
    coord = h.lanes["coord"]
    h.receive(prefill("a", 0, 4, sample=False))
    h.receive(prefill("a", 4, 2))
    h.receive(step("a", 6, [1, 2]))
    h.run_all()
    replies = h.sent_on(coord)
    assert [(t.pos, t.token_ids) for t in replies if isinstance(t, Tokens)] == [(6, [7]), (9, [7, 7, 7])]
    assert all(t.compute_ms == [1.0] for t in replies if isinstance(t, Tokens))


def test_tokens_and_unknown_errors_go_to_the_local_coordinator() -> None:
    h = Harness()
    tokens = Tokens(session="mine", pos=3, token_ids=[1])
    h.receive(tokens, LaneId("last", 5))
    h.receive(Error(session="mine", code="stage-error", message="x", stage=2), LaneId("next", 6))
    assert [d.frame for d in h.delivered] == [tokens, Error(session="mine", code="stage-error", message="x", stage=2)]


# -- every moment a session can end ------------------------------------------------------------------


def life(h: Harness) -> list[object]:
    """The frames of one session's life on this stage, each taken as far as it goes."""
    return [open_frame("a"), prefill("a", 0, 3), step("a", 3), step("a", 4, [1, 2]), Reset(session="a"),
            prefill("a", 0, 2), step("a", 2)]


def moments() -> list[int]:
    """Every point of ``life``: after each frame is read and after each of its jobs (one per frame)."""
    return list(range(2 * len(life(Harness())) + 1))


def run_to(h: Harness, moment: int) -> None:
    """Feed ``life`` and run its jobs until ``moment`` events (a frame read, or a job done) have happened."""
    events = 0
    for frame in life(h):
        if events >= moment:
            return
        h.receive(frame)  # type: ignore[arg-type]
        events += 1
        while h.jobs and events < moment:
            h.finish()
            events += 1


@pytest.mark.parametrize("moment", moments())
def test_a_cancel_at_any_moment_frees_the_session_once_and_stops_it_downstream(moment: int) -> None:
    h = Harness()
    h.receive(open_frame("b"))  # another session on the same lane
    h.run_all()
    run_to(h, moment)
    stranded = list(h.jobs)
    opened_downstream = any(isinstance(f, Open) and f.session == "a" for f in h.sent_on(NEXT))
    h.apply(h.core.lane_closed(UP, "client went away"))
    assert h.core.sessions == {}
    assert sorted(h.forgotten) == (["a", "b"] if moment else ["b"])  # each once: "a" from its Open on
    stops = [f.session for f in h.sent_on(NEXT) if isinstance(f, Stop)]
    assert sorted(stops) == (["a", "b"] if opened_downstream else ["b"])
    sent = len(h.sent)
    for job in stranded:  # the work in flight comes back to a table without its sessions
        h.finish(job)
    assert len(h.sent) == sent and not h.jobs


@pytest.mark.parametrize("moment", moments())
def test_a_failure_at_any_moment_fails_the_session_once_upstream(moment: int) -> None:
    h = Harness()
    run_to(h, moment)
    if not h.jobs:
        return
    job = h.jobs[0]
    h.finish(job, failed=True)
    if not any(isinstance(f, Error) for f in h.sent_on(UP)):
        return  # (the open had not been read yet)
    (error,) = [f for f in h.sent_on(UP) if isinstance(f, Error)]
    assert error.session == "a" and h.core.sessions == {} and h.forgotten == ["a"]
    if isinstance(job, RunPrefill | RunPass | ResetKV):  # opened on the next hop: stopped there too
        assert h.sent_on(NEXT)[-1] == Stop(session="a")
    h.run_all()
    assert len([f for f in h.sent_on(UP) if isinstance(f, Error)]) == 1


def test_a_stop_never_overtakes_the_pass_before_it() -> None:
    h = opened("a", "b")
    h.receive(Batch(steps=[step("a", 0), step("b", 0)]))
    h.receive(Stop(session="a"))  # read while the pass computes
    assert h.sent_on(NEXT)[-1] != Stop(session="a") and h.core.sessions.keys() == {"a", "b"}
    h.receive(step("b", 1))
    h.run_all()
    frames = [(type(f).__name__, getattr(f, "session", None)) for f in h.sent_on(NEXT)][2:]
    assert frames == [("Batch", None), ("Stop", "a"), ("Decode", "b")]
    assert h.forgotten == ["a"] and h.core.sessions.keys() == {"b"}


def test_a_batch_behind_a_stop_carries_on_without_the_stopped_session() -> None:
    h = opened("a", "b")
    h.receive(step("a", 0))
    h.receive(Stop(session="a"))
    h.receive(step("b", 0))
    h.run_all()
    assert [(type(f).__name__, getattr(f, "session", None)) for f in h.sent_on(NEXT)][2:] == [
        ("Decode", "a"), ("Stop", "a"), ("Decode", "b")]


def test_a_lane_lost_under_a_pass_fails_only_the_sessions_it_carried() -> None:
    h = Harness()
    h.open("a")
    h.open("z", LAST_CHAIN)  # this node is z's last stage: z's next hop is the coordinator, not "next"
    h.receive(step("a", 0))
    h.receive(prefill("z", 0, 2))
    assert isinstance(h.jobs[0], RunPass)
    h.apply(h.core.lane_closed(NEXT, "reset by peer"))
    (error,) = [f for f in h.sent_on(UP) if isinstance(f, Error)]
    assert (error.session, error.code, error.stage) == ("a", "hop-lost", 2)
    h.run_all()
    assert not any(isinstance(f, Decode) for f in h.sent_on(NEXT))  # the pass's outcome went nowhere
    assert h.core.sessions.keys() == {"z"} and h.forgotten == ["a"]
    assert [t.session for t in h.sent_on(h.lanes["coord"]) if isinstance(t, Tokens)] == ["z"]


def test_a_failed_send_fails_the_sessions_it_carried() -> None:
    h = opened("a", "b")
    h.receive(Batch(steps=[step("a", 0), step("b", 0)]))
    h.run_all()
    batch = h.sent_on(NEXT)[-1]
    h.apply(h.core.send_failed(NEXT, batch, "stalled"))
    assert sorted(f.session for f in h.sent_on(UP) if isinstance(f, Error)) == ["a", "b"]
    assert h.core.sessions == {}


def test_an_error_from_downstream_fails_the_session_upstream_without_stopping_it_there() -> None:
    h = opened("a")
    h.receive(Error(session="a", code="stage-error", message="boom", stage=2), NEXT)
    assert h.sent_on(UP)[-1] == Error(session="a", code="stage-error", message="boom", stage=2)
    assert not any(isinstance(f, Stop) for f in h.sent_on(NEXT)) and h.core.sessions == {}
    assert not h.delivered


def test_a_suspect_next_hop_fails_its_sessions_at_once() -> None:
    h = opened("a")
    h.receive(step("a", 0))
    h.apply(h.core.peer_lost("next", "hop-suspect", "no probe answers"))
    assert h.sent_on(UP)[-1] == Error(session="a", code="hop-suspect", message="no probe answers", stage=2)


def test_a_step_that_finds_the_session_elsewhere_fails_it() -> None:
    h = opened("a")
    h.receive(step("a", 0))
    (job,) = h.jobs
    h.finish(job, PassOut([StepOut(5, 1.0, refused="session a is at position 5 here")]))
    assert h.sent_on(UP)[-1].code == "stage-error" and h.sent_on(NEXT)[-1] == Stop(session="a")  # type: ignore[union-attr]


def test_a_reopened_session_never_gets_the_old_sessions_queued_steps() -> None:
    h = opened("a", "b")
    h.receive(step("b", 0))  # computing
    h.receive(step("a", 0))  # queued behind it
    h.receive(Error(session="a", code="stage-error", message="boom", stage=2), NEXT)  # a fails meanwhile
    h.receive(open_frame("a"))  # and is opened again under the same id, behind its old step
    h.run_all()
    assert [(type(f).__name__, f.session) for f in h.sent_on(NEXT)[2:]] == [("Decode", "b"), ("Open", "a")]  # type: ignore[union-attr]
    assert h.core.sessions["a"].next_pos == 0
