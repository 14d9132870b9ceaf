"""Each backend's table in model.toml, as a frozen dataclass.

The tables are parsed and checked once, when the model config is read, so a
typo or a bad number comes back as INVALID_ARGUMENT naming the key instead of
passing silently or failing later inside a load. A field's accepted values
live in its metadata, and one generic check reads them; an options object
that breaks them cannot be built, so backends read attributes without
re-checking.

The config parser runs before any backend is chosen: this module must not
import torch, llama_cpp or onnxruntime.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any, Callable
from urllib.parse import urlsplit

from modeld.backends.errors import InvalidArgument


@dataclass(frozen=True)
class _Spec:
    accepts: Callable[[Any], bool]
    want: str  # completes "must be ...", for the error message
    internal: bool = False  # set by the daemon, refused from a config


class OptionError(InvalidArgument):
    """One option value is out of bounds; the config parser adds the model's name."""

    def __init__(self, key: str, value: Any, want: str) -> None:
        super().__init__(f"option {key} must be {want}, got {value!r}")
        self.key, self.value, self.want = key, value, want


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # TOML true is not a count


def _int(default: int, minimum: int) -> Any:
    return field(default=default, metadata={"spec": _Spec(lambda v: _is_int(v) and v >= minimum,
                                                          f"an integer >= {minimum}")})


def _one_of(default: Any, *values: Any) -> Any:
    words = [str(v).lower() if isinstance(v, bool) else str(v) for v in values]
    return field(default=default, metadata={"spec": _Spec(
        lambda v: any(type(v) is type(a) and v == a for a in values),
        "one of " + ", ".join(words) if len(words) > 2 else " or ".join(words))})


_DEVICE_RE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def _device(default: str) -> Any:
    return field(default=default, metadata={"spec": _Spec(
        lambda v: isinstance(v, str) and _DEVICE_RE.fullmatch(v) is not None,
        "one of auto, cpu, cuda, cuda:<index>, mps")})


def _is_model_name(value: Any) -> bool:
    if value == "":  # no draft; also what the defaults built at import time hold
        return True
    if not isinstance(value, str):
        return False
    # imported here: model_config imports this module at its top
    from modeld.backends.model_config import MODEL_NAME_RE

    return MODEL_NAME_RE.fullmatch(value) is not None and ".." not in value


def _model_name() -> Any:
    return field(default="", metadata={"spec": _Spec(_is_model_name, "the name of another model in the repository")})


def _number(default: float, above: float) -> Any:
    return field(default=default, metadata={"spec": _Spec(
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > above, f"a number > {above:g}")})


def _is_http_url(value: Any) -> bool:
    if value == "":  # only in the defaults built at import time; model_config requires a url
        return True
    if not isinstance(value, str):
        return False
    try:
        parts = urlsplit(value)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def _url() -> Any:
    return field(default="", metadata={"spec": _Spec(_is_http_url, "an http:// or https:// URL with a host")})


_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _env_name() -> Any:
    return field(default="", metadata={"spec": _Spec(
        lambda v: v == "" or (isinstance(v, str) and _ENV_NAME_RE.fullmatch(v) is not None),
        "the name of an environment variable (letters, digits, '_')")})


def _text() -> Any:
    return field(default="", metadata={"spec": _Spec(lambda v: isinstance(v, str), "a string")})


def _internal_path() -> Any:
    return field(default="", metadata={"spec": _Spec(lambda v: isinstance(v, str), "a path", internal=True)})


class _Options:
    """Checks every field against its spec whenever an instance is built,
    dataclasses.replace included."""

    section = ""

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            spec: _Spec = f.metadata["spec"]
            value = getattr(self, f.name)
            if not spec.accepts(value):
                raise OptionError(f"{self.section}.{f.name}", value, spec.want)
        self._check()

    def _check(self) -> None:
        """Constraints between fields."""


@dataclass(frozen=True)
class OnnxOptions(_Options):
    section = "onnx"
    intra_op_threads: int = _int(0, minimum=0)  # 0: onnxruntime's choice
    inter_op_threads: int = _int(0, minimum=0)
    allow_spinning: int = _one_of(1, 0, 1)  # 0 gives the CPU back between runs, at some latency
    # 1: after each run, onnxruntime's CPU arena returns the chunks it no
    # longer uses; 0: it keeps its peak (one batch of 64 long sentences
    # leaves minilm's at 1.2 GB for good)
    arena_shrinkage: int = _one_of(1, 0, 1)


@dataclass(frozen=True)
class ReferenceOptions(_Options):
    section = "reference"


@dataclass(frozen=True)
class LlamaCppOptions(_Options):
    section = "llamacpp"
    n_ctx: int = _int(32768, minimum=1)  # KV cells in all, split evenly over the slots
    n_slots: int = _int(8, minimum=1)
    context_length: int = _int(4096, minimum=1)
    n_threads: int = _int(2, minimum=1)
    # llama-server's n_batch: a burst of prompts (8 of ~140 tokens) prefills
    # in one step, so streams that start together decode together after it;
    # split over steps, each stream's decode waited through the others'
    # prompt chunks (aiperf, 32 clients: 146 ms between tokens, 108 ms here)
    max_step_tokens: int = _int(2048, minimum=1)
    # prompt tokens per step, over all prompts in it (slot_scheduler.SlotConfig);
    # as many as a step takes: under steady arrivals fewer, fuller steps won
    # 1.3x the tok/s of 32-token chunks (docs/benchmarks.md#prefill-chunks)
    max_prefill_tokens: int = _int(2048, minimum=1)
    max_waiting: int = _int(256, minimum=1)  # 0 would refuse every request
    draft_model: str = _model_name()
    draft_path: str = _internal_path()  # the engine resolves draft_model to it
    # the batching strategy (scheduler.Admission): continuous joins running batches
    admission: str = _one_of("continuous", "continuous", "dynamic", "static")
    admission_batch: int = _int(8, minimum=1)  # dynamic/static: sequences per batch
    admission_window_ms: float = _number(50.0, above=0)  # dynamic/static: longest a batch waits to fill

    def _check(self) -> None:
        # each slot gets n_ctx // n_slots cells; zero would leave no room for a token
        if self.n_ctx < self.n_slots:
            raise OptionError("llamacpp.n_ctx", self.n_ctx, f"at least n_slots ({self.n_slots})")


