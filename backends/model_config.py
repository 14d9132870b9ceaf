"""A model's configuration: parsed once from model.toml or Triton-style JSON.

The result is a frozen dataclass; nothing downstream re-reads the file. Any
problem raises InvalidArgument with the key at fault, so a bad inline config
comes back to the client as INVALID_ARGUMENT rather than a stack trace.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any

from modeld.backends.errors import InvalidArgument
from modeld.backends.load_policy import LoadPolicy
from modeld.backends.options import OPTIONS_BY_BACKEND, BackendOptions, parse_backend_options
from modeld.backends.sizes import parse_size
from modeld.backends.triton_config import triton_to_native
from modeld.backends.version_policy import VersionPolicy, parse_version_policy

# KServe v2 datatype names; the Triton model-config spelling is TYPE_<name>
# (with TYPE_STRING for BYTES).
DATATYPES = (
    "BOOL", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32",
    "UINT64", "FP16", "FP32", "FP64", "BYTES", "BF16",
)

# where a model's `source` may point (server/store pulls it into its disk cache)
STORE_SCHEMES = ("oci", "s3", "hf")

MODEL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")


class ModelFormat(Enum):
    ONNX = "onnx"
    GGUF = "gguf"
    SAFETENSORS = "safetensors"  # Hugging Face weights plus config.json
    REMOTE = "remote"  # served by an engine server ([remote]); no local file
    COREML = "coreml"  # .mlpackage / .mlmodel, or a torch.export .pt2 the coreml backend converts
    LORA = "lora"  # a PEFT LoRA adapter (adapter_config.json + safetensors) over the model named by `base`


class Isolation(StrEnum):
    """Where a model runs (server/workers): in a worker process of its own or
    in the daemon. AUTO is the daemon's default only: native LLM backends in a
    worker, the rest in the daemon."""

    AUTO = "auto"
    PROCESS = "process"
    IN_PROCESS = "in-process"


# what a model.toml may say; without it the daemon's default applies
MODEL_ISOLATIONS = (Isolation.PROCESS, Isolation.IN_PROCESS)


class WhilePulling(StrEnum):
    """What a gateway does with calls for a model while one of its replicas
    pulls it from the store (docs/store.md, "On a fleet")."""

    ROUTE = "route"  # send them to a replica that has it ready, while one has
    WAIT = "wait"    # the pulling replica is a home like a ready one: calls placed there wait for its pull


class ToolParser(StrEnum):
    """How a language model writes a tool call in its output
    (server/http/tool_parsers.py reads it back)."""

    HERMES = "hermes"  # <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes, Qwen 2.5/3)
    LLAMA3 = "llama3"  # {"name": ..., "parameters": {...}} as the whole answer (Llama 3.1-3.3)


class ReasoningParser(StrEnum):
    """How a model that thinks first marks its reasoning
    (server/http/reasoning_parsers.py splits it off)."""

    THINK = "think"  # an answer that opens with <think> reasons until </think> (Qwen3, SmolLM3)
    DEEPSEEK_R1 = "deepseek_r1"  # reasons from the first token until </think> (its template opens the tag)


class ModelKind(Enum):
    """What a model's inputs and outputs mean to the server."""

    TENSOR = "tensor"  # the graph's own signature (language models: text in, tokens out)
    RERANK = "rerank"  # BYTES query [1] and documents [n] in, FP32 scores [n] out (backends/rerank.py)


# REMOTE has no file: its artifact path stays "" and no local backend serves it
DEFAULT_ARTIFACTS = {ModelFormat.ONNX: "model.onnx", ModelFormat.GGUF: "model.gguf",
                     ModelFormat.SAFETENSORS: "model.safetensors", ModelFormat.REMOTE: "",
                     ModelFormat.COREML: "model.mlpackage", ModelFormat.LORA: "adapter_model.safetensors"}

# A remote model's local fallback artifact: its format follows from its name.
_FORMAT_BY_SUFFIX = {".gguf": ModelFormat.GGUF, ".onnx": ModelFormat.ONNX, ".safetensors": ModelFormat.SAFETENSORS}

@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]  # -1 marks a variable dimension, batch included


@dataclass(frozen=True)
class TextSpec:
    """Tokenize a BYTES input inside the server before the graph runs."""

    tokenizer: str
    input: str = "text"
    max_length: int = 256


