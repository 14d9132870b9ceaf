"""The model repository: `<root>/<name>/model.toml` plus artifacts.

Inline models (config and files sent in a Load request) are written to a
private folder of their own and shadow repository models of the same name.
Every name and file path from a client is checked so it cannot leave its
folder.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from modeld.backends.errors import InvalidArgument, NotFound
from modeld.backends.model_config import (
    ModelConfig, config_from_json, load_model_toml, validate_model_name,
)

CONFIG_FILE = "model.toml"


@dataclass(frozen=True)
class ModelSource:
    config: ModelConfig
    model_dir: Path
    is_inline: bool = False


class ModelRepository:
    def __init__(self, root: Path | None, inline_root: Path) -> None:
        self.root = root
        self.inline_root = inline_root
        self._inline: dict[str, ModelSource] = {}

    def names(self) -> list[str]:
        found = set(self._inline)
        if self.root is not None and self.root.is_dir():
            found.update(p.parent.name for p in self.root.glob(f"*/{CONFIG_FILE}"))
        return sorted(found)

    def resolve(self, name: str) -> ModelSource:
        validate_model_name(name)
        if name in self._inline:
            return self._inline[name]
        model_dir = self._repo_dir(name)
        if model_dir is None:
            raise NotFound(f"unknown model {name!r}; the repository has: {', '.join(self.names()) or 'no models'}")
        config = load_model_toml(name, model_dir / CONFIG_FILE)
        return ModelSource(_locate_artifact(config, model_dir), model_dir)

    def _repo_dir(self, name: str) -> Path | None:
        if self.root is None:
            return None
        model_dir = self.root / name
        return model_dir if (model_dir / CONFIG_FILE).is_file() else None

    def add_inline(self, name: str, config_json: str, files: dict[str, bytes]) -> ModelSource:
        """Register a model from a Load request (tritonclient's load_model)."""
        validate_model_name(name)
        config = config_from_json(name, config_json)
        if not files and config.is_remote and self._repo_dir(name) is None:
            model_dir = self._write_files(name, {})  # a remote engine needs no file, only a folder of its own
        elif not files:
            # A config alone overrides the repository model's config.
            model_dir = self._repo_dir(name)
            if model_dir is None:
                raise NotFound(f"unknown model {name!r}: send its files with the config to load it inline")
        else:
            model_dir = self._write_files(name, files)
        source = ModelSource(_locate_artifact(config, model_dir), model_dir, is_inline=True)
        self._inline[name] = source
        return source

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
