"""Reading a model's answer back: tool calls (Hermes and Llama 3 formats),
reasoning in think tags, and OpenAI's message and deltas built from them.
Every sample is also streamed cut at every position and in pieces of
several sizes: the streamed answer must equal the whole one. The grammar
for tool_choice required/named is checked with llguidance over SmolLM2's
real vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modeld.backends.generation.params import ToolSpec
from modeld.backends.model_config import ReasoningParser, ToolParser
from modeld.server.http.openai_tools import AnswerReader, call_grammar
from modeld.server.http.reasoning_parsers import new_reasoning_parser, split_reasoning
from modeld.server.http.tool_parsers import CallArguments, CallStart, ParsedAnswer, collect, new_tool_parser, \
    parse_answer

ROOT = Path(__file__).resolve().parents[2]

HERMES = {
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "note": "a } and a \\" {"}}'
    '\n</tool_call>':
        ParsedAnswer("Let me check.\n", (("get_weather", '{"city": "Paris", "note": "a } and a \\" {"}'),)),
    '<tool_call>\n{"name": "a", "arguments": {"x": [1, {"y": 2}]}}\n</tool_call>\n'
    '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>':
        ParsedAnswer("\n", (("a", '{"x": [1, {"y": 2}]}'), ("b", "{}"))),
    # arguments before the name: read whole when the call ends
    '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>': ParsedAnswer("", (("f", '{"x": 1}'),)),
    "Plain text with a < and a <tool which is no tag": ParsedAnswer(
        "Plain text with a < and a <tool which is no tag", ()),
    "<tool_call>this is not JSON</tool_call> after": ParsedAnswer("<tool_call>this is not JSON</tool_call> after", ()),
    # cut short by max_tokens inside the arguments: the call as far as it got
    '<tool_call>\n{"name": "f", "arguments": {"city": "Par': ParsedAnswer("", (("f", '{"city": "Par'),)),
    "": ParsedAnswer("", ()),
}

LLAMA3 = {
    '{"name": "get_weather", "parameters": {"city": "Paris"}}': ParsedAnswer("", (("get_weather",
                                                                                 '{"city": "Paris"}'),)),
    '<|python_tag|>{"name": "a", "parameters": {"s": "}{"}}; {"name": "b", "parameters": {}}':
        ParsedAnswer("", (("a", '{"s": "}{"}'), ("b", "{}"))),
    ' \n{"name": "c", "arguments": {"k": true}}': ParsedAnswer("", (("c", '{"k": true}'),)),
    "The weather is fine {not a call}": ParsedAnswer("The weather is fine {not a call}", ()),
    '{"no": "name"}': ParsedAnswer('{"no": "name"}', ()),
}


def _streamed(kind: ToolParser, pieces: list[str]) -> ParsedAnswer:
    parser = new_tool_parser(kind)
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return collect(events + parser.finish())


def _cuts(text: str):
    """The text cut once at every position, and in pieces of 1 to 7 characters."""
    for at in range(len(text) + 1):
        yield [text[:at], text[at:]]
    for size in range(1, 8):
        yield [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize(("kind", "text", "expected"),
                         [(ToolParser.HERMES, t, e) for t, e in HERMES.items()]
                         + [(ToolParser.LLAMA3, t, e) for t, e in LLAMA3.items()])
def test_calls_are_read_the_same_whole_and_streamed(kind, text, expected):
    assert parse_answer(kind, text) == expected
    for pieces in _cuts(text):
        assert _streamed(kind, pieces) == expected, pieces


def test_arguments_stream_as_they_arrive():
    parser = new_tool_parser(ToolParser.HERMES)
    events = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert events == [CallStart(0, "get_weather"), CallArguments(0, '{"city": "Pa')]
    assert parser.feed('ris"}}\n</tool') == [CallArguments(0, 'ris"}')]
    assert parser.feed("_call>") == [] and parser.finish() == []


REASONING = {
    (ReasoningParser.THINK, "<think>\nFirst, Paris.</think>\n\nParis is the capital."): ("\nFirst, Paris.",
                                                                                       "Paris is the capital."),
    (ReasoningParser.THINK, "No thinking here <think>x</think>"): ("", "No thinking here <think>x</think>"),
    (ReasoningParser.THINK, "<think>cut short while thi"): ("cut short while thi", ""),
    (ReasoningParser.THINK, "<thin"): ("", "<thin"),
    (ReasoningParser.DEEPSEEK_R1, "The template opened the tag.</think>\n\nAnswer"): (
        "The template opened the tag.", "Answer"),
    (ReasoningParser.DEEPSEEK_R1, "<think>written again</think>Answer"): ("written again", "Answer"),
    (ReasoningParser.DEEPSEEK_R1, "never closed"): ("never closed", ""),
}


@pytest.mark.parametrize(("kind", "text"), list(REASONING), ids=[f"{k.value}:{t[:20]}" for k, t in REASONING])
def test_reasoning_is_split_the_same_whole_and_streamed(kind, text):
    expected = REASONING[(kind, text)]
    assert split_reasoning(kind, text) == expected
    for pieces in _cuts(text):
        parser = new_reasoning_parser(kind)
        parts = [parser.feed(p) for p in pieces] + [parser.finish()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == expected, pieces


ANSWER = ('<think>The user wants weather.</think>\n\nChecking.\n<tool_call>\n'
          '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def _read(pieces: list[str]) -> tuple[list[dict], AnswerReader]:
    reader = AnswerReader(ToolParser.HERMES, ReasoningParser.THINK)
    deltas = []
    for piece in pieces:
        deltas += reader.feed(piece)
    return deltas + reader.finish(), reader


def test_the_message_holds_reasoning_content_and_calls():
    _, reader = _read([ANSWER])
    message = reader.message()
    assert message["reasoning_content"] == "The user wants weather."
    assert message["content"] == "Checking.\n"
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert reader.finish_reason("stop") == "tool_calls" and reader.finish_reason("length") == "length"


def test_deltas_follow_openais_streaming_shape():
    """The first delta of a call carries index, id, type and the name with
    empty arguments; the next ones carry argument fragments only; the
    fragments add up to the whole answer's arguments."""
    whole = _read([ANSWER])[1].message()
    for pieces in _cuts(ANSWER):
        deltas, _ = _read(pieces)
        calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
        first, rest = calls[0], calls[1:]
        assert set(first) == {"index", "id", "type", "function"} and first["function"]["arguments"] == ""
        assert first["function"]["name"] == "get_weather" and first["index"] == 0
        assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in rest)
        assert "".join(c["function"]["arguments"] for c in rest) == whole["tool_calls"][0]["function"]["arguments"]
        assert "".join(d.get("content", "") for d in deltas) == whole["content"]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == whole["reasoning_content"]