@dataclass(frozen=True)
class RerankSpec:
    """`[rerank]` of a `kind = "rerank"` model. Empty: the model's own graph is
    a cross-encoder. `embedding_model`: score by cosine similarity of that
    repository model's text embeddings (a bi-encoder), loaded from its files."""

    embedding_model: str = ""

    @property
    def is_bi_encoder(self) -> bool:
        return bool(self.embedding_model)


# A rerank model's signature, whatever scores it: the request's text and the
# answer's order (server/rerank.py).
RERANK_QUERY, RERANK_DOCUMENTS = "query", "documents"
RERANK_SCORES, RERANK_INDICES = "scores", "indices"


@dataclass(frozen=True)
class LoraSettings:
    """`[lora]` of a base model: what its LoRA adapters may be (vLLM's
    --max-lora-rank, SGLang's --max-loaded-loras / --max-loras-per-batch)."""

    max_lora_rank: int = 64  # the highest rank an adapter of this base may have
    max_loaded_loras: int = 8  # adapters of this base resident at once; loading one more evicts the LRU idle one
    max_loras_per_batch: int = 4  # distinct adapters mixed in one engine step; sequences of others wait


_LORA_KEYS = ("max_lora_rank", "max_loaded_loras", "max_loras_per_batch")
MAX_LORA_RANK = 512  # no setting may raise the rank past this: an adapter's memory grows with it


@dataclass(frozen=True)
class ModelConfig:
    name: str
    format: ModelFormat = ModelFormat.ONNX
    backends: tuple[str, ...] = ()  # preference order; empty means by priority
    artifact: str = ""
    max_batch_size: int = 0  # 0: the model takes whole tensors, no batching
    max_queue_delay_us: int = 0
    max_queue_size: int = 1024
    preferred_batch_sizes: tuple[int, ...] = ()  # Triton's preferred_batch_size
    memory_estimate: int | None = None
    warmup: bool = False
    pinned: bool = False
    lazy_load: bool | None = None  # None: follow the daemon's setting
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    text: TextSpec | None = None
    backend_options: BackendOptions = BackendOptions()
    # `format = "remote"` in model.toml: the [remote] engine serves it first.
    # `format` then holds the local fallback artifact's format (from its file
    # name), so local backends judge that file exactly as they judge any
    # other model; REMOTE when there is no fallback artifact.
    is_remote: bool = False
    kind: ModelKind = ModelKind.TENSOR
    rerank: RerankSpec = RerankSpec()
    # [limits] max_request_bytes: None follows the daemon's max_request_bytes
    max_request_bytes: int | None = None
    isolation: Isolation | None = None  # None: the daemon's default
    # [embedding] matryoshka_dimensions: the shorter lengths its vectors keep
    # their meaning at (a Matryoshka-trained model); /v1/embeddings'
    # `dimensions` takes only these
    matryoshka_dimensions: tuple[int, ...] = ()
    # `source = "oci://..."` (or s3://, hf://): the model's files come from a
    # store, pulled into the daemon's disk cache on first load
    source: str = ""
    # what a gateway does with calls while a replica pulls the model (Node
    # Stats carries it with the PULLING state)
    while_pulling: WhilePulling = WhilePulling.ROUTE
    # more names the model answers to (vLLM's --served-model-name); its own name stays
    served_names: tuple[str, ...] = ()
    version_policy: VersionPolicy = VersionPolicy()  # numbered version folders that serve (Triton's)
    # the daemon's settings on what the model's files may reach; stamped by
    # the engine at load, never read from a config (load_policy.py)
    policy: LoadPolicy = LoadPolicy()
    # language models: a Jinja file in the model folder that replaces the
    # model's own chat template, and how its output is read back
    chat_template: str = ""
    tool_parser: ToolParser = ToolParser.HERMES
    reasoning_parser: ReasoningParser | None = None
    # `format = "lora"`: the repository model this adapter applies to
    base: str = ""
    lora: LoraSettings = LoraSettings()  # a base model's limits on its adapters
    # an adapter of a base on a remote engine (docs/remote.md): the name the
    # engine serves it under ("" = the adapter's own), and where set, the
    # path the engine reads it from when modeld loads it there
    remote_name: str = ""
    remote_path: str = ""

    @property
    def is_adapter(self) -> bool:
        return self.format is ModelFormat.LORA

    @property
    def artifact_path(self) -> str:
        return self.artifact or DEFAULT_ARTIFACTS[self.format]

    @property
    def is_batched(self) -> bool:
        return self.max_batch_size > 0


