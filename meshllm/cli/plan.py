"""``meshllm plan MODEL``: the chain the planner would choose, its memory per stage and predicted speed.

With a node running it asks ``GET /api/plan`` (the node's view of the mesh: workers, capacities,
RTT matrix); with none it plans this machine alone, which shows whether the model fits here, and
prices its compute by timing a decode step of the model's first blocks here
(:func:`~meshllm.engine.capacity.measure_layer_seconds`; where that cannot run, the plan says the
compute is an estimate from a matmul benchmark, which overprices memory-bound decoding). Either
way it first says whether the file can be split at all (the ggml stage runtime runs its family and
every tensor of it) and, if not, why: such a model still serves whole on one node (``--engine llama``).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

import click

from meshllm.cli.api_client import NodeApi, NodeUnreachable
from meshllm.cli.common import GIGABYTES, api_option, echo_json, json_option


@click.command()
@click.argument("model", default="default")
@api_option
@click.option("--stages", type=click.IntRange(1, 8), default=None, help="Force this many stages.")
@click.option("--max-memory", type=GIGABYTES, default=None, metavar="GB",
              help="Memory (GiB) this node may give the model (workers offer their own).")
@json_option
def plan(model: str, api: NodeApi, stages: int | None, max_memory: float | None, as_json: bool) -> None:
    """Show how MODEL (a GGUF path or 'default') would be placed: solo or a chain of stages."""
    verdict = split_verdict(model)
    if not verdict["splittable"]:
        if as_json:
            echo_json({"model": model, "split": verdict})
        else:
            click.echo(f"{model} cannot be split: {verdict['reason']}\n"
                       "It can still be served whole by one node: meshllm serve --engine llama --model MODEL")
        return
    query = {"model": model, **({"stages": stages} if stages else {}),
             **({"max_memory_gb": max_memory} if max_memory else {})}
    try:
        result = api.get_json("/api/plan?" + urlencode(query), timeout=30.0)
        source = f"the mesh as the node at {api} sees it"
    except NodeUnreachable:
        result = _local_plan(model, stages, max_memory)
        source = "this machine alone (no node running)"
    if as_json:
        echo_json({**result, "split": verdict})
        return
    experts = f", {verdict['experts'][0]} of {verdict['experts'][1]} experts per token" if verdict["experts"] else ""
    recurrent = verdict["recurrent"]
    hybrid = f", {recurrent[0]} of {recurrent[1]} layers recurrent (gated delta-net)" if recurrent else ""
    click.echo(f"{model} can be split: family {verdict['family']} ({verdict['examples']}){experts}{hybrid}")
    click.echo(_text(result, source))


def split_verdict(spec: str) -> dict[str, Any]:
    """Whether the model ``spec`` names can be split, from its header: its family, or why not.

    A split needs the ggml stage runtime to run every layer, so this is that runtime's own check
    (:func:`~meshllm.engine.ggml.weights.plan_stage` over all layers): the same refusal a split would meet.
    """
    from meshllm.engine.ggml.errors import UnsupportedModel
    from meshllm.engine.ggml.families import family_for
    from meshllm.engine.ggml.hparams import read_hparams
    from meshllm.engine.ggml.weights import plan_stage
    from meshllm.models.gguf_file import GGUFFile
    from meshllm.models.refs import resolve_model

    reader = GGUFFile(resolve_model(spec).path)
    try:
        hp = read_hparams(reader)
        plan_stage(reader, hp, 0, hp.n_layers)
    except UnsupportedModel as e:
        return {"splittable": False, "family": None, "reason": str(e)}
    family = family_for(hp.arch)
    return {"splittable": True, "family": family.arch, "examples": family.examples, "reason": None,
            "experts": [hp.n_expert_used, hp.n_expert] if hp.n_expert else None,
            "recurrent": [sum(hp.recurrent_layers), hp.n_layers] if any(hp.recurrent_layers) else None}


def _local_plan(spec: str, stages: int | None, max_memory_gb: float | None) -> dict[str, Any]:
    from meshllm.engine.capacity import measure_capacity, measure_layer_seconds
    from meshllm.errors import MeshllmError
    from meshllm.models.refs import resolve_model
    from meshllm.split.placement import describe, memory_budget, model_profile
    from meshllm.split.planner import GIB, Candidate, PlanOptions
    from meshllm.split.planner import plan as make_plan

    ref = resolve_model(spec)
    profile = model_profile(ref.path, 4096)
    capacity = measure_capacity()
    cap = int(max_memory_gb * GIB) if max_memory_gb else None
    try:
        per_layer: float | None = measure_layer_seconds(ref.path)
        measured = f"measured here: {per_layer * 1e3:.2f} ms per block per token (best of a few decode steps)"
    except MeshllmError as exc:
        per_layer = None
        measured = (f"not measured ({exc}); estimated from a {capacity.gflops:g} GFLOP/s matmul benchmark, "
                    "which overprices decoding")
    me = Candidate("local", memory_budget(capacity, cap), gflops=capacity.gflops, seconds_per_layer=per_layer)
    chosen = make_plan(profile, [me], {}, "local", PlanOptions(stages=stages))
    return {**describe(chosen, {"local": "this machine"}, ref.model_id, profile), "compute_source": measured}


def _text(result: dict[str, Any], source: str) -> str:
    pred = result["predicted_ms_per_token"]
    kind = "solo" if result["solo"] else f"{len(result['stages'])} stages"
    lines = [f"{result['model']} ({result['n_layers']} layers): {kind}, planned over {source}", ""]
    lines.append(f"  {'#':>2}  {'node':<20} {'layers':>9} {'memory':>10} {'compute':>10}")
    for i, s in enumerate(result["stages"]):
        start, end = s["layers"]
        lines.append(f"  {i:>2}  {s['name'][:20]:<20} {f'{start}-{end - 1}':>9} "
                     f"{s['memory_bytes'] / 2**30:>6.2f} GiB {s['compute_ms']:>7.1f} ms")
    lines += ["", f"  predicted {pred['total']:.1f} ms/token = compute {pred['compute']:.1f} + network "
                  f"{pred['network']:.1f} + per-hop overhead {pred['overhead']:.1f} ms"]
    if "compute_source" in result:
        lines.append(f"  compute {result['compute_source']}")
    return "\n".join(lines)
