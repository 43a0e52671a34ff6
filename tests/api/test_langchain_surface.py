"""LangChain's ``ChatOpenAI`` (langchain-openai) pointed at a node: chat, streaming and tool calls."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from tinymodels import TOOL_MODEL, TOOL_MODEL_REPLY

pytestmark = pytest.mark.timeout(120)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}


def test_langchain_chat_stream_and_tool_round_trip(surface: str) -> None:
    llm = ChatOpenAI(base_url=f"{surface}/v1", api_key="unused", model=TOOL_MODEL, max_retries=0, timeout=60)  # type: ignore
    assert llm.invoke("Hello").content == TOOL_MODEL_REPLY
    assert "".join(str(chunk.content) for chunk in llm.stream("Hello")) == TOOL_MODEL_REPLY
    tools = llm.bind_tools([WEATHER])
    asked = HumanMessage("Weather in Paris?")
    call = tools.invoke([asked])
    assert isinstance(call, AIMessage) and call.tool_calls[0]["name"] == "get_weather"
    assert call.tool_calls[0]["args"] == {"city": "Paris"}
    answer = tools.invoke([asked, call, ToolMessage("18 C", tool_call_id=call.tool_calls[0]["id"])])
    assert answer.content == TOOL_MODEL_REPLY and not answer.tool_calls  # type: ignore[union-attr]
