"""Chat templates render as transformers' apply_chat_template renders them
(the same template, messages and tools give the same text), on the
SmolLM2 GGUF's own template and on tool-calling templates in the Hermes and
Llama 3 styles; bad templates and files are refused with a reason."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from modeld.backends.errors import InvalidArgument, LoadFailed
from modeld.backends.generation.chat_template import ChatTemplate, model_chat_template, render_chat
from modeld.backends.generation.params import ChatMessage, ToolCall, ToolSpec
from modeld.backends.load_policy import LoadPolicy
from modeld.backends.model_config import config_from_dict

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_GGUF = ROOT / "models" / "smollm2" / "model.gguf"

# Written for these tests in the styles tool-calling models use: the tools
# in the system turn, calls as tagged JSON, results as their own turns.
HERMES_STYLE = """{{- bos_token }}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(results=0) %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}{% if message.content %}{{ '\\n' + message.content }}{% endif %}
{%- for call in message.tool_calls %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- set ns.results = ns.results + 1 %}
{{- '<|im_start|>user\\n<tool_response id="' + message.tool_call_id + '">\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- elif message.role != 'system' %}
{{- raise_exception('unknown role ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

LLAMA3_STYLE = """{{- bos_token }}
{%- set system = messages[0].content if messages[0].role == 'system' else '' %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system }}
{%- if tools is not none %}
{{- '\\nAnswer a call as {"name": function name, "parameters": arguments} to one of:\\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n' }}{%- endfor %}
{%- endif %}
{{- '<|eot_id|>' }}
{%- for message in messages if message.role != 'system' %}
{%- if message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- elif message.tool_calls %}
{%- for call in message.tool_calls %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "' + call.function.name + '", "parameters": ' + (call.function.arguments | tojson) + '}<|eom_id|>' }}
{%- endfor %}
{%- else %}
{%- generation %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}{%- endgeneration %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""

WEATHER = ToolSpec("get_weather", "The weather in a city, now", json.dumps({
    "type": "object", "properties": {"city": {"type": "string", "description": "Ünïcödé <ok> & fine"},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]}))
CLOCK = ToolSpec("get_time")
CONVERSATION = (
    ChatMessage("system", "You are terse."),
    ChatMessage("user", "Weather in Paris and the time?"),
    ChatMessage("assistant", "", tool_calls=(ToolCall("call_1", "get_weather", '{"city": "Paris", "unit": "celsius"}'),
                                             ToolCall("call_2", "get_time", "{}"))),
    ChatMessage("tool", '{"temperature": 21}', tool_call_id="call_1"),
    ChatMessage("tool", "12:00", tool_call_id="call_2", name="get_time"),
    ChatMessage("assistant", "  It is 21 degrees at noon.  "),
    ChatMessage("user", "Thanks"),
)
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"}


def _hf_tokenizer(template: str) -> PreTrainedTokenizerFast:
    """A real transformers tokenizer holding `template` (its vocabulary does
    not matter: rendering happens before tokenizing)."""
    vocab = {token: i for i, token in enumerate(["<unk>", "<s>", "</s>", "hello"])}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                                        bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>")
    tokenizer.chat_template = template
    return tokenizer


def _openai_dicts(messages) -> list[dict]:
    """The messages as a client writes them for transformers (arguments as objects)."""
    out = []
    for m in messages:
        d = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": json.loads(c.arguments_json)}}
                               for c in m.tool_calls]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
        out.append(d)
    return out


def _tool_dicts(tools) -> list[dict]:
    out = []
    for t in tools:
        function = {"name": t.name}
        if t.description:
            function["description"] = t.description
        if t.parameters_json:
            function["parameters"] = json.loads(t.parameters_json)
        out.append({"type": "function", "function": function})
    return out


@pytest.mark.parametrize("template", [HERMES_STYLE, LLAMA3_STYLE], ids=["hermes-style", "llama3-style"])
@pytest.mark.parametrize("with_tools", [True, False], ids=["tools", "no-tools"])
@pytest.mark.parametrize("generation_prompt", [True, False], ids=["generation-prompt", "no-generation-prompt"])
def test_rendering_equals_transformers(template, with_tools, generation_prompt):
    tools = (WEATHER, CLOCK) if with_tools else ()
    ours = ChatTemplate(template, SPECIAL).render(CONVERSATION, tools, add_generation_prompt=generation_prompt)
    theirs = _hf_tokenizer(template).apply_chat_template(
        _openai_dicts(CONVERSATION), tools=_tool_dicts(tools) or None, add_generation_prompt=generation_prompt,
        tokenize=False)
    assert ours == theirs
    if with_tools:
        assert '"get_weather"' in ours and "Ünïcödé <ok> & fine" in ours  # tojson without HTML escapes


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(SMOLLM2_GGUF.parent), gguf_file=SMOLLM2_GGUF.name)


@pytest.fixture(scope="module")
def smollm2_llama():
    from modeld.backends.llamacpp.context import LlamaModel

    model = LlamaModel(SMOLLM2_GGUF)
    yield model
    model.close()


SMOLLM2_CHATS = (CONVERSATION[1:2], CONVERSATION[:2],
                 (ChatMessage("user", "a"), ChatMessage("assistant", "b"), ChatMessage("user", "c")))


def test_smollm2_template_equals_transformers(smollm2_llama):
    source, special = smollm2_llama.chat_template_source(), smollm2_llama.special_tokens()
    assert special == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
                       "pad_token": "<|im_end|>"}  # what transformers reads from this GGUF (the slow test below)
    template = ChatTemplate(source, special)
    tokenizer = _hf_tokenizer(source)
    for messages in SMOLLM2_CHATS:
        assert template.render(messages) == tokenizer.apply_chat_template(
            _openai_dicts(messages), tokenize=False, add_generation_prompt=True)


@pytest.mark.slow  # transformers converts the GGUF's vocabulary: 10-30 s
def test_both_backends_take_the_same_template_and_special_tokens_from_the_gguf(smollm2_tokenizer, smollm2_llama):
    """llama.cpp's reading of the GGUF and transformers' (the torch backend's) agree."""
    assert smollm2_llama.chat_template_source() == smollm2_tokenizer.chat_template
    assert smollm2_llama.special_tokens() == smollm2_tokenizer.special_tokens_map
    template = ChatTemplate(smollm2_llama.chat_template_source(), smollm2_llama.special_tokens())
    for messages in SMOLLM2_CHATS:
        assert template.render(messages) == smollm2_tokenizer.apply_chat_template(
            _openai_dicts(messages), tokenize=False, add_generation_prompt=True)


def test_a_template_without_tools_gets_them_in_the_hermes_format(smollm2_llama):
    """SmolLM2's template renders neither tools nor calls: the functions go
    into the system turn, calls and results into the history as text."""
    template = ChatTemplate(smollm2_llama.chat_template_source(), smollm2_llama.special_tokens())
    assert not template.renders_tools
    prompt = template.render(CONVERSATION, (WEATHER, CLOCK))
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou are terse.\n\n# Tools")
    assert json.dumps({"type": "function", "function": {"name": "get_time"}}) in system
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' \
        in prompt
    assert "<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    # without tools and calls the model's own rendering is untouched
    plain = CONVERSATION[:2]
    assert template.render(plain) == template.render(plain, ())
    assert "# Tools" not in template.render(plain)


def test_a_template_that_refuses_names_its_reason():
    with pytest.raises(InvalidArgument, match="unknown role critic"):
        ChatTemplate(HERMES_STYLE, SPECIAL).render((ChatMessage("user", "hi"), ChatMessage("critic", "no")))


def test_a_template_that_breaks_on_the_messages_is_invalid_argument():
    template = ChatTemplate("{{ messages[0].content + 1 }}")
    with pytest.raises(InvalidArgument, match="cannot render these messages"):
        template.render((ChatMessage("user", "hi"),))


def test_the_sandbox_keeps_a_template_from_python_internals():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidArgument):
        template.render((ChatMessage("user", "hi"),))


def test_a_template_that_does_not_compile_fails_the_load():
    with pytest.raises(LoadFailed, match="not a valid Jinja template"):
        ChatTemplate("{% for m in messages %}")


def test_the_override_file_stays_inside_the_model_folder(tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "chat.jinja").write_text("[{{ messages[0].content }}]")
    (tmp_path / "outside.jinja").write_text("secret")
    (model_dir / "link.jinja").symlink_to(tmp_path / "outside.jinja")

    def template(chat_template: str, own: str = "", operator: str = ""):
        config = replace(config_from_dict("m", {"format": "gguf", "chat_template": chat_template}),
                         policy=LoadPolicy(chat_templates=(("m", operator),) if operator else ()))
        return model_chat_template(config, model_dir, own, {})

    hi = (ChatMessage("user", "hi"),)
    assert render_chat(template("chat.jinja", own="{{ 'own' }}"), hi) == "[hi]"
    assert render_chat(template("", own="{{ 'own' }}"), hi) == "own"
    with pytest.raises(LoadFailed, match="outside the model folder"):
        template("link.jinja")
    with pytest.raises(LoadFailed, match="not a file"):
        template("missing.jinja")
    with pytest.raises(InvalidArgument, match="no chat template"):
        render_chat(template(""), hi)
    # the operator's --chat-template file wins over both, wherever it lies
    assert render_chat(template("chat.jinja", own="{{ 'own' }}", operator=str(tmp_path / "outside.jinja")), hi) \
        == "secret"


THINKING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_the_template_as_transformers_passes_them():
    chat = (ChatMessage("user", "hi"),)
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}, {"add_generation_prompt": False},
                   {"self": 1, "bos_token": "<B>"}):
        ours = render_chat(ChatTemplate(THINKING, SPECIAL), chat, (), kwargs)
        theirs = _hf_tokenizer(THINKING).apply_chat_template(
            _openai_dicts(chat), add_generation_prompt=kwargs.get("add_generation_prompt", True), tokenize=False,
            **{k: v for k, v in kwargs.items() if k not in ("add_generation_prompt", "self")})
        assert ours == theirs, kwargs
    assert "<think>" in render_chat(ChatTemplate(THINKING, SPECIAL), chat, (), {"enable_thinking": False})


@pytest.mark.parametrize("kwargs, named", [
    ({"messages": []}, "'messages'"),
    ({"tools": None}, "'tools'"),
    ({"_private": 1}, "variable names"),
    ({"a b": 1}, "variable names"),
    ({f"k{i}": i for i in range(33)}, "at most 32"),
    ({"big": "x" * 9000}, "over the limit of 8192"),
])
def test_chat_template_kwargs_have_limits(kwargs, named):
    from modeld.backends.generation.params import GenerateRequest

    request = GenerateRequest("m", messages=(ChatMessage("user", "hi"),), chat_template_kwargs=tuple(kwargs.items()))
    with pytest.raises(InvalidArgument, match=named):
        request.validate()
    with pytest.raises(InvalidArgument, match="need chat messages"):
        GenerateRequest("m", prompt="x", chat_template_kwargs=(("a", 1),)).validate()
