"""Paths a model's own files name, kept inside the model's folder.

A model folder may come from a client (an inline upload) or from a store,
and the files in it name other files: an ONNX tensor's external data, the
file keys of onnxruntime-genai's genai_config.json, its tokenizer. Every
such name is resolved here, against the folder, with symlinks followed, so
`../secret`, an absolute path and a link pointing out are all refused the
same way, before any runtime opens the file: modeld checks each path itself
rather than rely on each library's version to do it.

The folder's own entries are not names a file wrote: the artifact and the
`[text]` tokenizer (model.toml's, kept relative without `..` by the config
parser), the parts of a split GGUF (llama.cpp takes them from the first
part's own folder) and safetensors shards (found by glob in the folder).
An operator may link those in from elsewhere; an upload cannot make a link.

Errors name the model and the field and show the path as the model's file
wrote it (relative) or relative to the folder, never an absolute path: an
inline model's folder is a daemon temp path no client should learn.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath, PureWindowsPath

from modeld.backends.errors import InvalidArgument

# any absolute POSIX path in a message: "/" not preceded by a word
# character, ":", "/" or "." (so a URL's own path or a relative "a/b" stays)
_ABSOLUTE_PATH_RE = re.compile(r"(?<![\w:/.~-])/(?:[^\s'\"`/:,;()\[\]{}<>]+/)*[^\s'\"`/:,;()\[\]{}<>]*")


class ArtifactPathError(InvalidArgument):
    """A model file names a path outside its folder (or no usable path)."""


def resolve_inside(model: str, folder: Path, name: object, field: str) -> Path:
    """The file `name` (as a model file wrote it) resolved inside `folder`.

    `field` says where the name was found ("initializer 'w' external data
    location", "genai_config.json model.decoder.filename"). Raises
    ArtifactPathError for an absolute path, one that leaves the folder by
    `..` or through a symlink, or a value that is not a path at all. The
    file need not exist: the runtime that opens it says so if it is missing.
    """
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ArtifactPathError(f"model {model!r}: {field} must be a file name inside the model folder, "
                                f"got {_shown_value(name)}")
    if _is_absolute(name):
        raise ArtifactPathError(f"model {model!r}: {field} is an absolute path (…/{_last_part(name)}); "
                                "a model's files must be named relative to its folder")
    root = folder.resolve()
    target = (root / name).resolve()
    if not target.is_relative_to(root):
        how = "through a symbolic link" if ".." not in PurePosixPath(name.replace("\\", "/")).parts else "by '..'"
        raise ArtifactPathError(f"model {model!r}: {field} {name!r} leaves the model folder ({how}); "
                                "a model's files must stay inside its folder")
    return target


def check_tokenizer_config(model: str, folder: Path) -> None:
    """A Hugging Face folder's tokenizer_config.json keys that name a file
    (tokenizer_file, vocab_file, merges_file, ...) resolved inside the
    folder: transformers opens what they name in place of the folder's own
    files. A file that cannot be read is left to transformers to report."""
    import json

    path = folder / "tokenizer_config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        return
    for key, value in (data.items() if isinstance(data, dict) else ()):
        if key.endswith("_file") and isinstance(value, str) and value:
            resolve_inside(model, folder, value, f"tokenizer_config.json key {key}")


def scrub_paths(text: str, folders: tuple[Path, ...] = ()) -> str:
    """`text` (a runtime's message) with every absolute path taken out: the
    model folders' own prefix dropped (so their files read relative), any
    other absolute path cut to its last part."""
    for folder in folders:
        for root in {str(folder), str(folder.resolve())}:
            if root and root != "/":
                text = text.replace(root + "/", "").replace(root, "<model folder>")
    return _ABSOLUTE_PATH_RE.sub(lambda m: _scrubbed(m, text), text)


_HTTP_METHODS = ("GET ", "POST ", "PUT ", "DELETE ", "HEAD ", "PATCH ")
# the routes remote engines answer on (backends/remote), named in their errors
_ROUTE_RE = re.compile(r"/(v\d+|generate|generate_stream|health|metrics|info|tokenize|detokenize|extras|"
                       r"get_model_info|openapi\.json)(/|$)")


def _scrubbed(match: re.Match, text: str) -> str:
    found = match.group()
    # "/" alone, or a remote engine's route ("GET /v1/models", "(/health)"), is no file
    if (found == "/" or _ROUTE_RE.match(found)
            or text[max(0, match.start() - 7):match.start()].endswith(_HTTP_METHODS)):
        return found
    return f"…/{_last_part(found)}"


def _is_absolute(name: str) -> bool:
    # a Windows drive or UNC path is as absolute to onnxruntime on Windows
    return (name.startswith(("/", "\\", "~")) or PurePosixPath(name).is_absolute()
            or bool(PureWindowsPath(name).drive))


def _last_part(name: str) -> str:
    parts = [p for p in re.split(r"[/\\]", name) if p]
    return parts[-1] if parts else ""


def _shown_value(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
