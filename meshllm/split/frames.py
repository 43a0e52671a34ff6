"""The stage-lane protocol: msgspec tagged structs over ``u32 length + msgpack`` frames.

A lane is one persistent QUIC stream of kind ``stage-lane`` from a stage to the next one (and from the
last stage back to the coordinator); many sessions share it. Per session the coordinator sends one
:class:`Open` (it travels down the chain, each stage forwarding it with ``index + 1``), then
:class:`Prefill` chunks and one :class:`Decode` per generated token; the last stage answers each
step that asks for a sample with :class:`Tokens`, straight to the coordinator. :class:`Reset` empties
a session's KV caches, :class:`Stop` frees them. :class:`Error` travels back towards the coordinator.

Several sessions of one chain decode together as one :class:`Batch` per pass (continuous batching):
their Decodes and Verify windows in one frame, run by each stage as one forward per round.

Speculation replaces a Decode with a :class:`Verify`: the last accepted token and ``k`` drafted ones as
one window of ``k + 1`` positions, through the chain as one frame; the last stage keeps the longest
prefix of the draft it agrees with and answers with those tokens plus its own next one. The KV of the
rejected positions is trimmed by the next step itself: its ``pos`` (the accepted length) may be
anywhere in the window, and each stage cuts its cache back to it before computing. Every step
carries the compute time of each stage it passed (``compute_ms``), which :class:`Tokens` hands back
to the coordinator: the pass costs that size the next window and check the planner's prediction.

The session's sampling travels in the Open (with the request's grammar, the continuation tokens the
grammar has produced, and how many logprobs to report); :class:`Tokens` carries the logprobs back.

Everything a peer sends is checked here before it touches state: :func:`decode_frame` turns any
bytes into a frame or a :class:`~meshllm.split.errors.BadFrame` that names the session when it can be
read, so the receiver can refuse that session alone and keep the lane (and the other sessions) going.
"""

from __future__ import annotations

import itertools
import math
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from meshllm.engine.base import SamplingParams
from meshllm.engine.gbnf import MAX_GRAMMAR_CHARS
from meshllm.engine.sampler import MAX_LOGPROBS
from meshllm.split import codec
from meshllm.split.codec import Dtype
from meshllm.split.errors import BadFrame

KIND = "stage-lane"
"""Stream kind of stage lanes."""
LANE_FRAME_MAX = 32 * 1024 * 1024
"""Transport cap on one lane frame; above it the stream itself is reset (every session on it fails)."""
MAX_POS = 1 << 24
"""Largest position a session may reach (far above any context we run)."""

SessionId = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
Pos = Annotated[int, Meta(ge=0, le=MAX_POS)]
Count = Annotated[int, Meta(ge=1, le=MAX_POS)]
Layer = Annotated[int, Meta(ge=0, le=4096)]
TokenId = Annotated[int, Meta(ge=0, lt=1 << 31)]
Finish = Literal["stop", "length"]
MAX_DRAFT = 16
"""Most drafted tokens in one :class:`Verify` (the window is one more position)."""
MAX_BATCH = 64
"""Most sessions in one :class:`Batch`."""
ComputeMs = Annotated[list[Annotated[float, Meta(ge=0.0, le=1e7)]], Meta(max_length=64)]
"""Milliseconds of compute per stage, in chain order from stage 1."""


class Hop(msgspec.Struct, frozen=True, array_like=True):
    """One stage of a chain: who runs which layers, and where to dial it."""

    node_id: Annotated[str, Meta(min_length=1, max_length=128)]
    addr: Annotated[str, Meta(max_length=300)]
    """``host:port`` of the node's QUIC endpoint."""
    layer_start: Layer
    layer_end: Layer


