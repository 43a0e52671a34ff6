"""Split planner (sans-IO): choose solo or a chain of stages that minimises predicted time per token.

Cost model of plain decoding (the Mesh-LLM model with our RTT matrix)::

    time/token = sum(stage compute) + sum(hop latency around the ring) + S * P + Q

Activations travel coordinator -> stage 1 -> ... -> last stage and the sampled token comes straight
back to the coordinator, so a token crosses each of the ``S`` edges of the ring once; an edge costs half
its RTT (a 2-stage chain costs exactly one RTT) plus ``P``, the protocol overhead of one lane frame
(encode, QUIC on both ends, decode: about 1.5 ms here, measured per edge by ``bench/wan.py``). Compute
is ``layers x seconds/layer`` plus the head on the last stage, priced at the same node's speed. ``Q``
is the coordinator's own time per token outside the chain (its engine, the API, the stream), which a
running chain measures (0 when unknown).

With speculation (:class:`Speculation`), one pass carries ``k`` drafted tokens and yields ``E(k) =
1 + a + ... + a^k`` tokens at acceptance ``a``. Every stage but the last runs all ``k + 1`` positions;
the last stage stops at the first rejected one, so it runs ``E(k)`` of them on average::

    pass(k)   = sum(hop latency) + S * P + upstream compute * (k + 1) + last compute * E(k)
    time/token = min over k of pass(k) / E(k) + Q

The hops are paid once per pass, so the longer the ring, the wider the best window and the larger
the gain (``a = 0`` gives ``k = 0``: plain decoding).

For a fixed ordered set of nodes, compute is linear in each node's layer count, so the best split
gives every node one layer and the rest to the fastest nodes first, up to what their memory holds.
The planner enumerates ordered node sets (coordinator first, few candidates, few stages) and keeps
the cheapest; a tie keeps fewer stages, so a stage is added only when memory forces it or it predicts
faster. Every input is a plain value; the caller (the node) builds them from gossip and from what its
running chains measured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise, permutations

from meshllm.engine.speculate import MAX_WINDOW, expected_tokens
from meshllm.split.errors import NoChainFits

GIB = 1024**3


@dataclass(frozen=True)
class ModelProfile:
    """What a model costs, per layer and for its ends (from ``estimate_memory`` and the GGUF header)."""

    n_layers: int
    layer_bytes: int
    """Memory of one block as the stage holds it (stored, quantized bytes) plus its KV for the planned context."""
    first_bytes: int
    """Extra memory of the first stage (token embeddings)."""
    last_bytes: int
    """Extra memory of the last stage (output norm, head, a row of logits)."""
    layer_flops: float
    """Floating-point operations per token through one block (about 2 x its parameters)."""
    head_flops: float = 0.0
    """Floating-point operations per token of the head (2 x width x vocabulary)."""
    stage_bytes: int = 0
    """Memory every stage needs whatever its layers: compute buffers for a full prompt chunk."""
    shared_bytes: int = 0
    """Part of ``first_bytes`` that ``last_bytes`` counts again (a tied embedding/head table), held
    once by a stage that is both first and last."""

    def ends_bytes(self, first: bool, last: bool) -> int:
        """What a stage holds besides its layers: compute buffers, and the embeddings and/or head."""
        return self.stage_bytes + (self.first_bytes if first else 0) + (self.last_bytes if last else 0) - (
            self.shared_bytes if first and last else 0)

    @property
    def whole_bytes(self) -> int:
        """The whole model on one node."""
        return self.n_layers * self.layer_bytes + self.ends_bytes(True, True)


@dataclass(frozen=True)
class Candidate:
    """A node that might run a stage."""

    node_id: str
    memory_bytes: int
    """Usable memory for model weights and KV: the node's own budget (its own ``--max-memory``, never
    another node's; there is no mesh-wide cap)."""
    gflops: float = 0.0
    """Measured compute speed; used when ``seconds_per_layer`` is not known."""
    seconds_per_layer: float | None = None
    """Measured time of one block for one token (more accurate than gflops when known); the head is
    priced at the same speed (``head_flops / layer_flops`` blocks' worth)."""
    role: str = "host"
    relay_only: bool = False
    """A peer reachable only through a relay: never a stage (every hop would double its latency)."""


