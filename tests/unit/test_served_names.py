"""served_names: the repository answers which model an alias names."""

from __future__ import annotations

import os

from modeld.server.repository import ModelRepository


def test_an_alias_names_its_model_and_a_model_s_own_name_wins(tmp_path):
    root = tmp_path / "models"
    for name, toml in (("a", 'served_names = ["chat", "b"]\n'), ("b", "")):
        (root / name).mkdir(parents=True)
        (root / name / "model.toml").write_text(toml)
    repository = ModelRepository(root, tmp_path / "inline")
    assert repository.canonical("chat") == "a"
    assert repository.resolve("chat").config.name == "a"
    assert repository.canonical("b") == "b"  # b is a model: a's alias does not take it
    assert repository.canonical("nothing") == "nothing"
    assert repository.names() == ["a", "b"]  # aliases are not listed as models


def test_an_edited_model_toml_changes_its_aliases(tmp_path):
    root = tmp_path / "models"
    (root / "a").mkdir(parents=True)
    toml = root / "a" / "model.toml"
    toml.write_text('served_names = ["old"]\n')
    repository = ModelRepository(root, tmp_path / "inline")
    assert repository.canonical("old") == "a"
    toml.write_text('served_names = ["new"]\n')
    stat = toml.stat()
    os.utime(toml, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # a later mtime, however fast the disk
    assert repository.canonical("new") == "a" and repository.canonical("old") == "old"


def test_inline_models_bring_their_aliases(tmp_path):
    repository = ModelRepository(None, tmp_path / "inline")
    repository.add_inline("m", '{"format": "remote", "remote": {"url": "http://127.0.0.1:1", "engine": "openai"}, '
                               '"served_names": ["m-latest"]}', {})
    assert repository.canonical("m-latest") == "m"
    repository.remove_inline("m")
    assert repository.canonical("m-latest") == "m-latest"