class Sampling(SamplingParams, frozen=True, kw_only=True):
    """The request's sampling for the last stage (:class:`~meshllm.engine.base.SamplingParams`, greedy
    unless set), plus the request's grammar, logprobs and the step its draws start at."""

    temperature: float = 0.0
    grammar: Annotated[str, Meta(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None
    """A GBNF grammar every sampled token must keep the text inside (checked again by the last stage
    before llama.cpp sees it); ``None``: free text."""
    generated: list[TokenId] = msgspec.field(default_factory=list)
    """The tokens at the end of the prompt that were generated before (a request's continuation):
    the grammar has produced them already, and the last stage advances it over them first."""
    step: Annotated[int, Meta(ge=0, le=MAX_POS)] = 0
    """How many tokens the request generated before this session (on another chain or engine): the
    session's first token takes draw ``step`` of the seeded stream, so a replay continues it exactly."""
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    """``k``: every :class:`Tokens` carries each token's logprob and its ``k`` most likely alternatives."""


class Open(msgspec.Struct, frozen=True, kw_only=True, tag="open"):
    """Start ``session`` on the receiving stage, ``chain[index]``; forwarded down with ``index + 1``."""

    session: SessionId
    model: Annotated[str, Meta(min_length=1, max_length=256)]
    layer_start: Layer
    layer_end: Layer
    dtype: Dtype = "f32"
    """Activation codec for this session's frames on every hop."""
    chain: list[Hop]
    """The whole plan; ``chain[0]`` is the coordinator, which gets the :class:`Tokens`."""
    index: Annotated[int, Meta(ge=1)]
    sampling: Sampling = Sampling()
    history: list[TokenId] = []
    """Prompt token ids, for the last stage's repetition penalties (empty when none are used)."""
    max_context: Count = 4096


class _Step(msgspec.Struct, frozen=True, kw_only=True):
    session: SessionId
    pos: Pos
    """Position of the first row; must equal the session's length on the receiving stage."""
    n_tokens: Count
    dtype: Dtype
    shape: tuple[Count, Count]
    """``(n_tokens, width)``."""
    activations: bytes
    compute_ms: ComputeMs = []
    """Compute time of each stage this step has passed after the coordinator (appended hop by hop)."""


class Prefill(_Step, frozen=True, kw_only=True, tag="prefill"):
    """A chunk of prompt activations; ``sample`` on the final chunk asks the last stage for a token."""

    sample: bool = True


class Decode(_Step, frozen=True, kw_only=True, tag="decode"):
    """The activations of one generated token; the last stage always answers with :class:`Tokens`."""


class Verify(_Step, frozen=True, kw_only=True, tag="verify"):
    """A speculative window: the last accepted token then ``draft`` at positions ``pos .. pos + len(draft)``.

    Every stage runs the positions one by one, exactly as it would run Decodes (so what is kept is bit
    for bit what plain decoding computes); the last stage stops at the first position whose sample
    differs from the draft and answers :class:`Tokens` with the kept drafts plus that sample.
    """

    draft: Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_DRAFT)]


class Batch(msgspec.Struct, frozen=True, kw_only=True, tag="batch"):
    """One decode pass of several sessions: per session a :class:`Decode` or a :class:`Verify` window.

    The coordinator groups the steps of every session ready in the same tick; each stage runs its
    layers once for all their rows (a window's positions one per round, beside the other sessions'
    rows), forwards one Batch, and the last stage answers each session with its own :class:`Tokens`.
    Sessions are distinct; the whole batch is refused (an Error for each session it names) if any
    step is invalid.
    """

    steps: Annotated[list[Decode | Verify], Meta(min_length=1, max_length=MAX_BATCH)]


class Reset(msgspec.Struct, frozen=True, tag="reset"):
    """Empty ``session``'s KV caches on every stage (the session stays open, back at position 0)."""

    session: SessionId


class Stop(msgspec.Struct, frozen=True, tag="stop"):
    """End ``session`` on every stage and free its KV caches."""

    session: SessionId


class Ping(msgspec.Struct, frozen=True, tag="ping"):
    """Lane liveness probe; with ``session`` the pong reports that session's length on the stage."""

    nonce: int
    session: str = ""