@dataclass(frozen=True)
class PlanOptions:
    """Knobs of :func:`plan`."""

    stages: int | None = None
    """Force exactly this many stages (benchmarks, tests); None chooses."""
    max_stages: int = 4
    per_hop_overhead_s: float = 0.0015
    """P: protocol overhead per edge of the ring (each lane frame), beyond half the edge's RTT."""
    unknown_rtt_ms: float = 100.0
    """Assumed RTT between nodes the matrix has no measurement for (pessimistic)."""
    assumed_gflops: float = 5.0
    """Speed of a node that has not measured itself yet."""
    max_candidates: int = 8
    """Only the best few nodes (by speed and memory) are considered, to bound the search."""
    speculation: Speculation | None = None
    """Price chains with speculative decoding at this acceptance (None: plain decoding)."""
    serve_overhead_s: float = 0.0
    """Q: the coordinator's own time per token between passes (its engine, the API, the stream)."""


@dataclass(frozen=True)
class Speculation:
    """What speculation is expected to achieve: the per-token acceptance and the widest window."""

    acceptance: float
    """Probability that a drafted token is kept (measured on a running chain; 0 makes no difference)."""
    max_window: int = MAX_WINDOW


@dataclass(frozen=True)
class PlannedStage:
    """One stage of a plan with its predicted cost."""

    node_id: str
    layer_start: int
    layer_end: int
    memory_bytes: int
    compute_s: float


@dataclass(frozen=True)
class Plan:
    """The chosen chain and its predicted time per token, broken down."""

    stages: tuple[PlannedStage, ...]
    compute_s: float
    network_s: float
    overhead_s: float
    serve_s: float = 0.0
    """Q, the serving node's time per token outside the chain (a measured constant)."""
    window: int = 0
    """Drafts per pass the speculation model chose (0: plain decoding)."""
    tokens_per_pass: float = 1.0
    speculative_s: float | None = None
    """Predicted seconds per token with speculation (None: not priced)."""

    @property
    def total_s(self) -> float:
        """Predicted seconds per generated token with plain decoding."""
        return self.compute_s + self.network_s + self.overhead_s + self.serve_s

    @property
    def expected_s(self) -> float:
        """What the plan is chosen by: seconds per token with speculation when priced, else plain."""
        return self.total_s if self.speculative_s is None else self.speculative_s

    @property
    def solo(self) -> bool:
        """One node runs the whole model."""
        return len(self.stages) == 1

    @property
    def chain(self) -> list[tuple[str, int, int]]:
        """``[(node_id, layer_start, layer_end)]`` in order; the first is the coordinator."""
        return [(s.node_id, s.layer_start, s.layer_end) for s in self.stages]


Held = Mapping[str, Collection[tuple[int, int]]]
"""Node id -> the layer ranges it keeps on disk for the model (a stage it hosted, a warm spare)."""


def plan(
    model: ModelProfile,
    candidates: Sequence[Candidate],
    rtt_ms: Mapping[str, Mapping[str, float]],
    requester: str,
    options: PlanOptions | None = None,
) -> Plan:
    """The cheapest plan for ``requester``; :class:`NoChainFits` names the memory shortfall if none fits.

    The requester coordinates (runs stage 0) when it is a candidate that can hold the embeddings and
    one layer; otherwise every eligible node is tried as coordinator.
    """
    opts = options or PlanOptions()
    best = _search(model, candidates, rtt_ms, requester, opts, None)
    if best is None:
        raise _no_fit(model, _eligible(candidates, opts), opts.stages or opts.max_stages)
    return best


def plan_held(
    model: ModelProfile,
    candidates: Sequence[Candidate],
    rtt_ms: Mapping[str, Mapping[str, float]],
    requester: str,
    held: Held,
    options: PlanOptions | None = None,
) -> Plan | None:
    """The cheapest plan whose every stage after the first lies inside a range its node keeps on disk
    (``held``): a chain that forms without a transfer. None when no such chain fits.

    The first stage (the coordinator, which has the whole file) may take any range. Boundaries are
    not the free plan's (all spare layers to the fastest node): each ordered chain gets the cheapest
    split its nodes' held ranges and memory allow (:func:`_held_counts`).
    """
    return _search(model, candidates, rtt_ms, requester, options or PlanOptions(), held)