def validate_model_name(name: str) -> str:
    if not isinstance(name, str) or not MODEL_NAME_RE.fullmatch(name) or ".." in name:
        raise InvalidArgument(
            f"invalid model name {name!r}: use 1-128 letters, digits, '_', '-' or '.', "
            "starting with a letter or digit, without '..' or path separators"
        )
    return name


def load_model_toml(name: str, path: Path) -> ModelConfig:
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"model {name!r}: {path.name} is not valid TOML: {exc}") from exc
    return config_from_dict(name, raw)


def config_from_json(name: str, text: str) -> ModelConfig:
    """Parse an inline config as tritonclient's load_model(config=...) sends it."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"model {name!r}: inline config is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise InvalidArgument(f"model {name!r}: inline config must be a JSON object")
    return config_from_dict(name, triton_to_native(raw, _KNOWN_KEYS))


_KNOWN_KEYS = {
    "format", "backends", "artifact", "batching", "memory_estimate", "warmup",
    "pinned", "lazy_load", "inputs", "outputs", "text", "name", "kind", "rerank", "limits", "isolation", "source", "served_names",
    "while_pulling", "embedding", "chat_template", "tool_parser", "reasoning_parser", "base", "lora", "version_policy", *OPTIONS_BY_BACKEND,
    "remote_name", "remote_path",
}


def config_from_dict(name: str, raw: dict[str, Any]) -> ModelConfig:
    validate_model_name(name)
    unknown = set(raw) - _KNOWN_KEYS
    if unknown:
        raise InvalidArgument(
            f"model {name!r}: unknown config keys {sorted(unknown)}; known keys are {sorted(_KNOWN_KEYS)}"
        )
    if "name" in raw and raw["name"] != name:
        raise InvalidArgument(f"model {name!r}: config names a different model {raw['name']!r}")
    reader = _Reader(name, raw)
    batching = reader.table("batching")
    declared = reader.enum("format", ModelFormat, ModelFormat.ONNX)
    artifact = _safe_relative(name, reader.str("artifact", ""))
    backend_options = parse_backend_options(name, {k: reader.table(k) for k in OPTIONS_BY_BACKEND if k in raw})
    _check_remote(name, declared, "remote" in raw, backend_options)
    kind = reader.enum("kind", ModelKind, ModelKind.TENSOR)
    rerank = _rerank_spec(name, kind, raw, declared)
    base = _adapter_base(reader, declared)
    return ModelConfig(
        name=name,
        format=_fallback_format(name, artifact) if declared is ModelFormat.REMOTE else declared,
        is_remote=declared is ModelFormat.REMOTE,
        backends=tuple(reader.str_list("backends")),
        artifact=artifact,
        max_batch_size=_Reader(name, batching, "batching.").int("max_batch_size", 0, minimum=0),
        max_queue_delay_us=_Reader(name, batching, "batching.").int("max_queue_delay_us", 0, minimum=0),
        max_queue_size=_Reader(name, batching, "batching.").int("max_queue_size", 1024, minimum=1),
        preferred_batch_sizes=_preferred_sizes(name, batching),
        memory_estimate=reader.size("memory_estimate"),
        warmup=reader.bool("warmup", False),
        pinned=reader.bool("pinned", False),
        lazy_load=reader.bool("lazy_load", None),
        inputs=tuple(_tensor_specs(name, raw.get("inputs", []), "inputs")),
        outputs=tuple(_tensor_specs(name, raw.get("outputs", []), "outputs")),
        text=_text_spec(name, reader.table("text")),
        backend_options=backend_options,
        kind=kind,
        rerank=rerank,
        max_request_bytes=_limits(name, reader.table("limits")),
        matryoshka_dimensions=_matryoshka(name, reader.table("embedding")),
        isolation=_isolation(reader),
        source=_source(reader),
        while_pulling=reader.enum("while_pulling", WhilePulling, WhilePulling.ROUTE),
        served_names=_served_names(reader),
        version_policy=parse_version_policy(name, raw.get("version_policy")),
        chat_template=_safe_relative(name, reader.str("chat_template", ""), "chat_template"),
        tool_parser=reader.enum("tool_parser", ToolParser, ToolParser.HERMES),
        reasoning_parser=(reader.enum("reasoning_parser", ReasoningParser, ReasoningParser.THINK)
                          if "reasoning_parser" in raw else None),
        base=base,
        lora=_lora_settings(name, reader.table("lora")),
        remote_name=_remote_adapter_key(reader, declared, "remote_name", MAX_REMOTE_NAME),
        remote_path=_remote_adapter_key(reader, declared, "remote_path", MAX_REMOTE_PATH),
    )


MAX_REMOTE_NAME, MAX_REMOTE_PATH = 256, 4096


def _remote_adapter_key(reader: _Reader, declared: ModelFormat, key: str, limit: int) -> str:
    """An adapter's remote_name / remote_path: text the remote engine reads
    (a name in its model list, a path on its file system), never a path here."""
    value = reader.str(key, "")
    if value and declared is not ModelFormat.LORA:
        raise InvalidArgument(f"model {reader.model!r}: config key {key} belongs to format = \"lora\" (an adapter "
                              "over a remote engine's base)")
    if len(value) > limit or any(ord(c) < 32 or ord(c) == 127 for c in value) or value != value.strip():
        raise reader._fail(key, f"at most {limit} printable characters without surrounding spaces")
    return value


def _adapter_base(reader: _Reader, declared: ModelFormat) -> str:
    """A LoRA adapter's `base`: another model's name. An adapter runs on its
    base's backend, so it names no backends of its own."""
    base = reader.str("base", "")
    if declared is not ModelFormat.LORA:
        if base:
            raise InvalidArgument(f"model {reader.model!r}: config key base belongs to format = \"lora\" (an adapter), "
                                  f"not format = {declared.value!r}")
        return ""
    if not base:
        raise InvalidArgument(f"model {reader.model!r}: format = \"lora\" needs base = \"<model>\", the repository "
                              "model the adapter applies to")
    if not MODEL_NAME_RE.fullmatch(base) or ".." in base or base == reader.model:
        raise InvalidArgument(f"model {reader.model!r}: config key base must name another model, got {base[:80]!r}")
    for key in ("backends", "lora", "source", *OPTIONS_BY_BACKEND):
        if key in reader.raw:
            raise InvalidArgument(f"model {reader.model!r}: a LoRA adapter runs on its base's backend with the base's "
                                  f"settings; remove {key!r}")
    return base


