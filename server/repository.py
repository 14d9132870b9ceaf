"""The model repository: `<root>/<name>/model.toml` plus artifacts.

Inline models (config and files sent in a Load request) are written to a
private folder of their own and shadow repository models of the same name.
Every name and file path from a client is checked so it cannot leave its
folder.

A model whose config names a `source` (oci://, s3://, hf://) has its files
in a store: `pull` fetches them into the store's disk cache and answers the
pulled folder, whose own model.toml (if any) is the base the entry's keys
override.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from modeld.backends.errors import InvalidArgument, NotFound
from modeld.backends.model_config import (
    ModelConfig, config_from_dict, config_from_json, load_model_toml, validate_model_name,
)
from modeld.server.store import ModelStore, PulledModel
from modeld.server.versions import at_version, split_key

CONFIG_FILE = "model.toml"


@dataclass(frozen=True)
class ModelSource:
    config: ModelConfig
    model_dir: Path
    is_inline: bool = False
    # the keys the entry's own config sets, as written: with a `source`, they
    # override the pulled artifact's model.toml
    declared: dict = dataclasses.field(default_factory=dict, compare=False)


class ModelRepository:
    def __init__(self, root: Path | None, inline_root: Path, store: ModelStore | None = None) -> None:
        self.root = root
        self.inline_root = inline_root
        self._inline: dict[str, ModelSource] = {}
        self.store = store if store is not None else ModelStore()
        self._alias_key: tuple = ()
        self._repo_aliases: dict[str, str] = {}

    def names(self) -> list[str]:
        found = set(self._inline)
        if self.root is not None and self.root.is_dir():
            found.update(p.parent.name for p in self.root.glob(f"*/{CONFIG_FILE}"))
        return sorted(found)

    def canonical(self, name: str) -> str:
        """The model `name` names: itself, or the model whose served_names
        holds it. A model's own name wins over another model's alias."""
        if name in self._inline or self._repo_dir(name) is not None:
            return name
        return self._aliases().get(name, name)

    def _aliases(self) -> dict[str, str]:
        found: dict[str, str] = {}
        for model in sorted(self._inline):
            for alias in self._inline[model].config.served_names:
                found.setdefault(alias, model)
        if self.root is not None and self.root.is_dir():
            tomls = sorted(self.root.glob(f"*/{CONFIG_FILE}"))
            # reread only when a model.toml changed: an alias may be named on every call
            key = tuple((p, p.stat().st_mtime_ns) for p in tomls if p.is_file())
            if key != self._alias_key:
                self._repo_aliases = {}
                for path, _ in key:
                    try:
                        names = tomllib.loads(path.read_text(encoding="utf-8")).get("served_names", [])
                    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
                        continue  # its own load says what is wrong with it
                    for alias in names if isinstance(names, list) else []:
                        if isinstance(alias, str):
                            self._repo_aliases.setdefault(alias, path.parent.name)
                self._alias_key = key
            for alias, model in self._repo_aliases.items():
                found.setdefault(alias, model)
        return found

    def resolve(self, name: str) -> ModelSource:
        """The entry `name` names; an engine key "m:2" (server/versions.py)
        names version 2 of entry m, its artifact in that version's folder."""
        model, version = split_key(name)
        return at_version(self._resolve_model(model), version)

    def _resolve_model(self, name: str) -> ModelSource:
        validate_model_name(name)
        name = self.canonical(name)
        if name in self._inline:
            return self._inline[name]
        model_dir = self._repo_dir(name)
        if model_dir is None:
            raise NotFound(f"unknown model {name!r}; the repository has: {', '.join(self.names()) or 'no models'}")
        config = load_model_toml(name, model_dir / CONFIG_FILE)
        declared = _declared_toml(model_dir / CONFIG_FILE) if config.source else {}
        return ModelSource(_locate_artifact(config, model_dir), model_dir, declared=declared)

    def _repo_dir(self, name: str) -> Path | None:
        if self.root is None:
            return None
        try:  # a name no model may have (too long for a file name, a path) is never looked up on disk
            validate_model_name(name)
        except InvalidArgument:
            return None
        model_dir = self.root / name
        return model_dir if (model_dir / CONFIG_FILE).is_file() else None

    def add_inline(self, name: str, config_json: str, files: dict[str, bytes]) -> ModelSource:
        """Register a model from a Load request (tritonclient's load_model)."""
        validate_model_name(name)
        config = config_from_json(name, config_json)
        if not files and (config.is_remote or config.source) and self._repo_dir(name) is None:
            # a remote engine needs no file, a store model brings its own: only a folder of its own
            model_dir = self._write_files(name, {})
        elif not files:
            # A config alone overrides the repository model's config.
            model_dir = self._repo_dir(name)
            if model_dir is None:
                raise NotFound(f"unknown model {name!r}: send its files with the config to load it inline")
        else:
            model_dir = self._write_files(name, files)
        declared = _declared_json(config_json) if config.source else {}
        source = ModelSource(_locate_artifact(config, model_dir), model_dir, is_inline=True, declared=declared)
        self._inline[name] = source
        return source

    def start_pull(self, source: ModelSource):
        """Begin (or join) the pull of a store model: (future, shared progress)."""
        return self.store.start_pull(source.config.source)

    def pulled_source(self, source: ModelSource, pulled: PulledModel) -> ModelSource:
        """The model as the engine loads it: the pulled folder, with the
        artifact's model.toml under the entry's own keys."""
        config = pulled_config(source.config.name, source.config.source, source.declared, pulled)
        return ModelSource(_locate_artifact(config, pulled.folder), pulled.folder, is_inline=source.is_inline,
                           declared=source.declared)

    def _write_files(self, name: str, files: dict[str, bytes]) -> Path:
        model_dir = self.inline_root / name
        paths = {key: _safe_file_path(key) for key in files}
        if model_dir.exists():
            shutil.rmtree(model_dir)
        model_dir.mkdir(parents=True)
        for key, rel in paths.items():
            target = model_dir.joinpath(*rel.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(files[key])
        return model_dir

    def remove_inline(self, name: str) -> None:
        source = self._inline.pop(name, None)
        if source is not None and source.model_dir.is_relative_to(self.inline_root):
            shutil.rmtree(source.model_dir, ignore_errors=True)


def _declared_toml(path: Path) -> dict:
    return tomllib.loads(path.read_text(encoding="utf-8"))  # parsed once already: it is valid


def _declared_json(text: str) -> dict:
    raw = json.loads(text)  # parsed once already: it is a JSON object
    return raw


_FORMAT_BY_SUFFIX = ((".onnx", "onnx"), (".gguf", "gguf"), (".safetensors", "safetensors"),
                     (".mlpackage", "coreml"), (".mlmodel", "coreml"))


def pulled_config(name: str, uri: str, declared: dict, pulled: PulledModel) -> ModelConfig:
    """Config of a pulled model: its own model.toml (if the artifact has one),
    overridden by the keys the repository entry or inline config set; without
    either saying a format, the format and artifact follow its files."""
    base: dict = {}
    toml_path = pulled.folder / CONFIG_FILE
    if toml_path.is_file():
        try:
            base = tomllib.loads(toml_path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"model {name!r}: the model.toml in {uri} is not valid TOML: {exc}") from None
        base.pop("name", None)
        base.pop("source", None)
    merged = {**base, **{k: v for k, v in declared.items() if k not in ("name", "source")}}
    if "format" not in merged:
        model_format, artifact = _guess_artifact(pulled)
        if model_format:
            merged["format"] = model_format
            if artifact and "artifact" not in merged:
                merged["artifact"] = artifact
    return dataclasses.replace(config_from_dict(name, merged), source=uri)


def _guess_artifact(pulled: PulledModel) -> tuple[str, str]:
    files = sorted(p.relative_to(pulled.folder).as_posix() for p in pulled.folder.rglob("*") if p.is_file())
    hinted = pulled.hints.get("format", "")
    for suffix, model_format in _FORMAT_BY_SUFFIX:
        if hinted and hinted != model_format:
            continue
        found = [f for f in files if f.lower().endswith(suffix)]
        if found:
            if model_format == "safetensors":
                return model_format, ""  # a checkpoint folder: the backend reads config.json and every shard
            return model_format, found[0]
    return hinted if hinted in {m for _, m in _FORMAT_BY_SUFFIX} else "", ""


def _safe_file_path(key: str) -> PurePosixPath:
    """'file:1/model.onnx' -> PurePosixPath('1/model.onnx'), refusing escapes."""
    if not key.startswith("file:"):
        raise InvalidArgument(f"load parameter {key!r} is not understood; model files are sent as 'file:<path>'")
    raw = key[len("file:"):]
    path = PurePosixPath(raw)
    if (not raw or "\x00" in raw or "\\" in raw or path.is_absolute()
            or any(part in ("..", "") for part in raw.split("/"))):
        raise InvalidArgument(f"model file path {raw!r} must be relative and stay inside the model folder")
    return path


def _locate_artifact(config: ModelConfig, model_dir: Path) -> ModelConfig:
    """Find the artifact in our layout (model.onnx) or Triton's (1/model.onnx)."""
    if config.artifact:
        return config
    default = config.artifact_path
    for candidate in (default, f"1/{default}"):
        if (model_dir / candidate).is_file():
            return dataclasses.replace(config, artifact=candidate)
    return config
