"""Tool calling, chat templates and the reasoning split through the real
openai SDK against a daemon on loopback: tool_choice required and a named
function give calls whose arguments validate against the schema (llama.cpp
and the torch runtime), streamed calls assembled by the SDK equal the
whole answer, a conversation carries a tool result into the next turn,
`auto` reads the model's own `<tool_call>` text, a model.toml
chat_template replaces the GGUF's and its reasoning_parser splits
`<think>` off into reasoning_content, and bad tool input is a 400 naming
the field while the daemon keeps serving."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from daemon import MODELS, start_daemon

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME_SCHEMA = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 32}},
               "required": ["timezone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather forecast for a city",
                                      "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "description": "The current time in a timezone",
                                      "parameters": TIME_SCHEMA}},
]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
# a template of our own for the override model: plain ChatML without
# SmolLM2's default system turn, opening a think block for the answer
THINK_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """A daemon of this module's own: smollm2 on llama.cpp, and the same
    weights with a chat_template file and reasoning_parser in model.toml, and
    on the torch runtime."""
    root = tmp_path_factory.mktemp("repo")
    gguf = (MODELS / "smollm2" / "model.gguf").resolve()
    for name, extra in (("smollm2", ""), ("smollm2-think", 'chat_template = "chat.jinja"\n'
                                                           'reasoning_parser = "think"\n')):
        (root / name).mkdir()
        (root / name / "model.gguf").symlink_to(gguf)
        (root / name / "model.toml").write_text(
            f'format = "gguf"\nbackends = ["llamacpp"]\nartifact = "model.gguf"\n{extra}'
            "[llamacpp]\nn_ctx = 4096\nn_slots = 2\ncontext_length = 2048\nn_threads = 2\n")
    (root / "smollm2-think" / "chat.jinja").write_text(THINK_TEMPLATE)
    (root / "smollm2-torch").mkdir()
    (root / "smollm2-torch" / "model.gguf").symlink_to(gguf)
    (root / "smollm2-torch" / "model.toml").write_text(
        'format = "gguf"\nbackends = ["torch"]\nartifact = "model.gguf"\n'
        "[torch]\ndtype = \"float32\"\ncompile = false\nnum_blocks = 64\ncontext_length = 1024\n")
    # each model loads on its first request: the torch one only for its test
    daemon = start_daemon("--no-preload", repository=root)
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def client(own):
    with openai.OpenAI(base_url=f"{own.http_url}/v1", api_key="none", max_retries=0, timeout=600) as c:
        yield c


@pytest.fixture(scope="module")
def raw(own):
    with httpx.Client(base_url=own.http_url, timeout=600) as c:
        yield c


def _check_calls(message, names: set[str]) -> list:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return message.tool_calls


# -- required and named calls ------------------------------------------------------------


def test_required_gives_a_call_valid_for_its_schema(client):
    answer = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=96, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = _check_calls(choice.message, set(SCHEMAS))


def test_a_named_function_is_the_one_called(client):
    answer = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, max_tokens=64, temperature=0.7, seed=3, n=2,
        parallel_tool_calls=False, tool_choice={"type": "function", "function": {"name": "get_time"}})
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls"
        assert [c.function.name for c in _check_calls(choice.message, {"get_time"})] == ["get_time"]


def test_streamed_calls_assembled_by_the_sdk_equal_the_whole_answer(client):
    kwargs = dict(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  max_tokens=96, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    with client.chat.completions.stream(**kwargs) as stream:
        deltas = [event.chunk.choices[0].delta for event in stream if event.type == "chunk" and event.chunk.choices]
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    [call], [whole_call] = final.message.tool_calls, whole.message.tool_calls
    assert (call.function.name, call.function.arguments) == (whole_call.function.name, whole_call.function.arguments)
    fragments = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert fragments[0].id == call.id and fragments[0].function.name == call.function.name
    assert len(fragments) > 2, "the arguments arrive in fragments as they are generated"
    assert all(f.id is None and f.function.name is None for f in fragments[1:])


@pytest.mark.slow  # three long prompts; the history's rendering is unit-tested (test_chat_template)
def test_a_tool_result_carries_into_the_next_turn(client):
    first = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, max_tokens=96,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny", "high": 24}'}]
    answer = client.chat.completions.create(model="smollm2", messages=history, tools=TOOLS, max_tokens=24,
                                            temperature=0, tool_choice="none")
    without = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=1, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    # the call and its result are in the prompt (rendered as Hermes text by SmolLM2's template)
    assert answer.usage.prompt_tokens > without.usage.prompt_tokens + 20


def test_auto_reads_the_models_own_tool_call_text(client):
    """The text is steered by a regex (vLLM's structured_outputs) so the
    model surely writes a call; auto parses it like any answer."""
    regex = r'<tool_call>\n\{"name": "get_time", "arguments": \{"timezone": "Europe/[A-Z][a-z]{2,8}"\}\}\n</tool_call>'
    kwargs = dict(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=64, temperature=0,
                  extra_body={"structured_outputs": {"regex": regex}})
    message = client.chat.completions.create(**kwargs).choices[0].message
    [call] = _check_calls(message, {"get_time"})
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    streamed = "".join(tc.function.arguments or "" for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or [])
    assert streamed == call.function.arguments


@pytest.mark.slow
def test_tool_choice_none_leaves_the_answer_as_text(client):
    regex = r'<tool_call>\{"name": "get_time", "arguments": \{\}\}</tool_call>'
    message = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="none",
                                             max_tokens=32, temperature=0,
                                             extra_body={"structured_outputs": {"regex": regex}}).choices[0].message
    assert message.tool_calls is None and message.content.startswith("<tool_call>")


# -- templates and reasoning -------------------------------------------------------------------


def test_the_model_toml_template_replaces_the_ggufs(client):
    """SmolLM2's own template adds a default system turn; the override does not."""
    own = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=1, temperature=0)
    override = client.chat.completions.create(model="smollm2-think", messages=ASK, max_tokens=1, temperature=0)
    assert override.usage.prompt_tokens < own.usage.prompt_tokens - 10