class Pong(msgspec.Struct, frozen=True, tag="pong"):
    """Answer to :class:`Ping`; ``pos`` is the session's cached length (-1: unknown session)."""

    nonce: int
    pos: int = -1


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """A sampled token's log-probability and the most likely alternatives at its position (ids only:
    the coordinator has the vocabulary's text)."""

    logprob: float
    top: Annotated[list[tuple[TokenId, float]], Meta(max_length=MAX_LOGPROBS)] = []


class Tokens(msgspec.Struct, frozen=True, kw_only=True, tag="tokens"):
    """Last stage -> coordinator: token(s) sampled after the step that ended at ``pos``."""

    session: SessionId
    pos: Pos
    """Length of the session (tokens consumed) when these tokens were sampled."""
    token_ids: Annotated[list[TokenId], Meta(min_length=1, max_length=64)]
    finish: Finish | None = None
    compute_ms: ComputeMs = []
    """The step's ``compute_ms`` with the last stage's own time appended."""
    logprobs: Annotated[list[TokenLogprobs], Meta(max_length=64)] = []
    """One entry per token of ``token_ids`` when the session's :attr:`Sampling.logprobs` asked for them."""


BAD_REQUEST = "bad-request"
"""The :class:`Error` code of a stage refusing what the request asks (a grammar llama.cpp refuses, a
continuation the grammar forbids): the client's fault, so the coordinator answers 400 and replans nothing."""


class Error(msgspec.Struct, frozen=True, kw_only=True, tag="error"):
    """A stage refused or failed a frame of ``session`` ("" for the whole lane)."""

    session: str
    code: str
    message: str
    stage: int
    """Index in the chain of the stage at fault (not necessarily the one reporting)."""


LaneFrame = Open | Prefill | Decode | Verify | Batch | Reset | Stop | Ping | Pong | Tokens | Error
Step = Prefill | Decode | Verify

_decoder = msgspec.msgpack.Decoder(LaneFrame)


class _SessionOnly(msgspec.Struct):
    session: str = ""


_session_decoder = msgspec.msgpack.Decoder(_SessionOnly)


class _SessionsOnly(msgspec.Struct):
    steps: list[_SessionOnly] = []


_sessions_decoder = msgspec.msgpack.Decoder(_SessionsOnly)
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, RecursionError)


def session_of(raw: bytes) -> str:
    """The session a (possibly invalid) frame claims, or "" when that cannot be read either."""
    try:
        session = _session_decoder.decode(raw).session
    except _DECODE_ERRORS:
        return ""
    return session if 0 < len(session) <= 64 else ""


def sessions_of(raw: bytes) -> tuple[str, ...]:
    """The sessions a (possibly invalid) frame claims: its one session, or a batch's (at most :data:`MAX_BATCH`)."""
    if session := session_of(raw):
        return (session,)
    try:
        steps = _sessions_decoder.decode(raw).steps
    except _DECODE_ERRORS:
        return ()
    return tuple(dict.fromkeys(s.session for s in steps[:MAX_BATCH] if 0 < len(s.session) <= 64))


def decode_frame(raw: bytes, *, max_activation_bytes: int | None = None) -> LaneFrame:
    """One validated lane frame from a frame body; :class:`BadFrame` (naming the session if readable) if not."""
    try:
        frame = _decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, RecursionError) as exc:
        raise BadFrame(f"malformed lane frame: {exc}", sessions=sessions_of(raw)) from None
    validate(frame, max_activation_bytes=max_activation_bytes)
    return frame


def validate(frame: LaneFrame, *, max_activation_bytes: int | None = None) -> None:
    """Cross-field checks msgspec's per-field constraints cannot express; :class:`BadFrame` on failure."""
    if isinstance(frame, Prefill | Decode | Verify):
        _validate_step(frame, max_activation_bytes)
    elif isinstance(frame, Batch):
        _validate_batch(frame, max_activation_bytes)
    elif isinstance(frame, Open):
        _validate_open(frame)
    elif isinstance(frame, Tokens):
        _validate_tokens(frame)


