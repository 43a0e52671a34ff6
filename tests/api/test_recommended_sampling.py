"""A model's recommended sampling fills what a request leaves out, on every API and every engine.

The tiny model's GGUF says ``general.sampling.temp = 0`` (greedy); the node's ``config.toml`` says
``temperature = 1.5`` for it too (the file wins), ``max_tokens = 6`` and a system prompt. Each
engine (llama.cpp, ``--engine ggml``, a 2-stage split over real nodes) is asked through the real
``openai`` and ``anthropic`` clients with those fields left out, and must answer exactly as a
request that sets them explicitly; fields a request sets win; ``min_p`` and ``repeat_penalty`` are
honoured per request.
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest
from nodes import NodeProcess, running_nodes
from tinymodels import write_tiny_llama

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny"
SYSTEM = "Answer in one word."
CONFIG = f"""
[models.{MODEL}]
temperature = 1.5
max_tokens = 6
system_prompt = "{SYSTEM}"
"""
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module", params=["llama", "ggml", "split"])
def node(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """A node serving the tiny model with recommended sampling from its file and its config.toml."""
    tmp = tmp_path_factory.mktemp(f"recommended-{request.param}")
    gguf = write_tiny_llama(tmp / f"{MODEL}.gguf", n_layers=4, seed=5, metadata={"general.sampling.temp": 0.0})
    (tmp / "n").mkdir(mode=0o700)
    (tmp / "n" / "config.toml").write_text(CONFIG)
    args = {"llama": [], "ggml": ["--engine", "ggml"], "split": ["--split", "force", "--stages", "2"]}[request.param]
    with running_nodes() as nodes:
        coord = NodeProcess(tmp / "n", ["--model", str(gguf), "--threads", "1", *args], "n")
        nodes.append(coord)
        token = coord.wait_ready()["invite"]
        if request.param == "split":
            nodes.append(NodeProcess(tmp / "w", ["--worker", "--join", token, "--threads", "1"], "w"))
            coord.wait_event(lambda e: e["type"] == "split_ready", 60.0)
        yield coord


def openai_client(node: NodeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.api}/v1", api_key="unused", max_retries=0, timeout=60)


def test_left_out_fields_take_the_models_recommendation_on_every_api(node: NodeProcess) -> None:
    client = openai_client(node)
    explicit = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=6,
                                              messages=[{"role": "system", "content": SYSTEM}, *HI])
    assert explicit.usage is not None and explicit.usage.completion_tokens == 6
    expected = explicit.choices[0].message.content

    for _ in range(2):  # greedy from the GGUF (not config's 1.5, not OpenAI's 1): the same text each time
        filled = client.chat.completions.create(model=MODEL, messages=HI)  # type: ignore[arg-type]
        assert filled.choices[0].message.content == expected and filled.choices[0].finish_reason == "length"
        assert filled.usage is not None and filled.usage.prompt_tokens == explicit.usage.prompt_tokens

    streamed = client.chat.completions.create(model=MODEL, messages=HI, stream=True)  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected

    response = client.responses.create(model=MODEL, input="hi")
    assert response.output_text == expected and response.usage is not None and response.usage.output_tokens == 6

    claude = anthropic.Anthropic(base_url=node.api, api_key="unused", max_retries=0, timeout=60)
    message = claude.messages.create(model=MODEL, max_tokens=6, messages=HI)  # type: ignore[arg-type]
    assert "".join(b.text for b in message.content if b.type == "text") == expected

    own_system = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=6,
                                                messages=[{"role": "system", "content": "x"}, *HI])
    assert own_system.usage is not None and own_system.usage.prompt_tokens < explicit.usage.prompt_tokens

    text = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8)
    greedy = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0)
    assert text.choices[0].text == greedy.choices[0].text


def test_fields_a_request_sets_win_and_min_p_and_repeat_penalty_are_honoured(node: NodeProcess) -> None:
    client = openai_client(node)

    def complete(**kwargs: object) -> str:
        return client.completions.create(model=MODEL, prompt="Hello", max_tokens=24, **kwargs).choices[0].text  # type: ignore[call-overload]

    greedy = complete(temperature=0)
    sampled = {complete(temperature=2.0, seed=seed) for seed in (1, 2, 3)}
    assert len(sampled) > 1 and greedy not in sampled  # temperature set: no longer the GGUF's greedy
    # min_p 1 keeps only the most likely token: any seed, any temperature gives the greedy text
    assert {complete(temperature=2.0, seed=seed, extra_body={"min_p": 1.0}) for seed in (1, 2)} == {greedy}
    penalised = complete(temperature=0, extra_body={"repeat_penalty": 1.5})
    assert penalised != greedy
    assert complete(temperature=0, extra_body={"repeat_penalty": 1.0}) == greedy


def test_bad_min_p_and_repeat_penalty_are_refused_naming_the_field(node: NodeProcess) -> None:
    client = openai_client(node)
    for field, value in (("min_p", 1.5), ("min_p", -0.1), ("repeat_penalty", 0.0), ("repeat_penalty", -1.0)):
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            client.chat.completions.create(model=MODEL, messages=HI, extra_body={field: value})  # type: ignore[arg-type]
        assert caught.value.body["param"] == field  # type: ignore[index]
