"""A language model's own Jinja chat template, rendered the way Hugging
Face's `apply_chat_template` renders it, so a prompt is the same whichever
backend serves the model.

The template comes from the model (GGUF metadata `tokenizer.chat_template`,
or the tokenizer's) or from a file named by `chat_template` in model.toml.
It runs in jinja2's immutable sandbox with HF's additions (`tojson` without
HTML escaping, `raise_exception`, `strftime_now`, `{% generation %}`,
loop controls, trimmed blocks): templates from a model folder are untrusted
code, and the sandbox keeps them from reaching Python's internals.

A template that does not render `tools` (SmolLM2's, say) still gets the
functions: they go into the system message in the Hermes format, and calls
and results in the history are written the same way, so the model sees one
consistent convention and `tool_parser = "hermes"` reads its answer back.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Mapping

from modeld.backends.errors import InvalidArgument, LoadFailed
from modeld.backends.generation.params import ChatMessage, ToolCall, ToolSpec
from modeld.backends.model_config import ModelConfig

# A template file larger than this is not a chat template; the biggest on the
# Hub (tool-calling ones with many branches) are around 20 KB.
MAX_TEMPLATE_BYTES = 256 * 1024


def _environment():
    import jinja2
    import jinja2.ext
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for
        training masks; rendering a prompt keeps just its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes <, > and & for HTML, which templates never want
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):
        """`namespace()` without underscore names, which could reach
        Python's internals through the object the sandbox hands back."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.globals["namespace"] = Namespace
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


_ENV = None


def _env():
    global _ENV
    if _ENV is None:
        _ENV = _environment()
    return _ENV


class ChatTemplate:
    """One model's template, compiled once at load."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None, origin: str = "") -> None:
        import jinja2
        from jinja2 import meta

        self.source = source
        self.origin = origin or "the model's chat template"
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _env().from_string(source)
            names = meta.find_undeclared_variables(_env().parse(source))
        except jinja2.TemplateSyntaxError as exc:
            raise LoadFailed(f"{self.origin} is not a valid Jinja template (line {exc.lineno}: {exc.message})") \
                from None
        self.renders_tools = "tools" in names
        # a template that never reads tool_calls would drop them from the history
        self.renders_tool_calls = "tool_calls" in source

    @classmethod
    def from_file(cls, model_dir: Path, relative: str, special_tokens: Mapping[str, str] | None = None) \
            -> ChatTemplate:
        """The template file `relative` names in the model's folder (model.toml's
        `chat_template`); a link may not lead outside the folder."""
        root = model_dir.resolve()
        path = (root / relative).resolve()
        if not path.is_relative_to(root):
            raise LoadFailed(f"chat_template {relative!r} leads outside the model folder")
        if not path.is_file():
            raise LoadFailed(f"chat_template {relative!r} is not a file in the model folder")
        origin = f"chat_template {relative!r}"
        return cls(_read_template(path, origin), special_tokens, origin=origin)

    @classmethod
    def from_operator_file(cls, path: Path, special_tokens: Mapping[str, str] | None = None) -> ChatTemplate:
        """The daemon's --chat-template file: the operator's, so wherever it is
        (the settings check it exists at start); its name stays out of errors."""
        if not path.is_file():
            raise LoadFailed("the --chat-template file of this model is missing")
        origin = "the --chat-template file"
        return cls(_read_template(path, origin), special_tokens, origin=origin)

    def render(self, messages: tuple[ChatMessage, ...], tools: tuple[ToolSpec, ...] = (), /,
               add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text, as `tokenizer.apply_chat_template(messages,
        tools=tools, add_generation_prompt=..., tokenize=False, **kwargs)`
        gives it; `kwargs` are further template variables."""
        import jinja2

        chat = [message_dict(m) for m in messages]
        tool_dicts = [tool_dict(t) for t in tools] or None
        if any(m.tool_calls or m.role == "tool" for m in messages) and not self.renders_tool_calls:
            chat = [_hermes_history(m) for m in messages]
        if tool_dicts and not self.renders_tools:
            chat, tool_dicts = _with_hermes_tools(chat, tool_dicts), None
        try:
            # one dict, not keywords: a variable may be called anything a template reads
            return self._template.render({**self.special_tokens, **kwargs, "messages": chat, "tools": tool_dicts,
                                          "documents": None, "add_generation_prompt": add_generation_prompt})
        except jinja2.TemplateError as exc:
            # raise_exception: the template's own words about what it refuses
            raise InvalidArgument(f"{self.origin} refused these messages: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise InvalidArgument(f"{self.origin} cannot render these messages ({type(exc).__name__}: "
                                  f"{str(exc)[:200]})") from None


def _read_template(path: Path, origin: str) -> str:
    if path.stat().st_size > MAX_TEMPLATE_BYTES:
        raise LoadFailed(f"{origin} is over {MAX_TEMPLATE_BYTES} bytes")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise LoadFailed(f"{origin} is not UTF-8 text") from None


def message_dict(message: ChatMessage) -> dict:
    """A message as HF templates read it: OpenAI's shape, with each call's
    arguments as an object (templates apply `tojson` to them)."""
    out: dict = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": call_arguments(c)}}
                             for c in message.tool_calls]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.name:
        out["name"] = message.name
    return out