def test_without_parsers_the_text_is_the_content():
    reader = AnswerReader(None, None)
    assert reader.feed("<tool_call>{}</tool_call>") == [{"content": "<tool_call>{}</tool_call>"}]
    assert reader.finish() == []
    assert reader.message() == {"role": "assistant", "content": "<tool_call>{}</tool_call>", "refusal": None}
    assert reader.finish_reason("stop") == "stop"


# -- the grammar of tool_choice required / named

WEATHER = ToolSpec("get_weather", "", json.dumps({
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}))
CLOCK = ToolSpec("get_time")


@pytest.fixture(scope="module")
def lltokenizer():
    from llguidance.llamacpp import lltokenizer_from_vocab

    from modeld.backends.llamacpp.context import LlamaModel

    model = LlamaModel(ROOT / "models" / "smollm2" / "model.gguf")
    yield lltokenizer_from_vocab(model.vocab, n_vocab=model.vocab_size), model
    model.close()


def _accepts(lltokenizer, grammar: str, text: str) -> bool:
    import llguidance

    tokenizer, model = lltokenizer
    matcher = llguidance.LLMatcher(tokenizer, llguidance.grammar_from("lark", grammar), log_level=0)
    return matcher.consume_tokens(model.tokenize(text, add_special=False)) and matcher.is_accepting()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # llguidance reads the vocabulary with an old llama.cpp call
@pytest.mark.parametrize("kind", list(ToolParser))
def test_the_call_grammar_takes_exactly_valid_calls(lltokenizer, kind):
    def call(name: str, arguments: dict) -> str:
        key = "parameters" if kind is ToolParser.LLAMA3 else "arguments"
        text = json.dumps({"name": name, key: arguments})
        return text if kind is ToolParser.LLAMA3 else f"<tool_call>\n{text}\n</tool_call>"

    joiner = "; " if kind is ToolParser.LLAMA3 else "\n"
    good = call("get_weather", {"city": "Paris", "unit": "celsius"})
    one = call_grammar(kind, (WEATHER, CLOCK), parallel=False)
    assert _accepts(lltokenizer, one, good)
    assert _accepts(lltokenizer, one, call("get_time", {}))
    assert not _accepts(lltokenizer, one, call("get_weather", {"city": "Paris"}))  # unit is required
    assert not _accepts(lltokenizer, one, call("get_weather", {"city": "Paris", "unit": "kelvin"}))
    assert not _accepts(lltokenizer, one, call("get_wind", {}))
    assert not _accepts(lltokenizer, one, good + joiner + good)  # one call only
    assert _accepts(lltokenizer, call_grammar(kind, (WEATHER, CLOCK), parallel=True), good + joiner + good)
    named = call_grammar(kind, (CLOCK,), parallel=True)
    assert _accepts(lltokenizer, named, call("get_time", {})) and not _accepts(lltokenizer, named, good)
    assert parse_answer(kind, good + joiner + good).calls == (("get_weather", '{"city": "Paris", "unit": '
                                                                              '"celsius"}'),) * 2
