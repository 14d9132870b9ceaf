"""ModelRepository: repository folders plus inline models from Load requests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modeld.backends.errors import InvalidArgument, NotFound
from modeld.server.repository import ModelRepository


def make_model(root: Path, name: str, toml: str = "", files: dict[str, bytes] | None = None) -> Path:
    model_dir = root / name
    model_dir.mkdir(parents=True)
    (model_dir / "model.toml").write_text(toml, encoding="utf-8")
    for rel, data in (files or {}).items():
        (model_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (model_dir / rel).write_bytes(data)
    return model_dir


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    root, inline = tmp_path / "models", tmp_path / "inline"
    root.mkdir()
    return root, inline


@pytest.fixture
def repo(dirs) -> ModelRepository:
    return ModelRepository(*dirs)


def test_names_lists_folders_with_model_toml(dirs, repo):
    root, _ = dirs
    make_model(root, "beta")
    make_model(root, "alpha")
    (root / "no_config").mkdir()
    (root / "no_config" / "model.onnx").write_bytes(b"x")
    (root / "stray.toml").write_text("")
    assert repo.names() == ["alpha", "beta"]


def test_names_without_a_root_or_with_a_missing_root(tmp_path):
    assert ModelRepository(None, tmp_path / "inline").names() == []
    assert ModelRepository(tmp_path / "missing", tmp_path / "inline").names() == []


def test_resolve_reads_the_config_and_finds_the_artifact(dirs, repo):
    root, _ = dirs
    model_dir = make_model(root, "m", "[batching]\nmax_batch_size = 4\n", {"model.onnx": b"graph"})
    source = repo.resolve("m")
    assert source.model_dir == model_dir
    assert source.is_inline is False
    assert source.config.name == "m"
    assert source.config.max_batch_size == 4
    assert source.config.artifact == "model.onnx"


def test_resolve_finds_the_triton_layout(dirs, repo):
    root, _ = dirs
    make_model(root, "t", "", {"1/model.onnx": b"graph"})
    assert repo.resolve("t").config.artifact == "1/model.onnx"


def test_resolve_keeps_an_explicit_artifact_and_leaves_a_missing_one_empty(dirs, repo):
    root, _ = dirs
    make_model(root, "explicit", 'artifact = "weights/g.onnx"\n')
    make_model(root, "absent")
    assert repo.resolve("explicit").config.artifact == "weights/g.onnx"
    assert repo.resolve("absent").config.artifact == ""
    assert repo.resolve("absent").config.artifact_path == "model.onnx"


def test_resolve_unknown_lists_known_models(dirs, repo):
    root, _ = dirs
    make_model(root, "alpha")
    make_model(root, "beta")
    with pytest.raises(NotFound) as info:
        repo.resolve("gamma")
    assert "unknown model 'gamma'" in str(info.value)
    assert "alpha, beta" in str(info.value)


def test_resolve_unknown_in_an_empty_repository(repo):
    with pytest.raises(NotFound, match="no models"):
        repo.resolve("gamma")


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".."])
def test_resolve_refuses_bad_names(repo, name):
    with pytest.raises(InvalidArgument, match="invalid model name"):
        repo.resolve(name)


def test_resolve_reports_a_bad_model_toml_as_invalid_argument(dirs, repo):
    root, _ = dirs
    make_model(root, "bad", "warmup = 3\n")
    with pytest.raises(InvalidArgument, match="config key warmup must be true or false"):
        repo.resolve("bad")


def test_add_inline_writes_files_and_resolves_the_triton_layout(dirs, repo):
    _, inline = dirs
    config = json.dumps({"platform": "onnxruntime_onnx", "max_batch_size": 2})
    source = repo.add_inline("fresh", config, {"file:1/model.onnx": b"onnx-bytes", "file:labels.txt": b"a\nb"})
    assert source.model_dir == inline / "fresh"
    assert (inline / "fresh" / "1" / "model.onnx").read_bytes() == b"onnx-bytes"
    assert (inline / "fresh" / "labels.txt").read_bytes() == b"a\nb"
    assert source.is_inline is True
    assert source.config.artifact == "1/model.onnx"
    assert source.config.max_batch_size == 2
    # the inline model is listed and resolves to the same source
    assert "fresh" in repo.names()
    assert repo.resolve("fresh") == source


def test_inline_model_shadows_the_repository_model(dirs, repo):
    root, inline = dirs
    make_model(root, "m", "[batching]\nmax_batch_size = 4\n", {"model.onnx": b"old"})
    source = repo.add_inline("m", "{}", {"file:model.onnx": b"new"})
    assert repo.resolve("m").model_dir == inline / "m"
    assert source.config.max_batch_size == 0
    assert repo.names() == ["m"]


def test_config_only_inline_overrides_the_repository_config(dirs, repo):
    root, inline = dirs
    model_dir = make_model(root, "m", "", {"model.onnx": b"graph"})
    source = repo.add_inline("m", json.dumps({"max_batch_size": 8}), {})
    assert source.model_dir == model_dir
    assert source.config.max_batch_size == 8
    assert source.config.artifact == "model.onnx"
    assert not inline.exists()
    # removing the override deletes nothing from the repository
    repo.remove_inline("m")
    assert (model_dir / "model.onnx").read_bytes() == b"graph"
    assert repo.resolve("m").config.max_batch_size == 0


def test_config_only_inline_for_an_unknown_model_is_not_found(repo):
    with pytest.raises(NotFound, match="send its files with the config"):
        repo.add_inline("ghost", "{}", {})


def test_add_inline_replaces_earlier_files(dirs, repo):
    _, inline = dirs
    repo.add_inline("m", "{}", {"file:1/model.onnx": b"v1", "file:old.txt": b"old"})
    repo.add_inline("m", "{}", {"file:model.onnx": b"v2"})
    assert not (inline / "m" / "old.txt").exists()
    assert not (inline / "m" / "1").exists()
    assert repo.resolve("m").config.artifact == "model.onnx"


@pytest.mark.parametrize("key", ["file:../x", "file:/abs", "file:a/../../b", "file:a\x00b", "file:", "file:a//b",
                                 "file:..", "file:a\\..\\b", "model.onnx", "config", "FILE:model.onnx"])
def test_add_inline_refuses_paths_that_leave_the_folder(dirs, repo, key):
    root, inline = dirs
    with pytest.raises(InvalidArgument) as info:
        repo.add_inline("evil", "{}", {"file:model.onnx": b"ok", key: b"payload"})
    message = str(info.value)
    if key.startswith("file:"):
        assert "must be relative and stay inside the model folder" in message
    else:
        assert "is not understood" in message and "'file:<path>'" in message
    # nothing was written anywhere, and the model was not registered
    assert not (inline / "evil").exists()
    assert not (root.parent / "x").exists() and not (root.parent / "b").exists()
    assert "evil" not in repo.names()


def test_a_refused_path_does_not_clobber_an_existing_inline_model(dirs, repo):
    _, inline = dirs
    repo.add_inline("m", "{}", {"file:model.onnx": b"v1"})
    with pytest.raises(InvalidArgument):
        repo.add_inline("m", "{}", {"file:model.onnx": b"v2", "file:../x": b"bad"})
    assert (inline / "m" / "model.onnx").read_bytes() == b"v1"


def test_add_inline_refuses_bad_names_and_bad_configs(dirs, repo):
    _, inline = dirs
    with pytest.raises(InvalidArgument, match="invalid model name"):
        repo.add_inline("../escape", "{}", {"file:model.onnx": b"x"})
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        repo.add_inline("m", "{", {"file:model.onnx": b"x"})
    with pytest.raises(InvalidArgument, match="must stay inside the model folder"):
        repo.add_inline("m", json.dumps({"artifact": "../../etc/passwd"}), {"file:model.onnx": b"x"})
    assert not inline.exists()


def test_remove_inline_deletes_the_folder(dirs, repo):
    _, inline = dirs
    repo.add_inline("gone", "{}", {"file:1/model.onnx": b"x"})
    assert (inline / "gone").is_dir()
    repo.remove_inline("gone")
    assert not (inline / "gone").exists()
    assert "gone" not in repo.names()
    with pytest.raises(NotFound):
        repo.resolve("gone")
    repo.remove_inline("gone")  # a second removal is harmless


def test_remove_inline_falls_back_to_the_repository_model(dirs, repo):
    root, _ = dirs
    model_dir = make_model(root, "m", "", {"model.onnx": b"repo"})
    repo.add_inline("m", "{}", {"file:model.onnx": b"inline"})
    repo.remove_inline("m")
    source = repo.resolve("m")
    assert source.model_dir == model_dir and not source.is_inline


def test_remove_inline_of_a_repository_model_deletes_nothing(dirs, repo):
    root, _ = dirs
    model_dir = make_model(root, "m", "", {"model.onnx": b"repo"})
    repo.remove_inline("m")
    assert (model_dir / "model.onnx").exists()