def _validate_step(frame: Step, max_bytes: int | None) -> None:
    s = frame.session
    n, width = frame.shape
    if n != frame.n_tokens:
        raise BadFrame(f"shape {list(frame.shape)} disagrees with n_tokens={frame.n_tokens}", session=s)
    if isinstance(frame, Decode) and n != 1:
        raise BadFrame(f"a decode frame carries one token, got {n}", session=s)
    if isinstance(frame, Verify) and n != len(frame.draft) + 1:
        raise BadFrame(f"a verify window of {len(frame.draft)} drafts carries {len(frame.draft) + 1} positions, "
                       f"got {n}", session=s)
    if frame.pos + n > MAX_POS:
        raise BadFrame(f"position {frame.pos}+{n} exceeds {MAX_POS}", session=s)
    if max_bytes is not None and len(frame.activations) > max_bytes:
        raise BadFrame(
            f"{len(frame.activations)} bytes of activations exceed this lane's {max_bytes}-byte limit",
            code="too-large", session=s,
        )
    expected = codec.encoded_size(frame.dtype, n, width)
    if len(frame.activations) != expected:
        raise BadFrame(
            f"{frame.dtype} activations of shape [{n}, {width}] take {expected} bytes, got {len(frame.activations)}",
            code="bad-size", session=s,
        )


def _validate_batch(frame: Batch, max_bytes: int | None) -> None:
    """Every step valid, each session once, and all activations together within the lane's limit."""
    sessions = tuple(dict.fromkeys(step.session for step in frame.steps))
    if len(sessions) != len(frame.steps):
        raise BadFrame("a batch names a session twice", code="duplicate", sessions=sessions)
    total = sum(len(step.activations) for step in frame.steps)
    if max_bytes is not None and total > max_bytes:
        raise BadFrame(f"{total} bytes of activations in a batch exceed this lane's {max_bytes}-byte limit",
                       code="too-large", sessions=sessions)
    for step in frame.steps:
        try:
            _validate_step(step, max_bytes)
        except BadFrame as exc:
            raise BadFrame(f"session {step.session}: {exc}", code=exc.code, sessions=sessions) from None


def _validate_open(frame: Open) -> None:
    s = frame.session
    chain = frame.chain
    if not 2 <= len(chain) <= 64 or frame.index >= len(chain):
        raise BadFrame(f"open for stage {frame.index} of a {len(chain)}-stage chain", session=s)
    if chain[0].layer_start != 0 or any(a.layer_end != b.layer_start for a, b in itertools.pairwise(chain)):
        raise BadFrame("the chain's layer ranges are not contiguous from layer 0", session=s)
    if any(h.layer_end <= h.layer_start for h in chain):
        raise BadFrame("the chain has an empty stage", session=s)
    if len({h.node_id for h in chain}) != len(chain):
        raise BadFrame("a node appears twice in the chain", session=s)
    mine = chain[frame.index]
    if (mine.layer_start, mine.layer_end) != (frame.layer_start, frame.layer_end):
        raise BadFrame("the open's layer range differs from its chain entry", session=s)
    if len(frame.sampling.generated) >= frame.max_context:
        raise BadFrame(f"{len(frame.sampling.generated)} generated tokens do not fit a {frame.max_context}-token "
                       "context", session=s)


def _validate_tokens(frame: Tokens) -> None:
    s = frame.session
    if frame.logprobs and len(frame.logprobs) != len(frame.token_ids):
        raise BadFrame(f"{len(frame.logprobs)} logprobs for {len(frame.token_ids)} tokens", session=s)
    values = [v for entry in frame.logprobs for v in (entry.logprob, *(lp for _, lp in entry.top))]
    if not all(math.isfinite(v) and v <= 0.0 for v in values):
        raise BadFrame("a logprob is not a finite number <= 0", session=s)
