"""genai_config.json checked before onnxruntime-genai reads it.

onnxruntime-genai takes its config as it finds it: a file key may name any
path, `session_options.custom_ops_library` loads a shared object into the
daemon's process (its constructor runs at once), `enable_profiling` and
session config entries such as `session.optimized_model_filepath` or
`ep.context_file_path` write files, and execution-provider options such as
QNN's `backend_path` load another library. An uploaded folder must not be
able to do any of that, so before og.Config sees the folder:

- every file key (filename, config_filename, adapter_filename, data_file,
  tokenizer_dir) must resolve inside the folder (artifact_paths), and each
  ONNX file it names must keep its external data inside too;
- session options may hold only the keys below that change how fast it
  runs; any other key, and any provider option whose name says it is a
  path, a file, a directory or a library, is refused by name unless the
  operator lets it through with the `onnx_genai_allowed_keys` setting.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

from modeld.backends.artifact_paths import resolve_inside
from modeld.backends.errors import InvalidArgument
from modeld.backends.onnx.external_data import check_model_file

GENAI_CONFIG = "genai_config.json"

FILE_KEYS = frozenset({"filename", "config_filename", "adapter_filename", "data_file", "tokenizer_dir"})
# session options that tune threads, memory and logging, and load nothing
SAFE_SESSION_KEYS = frozenset({
    "log_id", "log_severity_level", "log_verbosity_level", "intra_op_num_threads", "inter_op_num_threads",
    "enable_cpu_mem_arena", "enable_mem_pattern", "graph_optimization_level", "provider_options",
})
# a provider option that names something to read, write or load
_PATHLIKE_RE = re.compile(r"path|file|dir|librar|plugin|cache|\.so$|dll", re.IGNORECASE)
_LIBRARY_RE = re.compile(r"librar|plugin", re.IGNORECASE)  # a key that loads a library, at any depth
_MAX_DEPTH = 32  # nesting deeper than any real config: refused rather than recursed


class GenaiConfigRefused(InvalidArgument):
    """A genai_config.json key the daemon does not let through."""


def check_genai_config(model: str, folder: Path, genai: Any, allowed: frozenset[str]) -> None:
    """Raise InvalidArgument naming the first key that would reach outside
    the folder or load code; `allowed` holds the operator's
    onnx_genai_allowed_keys (a bare key or its dotted path)."""
    for path, key, value in _entries(model, genai, ()):
        dotted = ".".join((*path, key))
        if key in FILE_KEYS:
            _check_file(model, folder, dotted, value)
        elif _is_dangerous(path, key) and not ({key, dotted} & allowed):
            raise GenaiConfigRefused(
                f"model {model!r}: {GENAI_CONFIG} key {dotted} can load code or write files outside the model "
                f"and is refused; remove it, or an operator can allow it with the setting "
                f"onnx_genai_allowed_keys = [\"{key}\"]")


def _check_file(model: str, folder: Path, dotted: str, value: Any) -> None:
    target = resolve_inside(model, folder, value, f"{GENAI_CONFIG} key {dotted}")
    if target.suffix == ".onnx" and target.is_file():
        check_model_file(model, folder, target)


def _is_dangerous(path: tuple[str, ...], key: str) -> bool:
    if _LIBRARY_RE.search(key):  # wherever a release puts it
        return True
    if "session_options" in path[-1:]:
        return key not in SAFE_SESSION_KEYS
    if "provider_options" in path:  # [{"cuda": {"option": "value"}}]: the option's own name
        return bool(_PATHLIKE_RE.search(key))
    return False


def _entries(model: str, value: Any, path: tuple[str, ...],
             depth: int = 0) -> Iterator[tuple[tuple[str, ...], str, Any]]:
    """(path, key, value) of every key at any depth; list items keep their parent's path."""
    if depth > _MAX_DEPTH:
        raise GenaiConfigRefused(f"model {model!r}: {GENAI_CONFIG} nests deeper than {_MAX_DEPTH} levels")
    if isinstance(value, dict):
        for key, item in value.items():
            yield path, str(key), item
            yield from _entries(model, item, (*path, str(key)), depth + 1)
    elif isinstance(value, list):
        for item in value:
            yield from _entries(model, item, path, depth + 1)