def test_reasoning_is_split_from_the_content(client):
    regex = r"<think>[a-z ]{4,40}</think>\n\n[A-Z][a-z]{2,12}\."
    kwargs = dict(model="smollm2-think", messages=ASK, max_tokens=64, temperature=0,
                  extra_body={"structured_outputs": {"regex": regex}})
    message = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in message.content
    assert message.content[0].isupper() and message.content.endswith(".")
    chunks = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in chunks) == reasoning
    assert "".join(d.content or "" for d in chunks) == message.content


# -- the torch runtime ----------------------------------------------------------------------------


def test_torch_gives_a_named_call_valid_for_its_schema(client):
    answer = client.chat.completions.create(model="smollm2-torch", messages=ASK, tools=TOOLS, max_tokens=96,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            parallel_tool_calls=False, temperature=0)
    assert answer.choices[0].finish_reason == "tool_calls"
    _check_calls(answer.choices[0].message, {"get_weather"})


# -- bad input ------------------------------------------------------------------------------------

BAD = {
    "a malformed parameters schema": (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "nonsense"}}}}}]}, "tools[0].function.parameters"),
    "parameters that are not an object": (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
        "tools[0].function.parameters"),
    "a schema the grammar cannot enforce, with required": (
        {"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)a"}}}}}]},
        "tools[0].function.parameters"),
    "a function name with spaces": ({"tools": [{"type": "function", "function": {"name": "get weather"}}]},
                                    "tools[0].function"),
    "a tool that is no function": ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    "too many tools": ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    "the same function twice": ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    "tool_choice naming an undefined function": (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_wind"}}}, "tool_choice"),
    "tool_choice required without tools": ({"tool_choice": "required"}, "tool_choice"),
    "a tool message without a matching call id": (
        {"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_2", "content": "12:00"}]}, "messages[2].tool_call_id"),
    "a tool message without any call id": (
        {"messages": ASK + [{"role": "tool", "content": "12:00"}]}, "messages[1].tool_call_id"),
    "call arguments that are not JSON": (
        {"messages": ASK + [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{city: Paris"}}]}]},
        "messages[1].tool_calls[0].function.arguments"),
    "a required call and a response_format at once": (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_tool_input_is_400_naming_the_field(raw, case):
    fields, param = BAD[case]
    reply = raw.post("/v1/chat/completions", json={"model": "smollm2", "messages": ASK, "max_tokens": 8, **fields})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()


def test_the_sdk_raises_bad_request_and_the_daemon_keeps_serving(client):
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        client.chat.completions.create(model="smollm2", max_tokens=4,
                                       messages=ASK + [{"role": "tool", "tool_call_id": "nope", "content": "x"}])
    answer = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=4, temperature=0)
    assert answer.choices[0].message.content


# -- gRPC Generate: the same tools through the generated stub ------------------------------


@pytest.fixture(scope="module")
def generation(own):
    import grpc

    from modeld.gen import generation_pb2_grpc

    with grpc.insecure_channel(own.address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def _proto_tools():
    from modeld.gen import generation_pb2 as pb

    return [pb.Tool(name=t["function"]["name"], description=t["function"]["description"],
                    parameters=json.dumps(t["function"]["parameters"])) for t in TOOLS]


def _generate(stub, **fields):
    from modeld.gen import generation_pb2 as pb

    request = pb.GenerateRequest(model="smollm2", messages=pb.ChatMessages(messages=[
        pb.ChatMessage(role=m["role"], content=m["content"]) for m in ASK]), tools=_proto_tools(), **fields)
    replies = list(stub.Generate(request, timeout=600))
    return "".join(r.text for r in replies), replies[-1]


def test_grpc_required_gives_the_call_the_http_route_gives(generation, client):
    from modeld.gen import generation_pb2 as pb

    text, last = _generate(generation, tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_REQUIRED),
                           parallel_tool_calls=False, sampling=pb.SamplingParams(max_tokens=96, temperature=0))
    assert last.finish_reason == pb.FINISH_REASON_TOOL_CALLS
    [call] = last.tool_calls
    assert call.name in SCHEMAS and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert text.startswith("<tool_call>\n") and last.content == ""  # the raw text streams; the call is parsed
    # one data plane: greedy decoding under the same grammar writes the same call on both protocols
    http = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=96, temperature=0)
    [same] = http.choices[0].message.tool_calls
    assert (same.function.name, json.loads(same.function.arguments)) == (call.name, json.loads(call.arguments))


@pytest.mark.slow
def test_grpc_a_named_function_is_the_one_called(generation):
    from modeld.gen import generation_pb2 as pb

    request = pb.GenerateRequest(
        model="smollm2", messages=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in ASK]), tools=_proto_tools(),
        tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_FUNCTION, function="get_time"), parallel_tool_calls=False,
        n=2, sampling=pb.SamplingParams(max_tokens=64, temperature=0.7, seed=3))
    # each choice's last message carries that choice's call
    lasts = [r for r in generation.Generate(request, timeout=600) if r.finish_reason]
    assert sorted(r.index for r in lasts) == [0, 1]
    for last in lasts:
        assert last.finish_reason == pb.FINISH_REASON_TOOL_CALLS
        [call] = last.tool_calls
        assert call.name == "get_time"
        jsonschema.validate(json.loads(call.arguments), TIME_SCHEMA)