def _search(model: ModelProfile, candidates: Sequence[Candidate], rtt_ms: Mapping[str, Mapping[str, float]],
            requester: str, opts: PlanOptions, held: Held | None) -> Plan | None:
    """The cheapest plan over ordered node sets (``held``: only splits inside those ranges), or None."""
    nodes = _eligible(candidates, opts)
    by_id = {c.node_id: c for c in nodes}
    me = by_id.get(requester)
    firsts = [me] if me is not None and _cap(model, me, first=True, last=False) >= 1 else nodes
    sizes = [opts.stages] if opts.stages else list(range(1, opts.max_stages + 1))
    best: Plan | None = None
    for first in firsts:
        others = [c for c in nodes if c.node_id != first.node_id and (held is None or held.get(c.node_id))]
        for size in sizes:
            for rest in permutations(others, size - 1):
                found = _price(model, (first, *rest), rtt_ms, opts, held)
                if found is not None and (best is None or found.expected_s < best.expected_s - 1e-12):
                    best = found
    return best


def _eligible(candidates: Sequence[Candidate], opts: PlanOptions) -> list[Candidate]:
    """Stage-capable nodes, best first (fast, then roomy), at most ``max_candidates``."""
    usable = [c for c in candidates if not c.relay_only and c.role != "client" and c.memory_bytes > 0]
    usable.sort(key=lambda c: (-_speed(c, opts), -c.memory_bytes, c.node_id))
    return usable[: opts.max_candidates]


def _speed(c: Candidate, opts: PlanOptions) -> float:
    if c.seconds_per_layer:
        return 1.0 / c.seconds_per_layer
    return c.gflops or opts.assumed_gflops


def _layer_s(model: ModelProfile, c: Candidate, opts: PlanOptions) -> float:
    if c.seconds_per_layer is not None:
        return c.seconds_per_layer
    return model.layer_flops / ((c.gflops or opts.assumed_gflops) * 1e9)