def _lora_settings(model: str, table: dict[str, Any]) -> LoraSettings:
    unknown = sorted(set(table) - set(_LORA_KEYS))
    if unknown:
        raise InvalidArgument(f"model {model!r}: unknown key lora.{unknown[0]}; known keys are {list(_LORA_KEYS)}")
    reader, default = _Reader(model, table, "lora."), LoraSettings()
    settings = LoraSettings(*(reader.int(key, getattr(default, key), minimum=1) for key in _LORA_KEYS))
    if settings.max_lora_rank > MAX_LORA_RANK:
        raise reader._fail("max_lora_rank", f"at most {MAX_LORA_RANK}")
    return settings


MAX_SERVED_NAMES = 16


def _served_names(reader: _Reader) -> tuple[str, ...]:
    names = reader.str_list("served_names")
    if len(names) > MAX_SERVED_NAMES or len(set(names)) != len(names):
        raise reader._fail("served_names", f"at most {MAX_SERVED_NAMES} distinct names")
    for alias in names:
        if not MODEL_NAME_RE.fullmatch(alias) or ".." in alias or alias == reader.model:
            raise InvalidArgument(f"model {reader.model!r}: served_names entry {alias[:80]!r} must be a model name "
                                  "other than the model's own")
    return tuple(names)


def _source(reader: _Reader) -> str:
    source = reader.str("source", "")
    scheme, sep, _ = source.partition("://")
    if source and (not sep or scheme not in STORE_SCHEMES):
        raise InvalidArgument(f"model {reader.model!r}: config key source {source[:120]!r} names "
                              + (f"scheme {scheme[:20]!r}, which modeld does not know" if sep else "no scheme")
                              + "; use " + ", ".join(f"{s}://" for s in STORE_SCHEMES))
    return source