def call_arguments(call: ToolCall) -> object:
    try:
        return json.loads(call.arguments_json)
    except json.JSONDecodeError:
        return call.arguments_json  # the front refuses this; a template may still print the text


def tool_dict(tool: ToolSpec) -> dict:
    function: dict = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters_json:
        function["parameters"] = json.loads(tool.parameters_json)
    return {"type": "function", "function": function}


# Qwen 2.5's wording, which Hermes-format models are trained on.
_HERMES_TOOLS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def hermes_call_text(name: str, arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def _with_hermes_tools(chat: list[dict], tools: list[dict]) -> list[dict]:
    prompt = _HERMES_TOOLS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if chat and chat[0]["role"] == "system":
        return [{**chat[0], "content": chat[0]["content"] + "\n\n" + prompt}, *chat[1:]]
    return [{"role": "system", "content": prompt}, *chat]


def _hermes_history(message: ChatMessage) -> dict:
    """A call or a result written as text, for a template that knows neither."""
    if message.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.content}\n</tool_response>"}
    if not message.tool_calls:
        return message_dict(message)
    calls = "\n".join(hermes_call_text(c.name, call_arguments(c)) for c in message.tool_calls)
    return {"role": message.role, "content": (message.content + "\n" if message.content else "") + calls}


def model_chat_template(config: ModelConfig, model_dir: Path, own_source: str,
                        special_tokens: Mapping[str, str]) -> ChatTemplate | None:
    """The template a model renders its chats with: the operator's file
    (`--chat-template NAME=FILE`), else the file model.toml's
    `chat_template` names, else the model's own; None when it has none."""
    operator_file = config.policy.chat_template_for(config.name)
    if operator_file:
        return ChatTemplate.from_operator_file(Path(operator_file), special_tokens)
    if config.chat_template:
        return ChatTemplate.from_file(model_dir, config.chat_template, special_tokens)
    if own_source:
        return ChatTemplate(own_source, special_tokens)
    return None


def render_chat(template: ChatTemplate | None, messages: tuple[ChatMessage, ...],
                tools: tuple[ToolSpec, ...] = (), template_kwargs: Mapping[str, object] | None = None) -> str:
    """`template_kwargs` (a request's chat_template_kwargs, checked by
    params.check_template_kwargs) are extra template variables; they may
    turn add_generation_prompt off or set a template's own flags
    (enable_thinking), and replace a special token's spelling."""
    if template is None:
        raise InvalidArgument("this model has no chat template (none in its files, no chat_template in its "
                              "model.toml); send a prompt instead")
    return template.render(messages, tools, **dict(template_kwargs or {}))