def _cap(model: ModelProfile, c: Candidate, *, first: bool, last: bool) -> int:
    """How many layers ``c`` can hold in this position of the chain."""
    free = c.memory_bytes - model.ends_bytes(first, last)
    if free < 0:
        return 0
    if model.layer_bytes <= 0:
        return model.n_layers
    return min(model.n_layers, free // model.layer_bytes)


def _price(
    model: ModelProfile, chain: tuple[Candidate, ...], rtt_ms: Mapping[str, Mapping[str, float]], opts: PlanOptions,
    held: Held | None = None,
) -> Plan | None:
    """The best layer split over this ordered chain (inside ``held`` when given), or None when it cannot
    hold the model."""
    n = len(chain)
    caps = [_cap(model, c, first=i == 0, last=i == n - 1) for i, c in enumerate(chain)]
    if min(caps) < 1 or sum(caps) < model.n_layers or n > model.n_layers:
        return None
    per_layer = [_layer_s(model, c, opts) for c in chain]
    if held is not None:
        found = _held_counts(model.n_layers, caps, per_layer, [held.get(c.node_id, ()) for c in chain[1:]])
        if found is None:
            return None
        counts = found
    else:
        counts = [1] * n
        left = model.n_layers - n
        for i in sorted(range(n), key=lambda i: per_layer[i]):
            take = min(left, caps[i] - 1)
            counts[i] += take
            left -= take
    stages: list[PlannedStage] = []
    start = 0
    for i, c in enumerate(chain):
        end = start + counts[i]
        last = i == n - 1
        compute = counts[i] * per_layer[i]
        if last:
            compute += _head_s(model, c, opts)
        memory = counts[i] * model.layer_bytes + model.ends_bytes(i == 0, last)
        stages.append(PlannedStage(c.node_id, start, end, memory, compute))
        start = end
    network = 0.0
    if n > 1:
        ring = [*chain, chain[0]]
        network = sum(_rtt(rtt_ms, a.node_id, b.node_id, opts) / 2 for a, b in pairwise(ring))
        network /= 1000.0
    overhead = n * opts.per_hop_overhead_s if n > 1 else 0.0
    plain = Plan(tuple(stages), sum(s.compute_s for s in stages), network, overhead, opts.serve_overhead_s)
    return _speculate(plain, opts.speculation) if opts.speculation is not None and n > 1 else plain


def _held_counts(n_layers: int, caps: list[int], per_layer: list[float],
                 held: list[Collection[tuple[int, int]]]) -> list[int] | None:
    """Layer counts of the cheapest split of ``n_layers`` over a chain whose stage ``i + 1`` must lie
    inside one of ``held[i]`` (stage 0 is free), each stage holding 1 to ``caps[i]`` layers; None when
    no split does. Compute is linear in each stage's layers, so a dynamic program over the boundaries
    (``best[b]``: the cheapest stages so far ending at layer ``b``) finds the optimum; ties keep the
    earlier boundary, so the result does not depend on dict or set order."""
    best: dict[int, tuple[float, tuple[int, ...]]] = {
        end: (end * per_layer[0], (end,)) for end in range(1, min(caps[0], n_layers) + 1)}
    for i, ranges in enumerate(held, start=1):
        last = i == len(caps) - 1
        step: dict[int, tuple[float, tuple[int, ...]]] = {}
        for start in sorted(best):
            cost, counts = best[start]
            reach = max((b for a, b in ranges if a <= start < b), default=start)
            for end in range(start + 1, min(start + caps[i], reach, n_layers) + 1):
                if last and end != n_layers:
                    continue
                total = cost + (end - start) * per_layer[i]
                if end not in step or total < step[end][0] - 1e-15:
                    step[end] = (total, (*counts, end - start))
        best = step
    done = best.get(n_layers)
    return list(done[1]) if done is not None else None


def _speculate(plain: Plan, spec: Speculation) -> Plan:
    """``plain`` with the window that minimises ``pass(k) / E(k)`` and its time per token."""
    upstream = sum(s.compute_s for s in plain.stages[:-1])
    last = plain.stages[-1].compute_s
    fixed = plain.network_s + plain.overhead_s
    best_k, best_e, best_s = 0, 1.0, plain.total_s
    for k in range(1, spec.max_window + 1):
        e = expected_tokens(spec.acceptance, k)
        per_token = (fixed + upstream * (k + 1) + last * e) / e + plain.serve_s
        if per_token < best_s - 1e-12:
            best_k, best_e, best_s = k, e, per_token
    return dataclasses.replace(plain, window=best_k, tokens_per_pass=best_e, speculative_s=best_s)


def _head_s(model: ModelProfile, c: Candidate, opts: PlanOptions) -> float:
    """The head's time on ``c``: at its measured block speed when known (as so many blocks' worth), else by gflops."""
    if c.seconds_per_layer is not None and model.layer_flops > 0:
        return c.seconds_per_layer * model.head_flops / model.layer_flops
    return model.head_flops / ((c.gflops or opts.assumed_gflops) * 1e9)


def _rtt(rtt_ms: Mapping[str, Mapping[str, float]], a: str, b: str, opts: PlanOptions) -> float:
    ms = rtt_ms.get(a, {}).get(b)
    if ms is None:
        ms = rtt_ms.get(b, {}).get(a, opts.unknown_rtt_ms)
    return ms


def _no_fit(model: ModelProfile, nodes: list[Candidate], max_stages: int) -> NoChainFits:
    roomiest = sorted((c.memory_bytes for c in nodes), reverse=True)[:max_stages]
    need = model.whole_bytes + max(0, len(roomiest) - 1) * model.stage_bytes  # each stage has its buffers
    have = sum(roomiest)
    short = max(need - have, 0)
    if not nodes:
        why = "no eligible node (relay-only peers and clients cannot be stages)"
        short = need
    elif short:
        why = f"the {len(roomiest)} roomiest eligible nodes offer {have / GIB:.2f} GiB: {short / GIB:.2f} GiB short"
    else:
        why = "enough memory in total, but no node can hold the embeddings or the head with a layer"
    return NoChainFits(
        f"model needs {need / GIB:.2f} GiB in at most {max_stages} stages; {why}", shortfall_bytes=short
    )