def _isolation(reader: _Reader) -> Isolation | None:
    if "isolation" not in reader.raw:
        return None
    value = reader.raw["isolation"]
    if value not in MODEL_ISOLATIONS:
        raise reader._fail("isolation", "one of " + ", ".join(MODEL_ISOLATIONS))
    return Isolation(value)


_LIMITS_KEYS = ("max_request_bytes",)


def _limits(model: str, limits: dict[str, Any]) -> int | None:
    unknown = sorted(set(limits) - set(_LIMITS_KEYS))
    if unknown:
        raise InvalidArgument(f"model {model!r}: unknown key limits.{unknown[0]}; known keys are {list(_LIMITS_KEYS)}")
    cap = _Reader(model, limits, "limits.").size("max_request_bytes")
    if cap is not None and cap < 1:
        raise InvalidArgument(f"model {model!r}: config key limits.max_request_bytes must be at least 1 byte, got {cap}")
    return cap


def _matryoshka(model: str, table: dict[str, Any]) -> tuple[int, ...]:
    unknown = sorted(set(table) - {"matryoshka_dimensions"})
    if unknown:
        raise InvalidArgument(f"model {model!r}: unknown key embedding.{unknown[0]}; known keys: matryoshka_dimensions")
    dims = table.get("matryoshka_dimensions", [])
    if not isinstance(dims, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims):
        raise InvalidArgument(f"model {model!r}: config key embedding.matryoshka_dimensions must be a list of "
                              f"positive integers, got {dims!r}")
    return tuple(sorted(set(dims)))


def _check_remote(model: str, declared: ModelFormat, has_table: bool, options: BackendOptions) -> None:
    if declared is ModelFormat.REMOTE and not options.remote.url:
        raise InvalidArgument(f"model {model!r}: format \"remote\" needs a [remote] table with url "
                              "(e.g. url = \"http://127.0.0.1:8000\") and engine (openai, vllm, sglang or tgi)")
    if has_table and declared is not ModelFormat.REMOTE:
        raise InvalidArgument(f"model {model!r}: a [remote] table belongs to format = \"remote\", "
                              f"not format = {declared.value!r}")


def _fallback_format(model: str, artifact: str) -> ModelFormat:
    """The format of a remote model's local fallback file, told by its name."""
    if not artifact:
        return ModelFormat.REMOTE
    suffix = Path(artifact).suffix.lower()
    if suffix not in _FORMAT_BY_SUFFIX:
        raise InvalidArgument(
            f"model {model!r}: the fallback artifact {artifact!r} of a remote model must be named "
            f"*{', *'.join(_FORMAT_BY_SUFFIX)} so its format is known; or leave artifact out for no local fallback")
    return _FORMAT_BY_SUFFIX[suffix]


class _Reader:
    """Typed access to one TOML/JSON table with errors that name the key."""

    def __init__(self, model: str, raw: dict[str, Any], prefix: str = "") -> None:
        self.model, self.raw, self.prefix = model, raw, prefix

    def _fail(self, key: str, want: str) -> InvalidArgument:
        return InvalidArgument(
            f"model {self.model!r}: config key {self.prefix}{key} must be {want}, got {self.raw[key]!r}"
        )

    def table(self, key: str) -> dict[str, Any]:
        value = self.raw.get(key, {})
        if not isinstance(value, dict):
            raise self._fail(key, "a table")
        return value

    def str(self, key: str, default: str) -> str:
        value = self.raw.get(key, default)
        if not isinstance(value, str):
            raise self._fail(key, "a string")
        return value

    def str_list(self, key: str) -> list[str]:
        value = self.raw.get(key, [])
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self._fail(key, "a list of strings")
        return value

    def int(self, key: str, default: int, minimum: int | None = None) -> int:
        value = self.raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
            raise self._fail(key, f"an integer >= {minimum}" if minimum is not None else "an integer")
        return value

    def bool(self, key: str, default: bool | None) -> bool | None:
        value = self.raw.get(key, default)
        if value is not None and not isinstance(value, bool):
            raise self._fail(key, "true or false")
        return value

    def size(self, key: str) -> int | None:
        if key not in self.raw:
            return None
        try:
            return parse_size(self.raw[key])
        except ValueError as exc:
            raise self._fail(key, "a size such as 120MiB or a byte count") from exc

    def enum(self, key: str, enum: type[Enum], default: Enum) -> Any:
        value = self.raw.get(key, default.value)
        try:
            return enum(value)
        except ValueError:
            raise self._fail(key, "one of " + ", ".join(m.value for m in enum)) from None


