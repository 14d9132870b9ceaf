"""Version policies and version folders, without a daemon."""

from __future__ import annotations

from pathlib import Path

import pytest

from modeld.backends.errors import InvalidArgument, NotFound
from modeld.backends.version_policy import MAX_VERSIONS, PolicyKind, VersionPolicy, parse_version_policy
from modeld.server.repository import ModelRepository
from modeld.server.versions import parse_version, served_versions, split_key, version_key


@pytest.mark.parametrize("raw, kind, picked", [
    (None, PolicyKind.LATEST, (5,)),
    ({}, PolicyKind.LATEST, (5,)),
    ("all", PolicyKind.ALL, (1, 2, 5)),
    ({"all": {}}, PolicyKind.ALL, (1, 2, 5)),
    ({"latest": 2}, PolicyKind.LATEST, (2, 5)),
    ({"latest": {"num_versions": "2"}}, PolicyKind.LATEST, (2, 5)),  # protobuf JSON's int64 as text
    ({"specific": [5, 1, 9]}, PolicyKind.SPECIFIC, (1, 5)),
    ({"specific": {"versions": [2]}}, PolicyKind.SPECIFIC, (2,)),
])
def test_policies_pick_from_the_folders_there_are(raw, kind, picked):
    policy = parse_version_policy("m", raw)
    assert policy.kind is kind
    assert policy.select([5, 1, 2]) == picked


@pytest.mark.parametrize("raw, named", [
    ({"latest": 0}, "latest must be"), ({"latest": MAX_VERSIONS + 1}, "latest must be"), ({"latest": True}, "latest"),
    ({"specific": []}, "specific must list"), ({"specific": list(range(1, MAX_VERSIONS + 2))}, "specific must list"),
    ({"specific": [0]}, "whole numbers"), ({"specific": ["x"]}, "whole numbers"),
    ("newest", "not understood"), ({"latest": 1, "all": {}}, "not understood"), (3, "not understood"),
])
def test_bad_policies_are_refused_naming_the_fault(raw, named):
    with pytest.raises(InvalidArgument, match=named):
        parse_version_policy("m", raw)


def test_keys_and_versions():
    assert version_key("m", 1) == "m" and version_key("m", 12) == "m:12"
    assert split_key("m:12") == ("m", 12) and split_key("m") == ("m", None)
    assert [parse_version(v) for v in ("3", "03", "0", "-1", "x", "", "9" * 20)] == [3, None, None, None, None, None,
                                                                                       None]


def test_unicode_digits_are_not_versions(tmp_path):
    # str.isdigit takes superscripts and other scripts' digits; int() refuses them
    assert [parse_version(v) for v in ("\u00b9", "1\u00b2", "\u0663")] == [None, None, None]
    assert split_key("m:\u00b9") == ("m:\u00b9", None)
    _entry(tmp_path, "m", [1, 2])
    (tmp_path / "m" / "\u00b9").mkdir()
    (tmp_path / "m" / "\u00b9" / "model.onnx").write_bytes(b"onnx")
    assert served_versions(ModelRepository(tmp_path, tmp_path / "inline").resolve("m")) == (2,)


def _entry(root: Path, name: str, versions: list[int], toml: str = 'format = "onnx"\n', at_root: bool = False) -> None:
    folder = root / name
    folder.mkdir(parents=True)
    for v in versions:
        (folder / str(v)).mkdir()
        (folder / str(v) / "model.onnx").write_bytes(b"onnx")
    if at_root:
        (folder / "model.onnx").write_bytes(b"onnx")
    (folder / "model.toml").write_text(toml)


def test_the_repository_resolves_a_versions_key_to_its_folder(tmp_path):
    _entry(tmp_path, "v", [1, 2, 3], 'format = "onnx"\nversion_policy = { latest = 2 }\n')
    _entry(tmp_path, "root", [2], at_root=True)  # an artifact at the root: one version, as always
    (tmp_path / "v" / "7").mkdir()  # a numbered folder without the artifact is no version
    repo = ModelRepository(tmp_path, tmp_path / "inline")
    assert served_versions(repo.resolve("v")) == (2, 3)
    three = repo.resolve("v:3")
    assert (three.config.name, three.config.artifact) == ("v:3", "3/model.onnx")
    assert repo.resolve("v").config.artifact == "1/model.onnx"  # the plain name: today's Triton layout
    with pytest.raises(NotFound, match="it serves versions 2, 3"):
        repo.resolve("v:1")
    assert served_versions(repo.resolve("root")) == (1,)
    assert repo.resolve("root").config.artifact == "model.onnx"
    with pytest.raises(NotFound, match="it has version 1"):
        repo.resolve("root:2")


def test_a_policy_that_matches_no_folder_serves_nothing(tmp_path):
    _entry(tmp_path, "none", [1, 2], 'format = "onnx"\nversion_policy = { specific = [5] }\n')
    repo = ModelRepository(tmp_path, tmp_path / "inline")
    assert served_versions(repo.resolve("none")) == ()
    assert repo.resolve("none").config.version_policy == VersionPolicy(PolicyKind.SPECIFIC, versions=(5,))