@dataclass(frozen=True)
class TorchOptions(_Options):
    section = "torch"
    block_size: int = _int(16, minimum=1)
    num_blocks: int = _int(1024, minimum=1)
    context_length: int = _int(2048, minimum=1)
    max_running: int = _int(16, minimum=1)
    max_step_tokens: int = _int(512, minimum=1)
    max_waiting: int = _int(256, minimum=1)  # 0 would refuse every request
    dtype: str = _one_of("float32", "float32", "bfloat16", "float16")
    threads: int = _int(0, minimum=0)  # 0: torch's default, one per core
    device: str = _device("auto")
    compile: bool = _one_of(True, True, False)
    draft_model: str = _model_name()
    draft_path: str = _internal_path()  # the engine resolves draft_model to it
    admission: str = _one_of("continuous", "continuous", "dynamic", "static")  # as [llamacpp]
    admission_batch: int = _int(8, minimum=1)
    admission_window_ms: float = _number(50.0, above=0)


@dataclass(frozen=True)
class OnnxGenaiOptions(_Options):
    """`[onnx_genai]`: onnxruntime-genai's engine (backend onnx-genai)."""

    section = "onnx_genai"
    max_running: int = _int(8, minimum=1)  # sequences generating at once, over og batches of at most 4
    context_length: int = _int(2048, minimum=1)  # prompt + max_tokens per request; sizes the KV reserve
    max_waiting: int = _int(256, minimum=1)  # 0 would refuse every request
    threads: int = _int(0, minimum=0)  # 0: onnxruntime's choice, one per core


REMOTE_ENGINES = ("openai", "vllm", "sglang", "tgi")


@dataclass(frozen=True)
class RemoteOptions(_Options):
    """`[remote]`: the engine server a `format = "remote"` model runs on. One
    table for the four remote backends (openai, vllm, sglang, tgi): `engine`
    says which protocol the server speaks, `backends` which to try first."""

    section = "remote"
    engine: str = _one_of("openai", *REMOTE_ENGINES)
    url: str = _url()
    model: str = _text()  # the engine's own model name; "": the model's name here
    api_key_env: str = _env_name()  # "": no key; read at load, never stored in the config
    timeout_s: float = _number(600.0, above=0)  # between bytes of an answer; connecting gets min(10, this)
    max_in_flight: int = _int(64, minimum=1)  # more concurrent requests: RESOURCE_EXHAUSTED
    unhealthy_after: int = _int(3, minimum=1)  # consecutive failed calls or probes
    probe_interval_s: float = _number(2.0, above=0)  # health and load probe while healthy; first retry after
    max_probe_interval_s: float = _number(30.0, above=0)  # the backoff of probes while unhealthy stops here

    def _check(self) -> None:
        if self.max_probe_interval_s < self.probe_interval_s:
            raise OptionError("remote.max_probe_interval_s", self.max_probe_interval_s,
                              f"at least probe_interval_s ({self.probe_interval_s:g})")


OPTIONS_BY_BACKEND: dict[str, type[_Options]] = {
    cls.section: cls for cls in (OnnxOptions, ReferenceOptions, LlamaCppOptions, TorchOptions, RemoteOptions,
                             OnnxGenaiOptions)
}


@dataclass(frozen=True)
class BackendOptions:
    """Every backend's options for one model; a backend without a table in
    model.toml gets its defaults."""

    onnx: OnnxOptions = OnnxOptions()
    reference: ReferenceOptions = ReferenceOptions()
    llamacpp: LlamaCppOptions = LlamaCppOptions()
    torch: TorchOptions = TorchOptions()
    remote: RemoteOptions = RemoteOptions()
    onnx_genai: OnnxGenaiOptions = OnnxGenaiOptions()


def parse_options(model: str, section: str, raw: dict[str, Any]) -> _Options:
    """One backend's table from a model config, checked; errors name the model."""
    cls = OPTIONS_BY_BACKEND[section]
    specs = {f.name: f.metadata["spec"] for f in fields(cls)}  # type: ignore[arg-type]
    public = sorted(name for name, spec in specs.items() if not spec.internal)
    for key in raw:
        if key not in specs:
            known = f"known keys: {', '.join(public)}" if public else f"the {section} backend takes no options"
            raise InvalidArgument(f"model {model!r}: unknown config key {section}.{key}; {known}")
        if specs[key].internal:
            raise InvalidArgument(
                f"model {model!r}: config key {section}.{key} is set by the daemon; name the draft with draft_model"
            )
    if raw.get("draft_model") == model:
        raise InvalidArgument(f"model {model!r}: config key {section}.draft_model must name another model, not itself")
    try:
        return cls(**raw)
    except OptionError as exc:
        raise InvalidArgument(f"model {model!r}: config key {exc.key} must be {exc.want}, got {exc.value!r}") from None


def parse_backend_options(model: str, tables: dict[str, dict[str, Any]]) -> BackendOptions:
    return BackendOptions(**{section: parse_options(model, section, raw) for section, raw in tables.items()})