_BATCHING_KEYS = ("max_batch_size", "max_queue_delay_us", "max_queue_size", "preferred_batch_sizes")


def _preferred_sizes(model: str, batching: dict[str, Any]) -> tuple[int, ...]:
    unknown = sorted(set(batching) - set(_BATCHING_KEYS))
    if unknown:
        raise InvalidArgument(f"model {model!r}: unknown key batching.{unknown[0]}; known keys are {list(_BATCHING_KEYS)}")
    sizes = batching.get("preferred_batch_sizes", [])
    max_batch = batching.get("max_batch_size", 0)
    if (not isinstance(sizes, list)
            or not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= max_batch for v in sizes)):
        raise InvalidArgument(f"model {model!r}: config key batching.preferred_batch_sizes must be a list of "
                              f"integers in 1..max_batch_size ({max_batch}), got {sizes!r}")
    return tuple(sorted(set(sizes)))


def _safe_relative(model: str, path: str, key: str = "artifact") -> str:
    if not path:
        return path
    if "\x00" in path or path.startswith(("/", "\\")) or ".." in Path(path).parts:
        raise InvalidArgument(f"model {model!r}: {key} path {path!r} must stay inside the model folder")
    return path


def _tensor_specs(model: str, items: Any, key: str) -> list[TensorSpec]:
    if not isinstance(items, list):
        raise InvalidArgument(f"model {model!r}: config key {key} must be a list of tensors")
    specs = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InvalidArgument(f"model {model!r}: each entry of {key} needs a string 'name'")
        datatype = item.get("datatype", "")
        if datatype not in DATATYPES:
            raise InvalidArgument(
                f"model {model!r}: {key} tensor {item['name']!r} has datatype {datatype!r}; use one of {', '.join(DATATYPES)}"
            )
        shape = item.get("shape", [])
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= -1 for d in shape):
            raise InvalidArgument(f"model {model!r}: {key} tensor {item['name']!r} shape must be a list of integers >= -1")
        specs.append(TensorSpec(item["name"], datatype, tuple(shape)))
    return specs


def _text_spec(model: str, raw: dict[str, Any]) -> TextSpec | None:
    if not raw:
        return None
    reader = _Reader(model, raw, "text.")
    return TextSpec(
        tokenizer=_safe_relative(model, reader.str("tokenizer", "tokenizer.json")),
        input=reader.str("input", "text"),
        max_length=reader.int("max_length", 256, minimum=1),
    )


def _rerank_spec(model: str, kind: ModelKind, raw: dict[str, Any], declared: ModelFormat) -> RerankSpec:
    table = _Reader(model, raw).table("rerank")
    if kind is not ModelKind.RERANK:
        if "rerank" in raw:
            raise InvalidArgument(f"model {model!r}: a [rerank] table belongs to kind = \"rerank\"")
        return RerankSpec()
    unknown = sorted(set(table) - {"embedding_model"})
    if unknown:
        raise InvalidArgument(f"model {model!r}: unknown config key rerank.{unknown[0]}; known keys: embedding_model")
    spec = RerankSpec(_Reader(model, table, "rerank.").str("embedding_model", ""))
    if declared is not ModelFormat.ONNX:
        raise InvalidArgument(f"model {model!r}: a rerank model is an ONNX graph (format = \"onnx\"), "
                              f"not format = {declared.value!r}")
    if spec.is_bi_encoder:
        if not MODEL_NAME_RE.fullmatch(spec.embedding_model) or spec.embedding_model == model:
            raise InvalidArgument(f"model {model!r}: config key rerank.embedding_model must name another model "
                                  f"in the repository, got {spec.embedding_model!r}")
        # the graph and the tokenizer are the embedding model's; a second
        # set here would be silently unused
        for key in ("artifact", "text"):
            if key in raw:
                raise InvalidArgument(f"model {model!r}: a rerank model with embedding_model uses that model's "
                                      f"graph and tokenizer; remove {key!r}")
    elif not raw.get("text"):
        raise InvalidArgument(f"model {model!r}: a cross-encoder rerank model needs a [text] table naming its "
                              "tokenizer (each query and document are tokenized as one pair), or set "
                              "rerank.embedding_model to rank by an embedding model's cosine similarity")
    return spec