@pytest.mark.slow
def test_grpc_history_with_a_call_and_its_result_is_served(generation):
    from modeld.gen import generation_pb2 as pb

    messages = [pb.ChatMessage(role="user", content=ASK[0]["content"]),
                pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(
                    id="call_1", name="get_weather", arguments='{"city": "Paris", "unit": "celsius", "days": 3}')]),
                pb.ChatMessage(role="tool", tool_call_id="call_1", name="get_weather", content="sunny, 21 C")]
    request = pb.GenerateRequest(model="smollm2", messages=pb.ChatMessages(messages=messages), tools=_proto_tools(),
                                 tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_NONE),
                                 sampling=pb.SamplingParams(max_tokens=8, temperature=0))
    replies = list(generation.Generate(request, timeout=600))
    assert replies[-1].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert replies[-1].usage.completion_tokens >= 1 and not replies[-1].tool_calls


GRPC_BAD = {
    "unknown function": (dict(tool_choice={"mode": "TOOL_CHOICE_FUNCTION", "function": "nope"}), "tool_choice"),
    "function without a name": (dict(tool_choice={"mode": "TOOL_CHOICE_FUNCTION"}), "tool_choice.function"),
    "schema not JSON": (dict(tools=[{"name": "f", "parameters": "{nope"}]), "tools[0].parameters"),
    "schema not an object schema": (dict(tools=[{"name": "f", "parameters": '{"type": "array"}'}]),
                                    "tools[0].parameters"),
    "bad function name": (dict(tools=[{"name": "no spaces"}]), "tools[0].name"),
    "result without its call": (dict(messages={"messages": [{"role": "tool", "tool_call_id": "x", "content": "1"}]}),
                                "tool_call_id"),
    "required without tools": (dict(tools=[], tool_choice={"mode": "TOOL_CHOICE_REQUIRED"}), "needs tools"),
    "template kwargs not an object": (dict(chat_template_kwargs="[1]"), "chat_template_kwargs"),
    "template kwargs set messages": (dict(chat_template_kwargs='{"messages": []}'), "chat_template_kwargs"),
}


@pytest.mark.parametrize("case", list(GRPC_BAD))
def test_grpc_bad_tool_input_is_invalid_argument_naming_the_field(generation, case):
    import grpc
    from google.protobuf import json_format

    from modeld.gen import generation_pb2 as pb

    fields, named = GRPC_BAD[case]
    body = {"model": "smollm2", "messages": {"messages": ASK}, "sampling": {"maxTokens": 4},
            "tools": [{"name": t.name, "parameters": t.parameters} for t in _proto_tools()], **fields}
    request = json_format.ParseDict(body, pb.GenerateRequest())
    with pytest.raises(grpc.RpcError) as failure:
        list(generation.Generate(request, timeout=600))
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in failure.value.details()
