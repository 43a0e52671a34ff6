"""The bundled Gemma 3 270M (a base model, no chat template) answers chat through the API."""

from __future__ import annotations

import asyncio

import openai
import pytest
from api_server import serve

from meshllm.api.app import LocalBackend, create_app
from meshllm.engine.llama import LlamaEngine
from meshllm.models import resolve_model


@pytest.mark.slow
def test_bundled_gemma_chat_returns_text() -> None:
    engine = LlamaEngine(resolve_model("gemma", progress=False), n_ctx=512)
    asyncio.run(engine.load())
    try:
        assert engine.chat_format == "gemma"  # the GGUF has no template; the family format is used
        with serve(create_app(LocalBackend([engine]))) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            reply = client.chat.completions.create(
                model="gemma-3-270m-q4_k_m", max_tokens=16, temperature=0,
                messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert reply.choices[0].message.content and reply.choices[0].message.content.strip()
        assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 16
    finally:
        asyncio.run(engine.close())
