"""The [remote] table: typed, checked once, errors that name the key; which
backend serves a remote model and how its local fallback file is told."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modeld.backends.errors import InvalidArgument
from modeld.backends.model_config import ModelFormat, config_from_dict, config_from_json
from modeld.backends.registry import BackendRegistry
from modeld.server.repository import ModelRepository

# the issue's example, key for key: other tests and bench_remote.py write these
ISSUE_EXAMPLE = {
    "format": "remote",
    "backends": ["vllm", "llamacpp"],
    "artifact": "model.gguf",
    "remote": {"engine": "vllm", "url": "http://127.0.0.1:8000", "model": "SmolLM2-135M-Instruct",
               "api_key_env": "VLLM_API_KEY", "timeout_s": 600, "max_in_flight": 64},
}


def _remote(**remote) -> dict:
    return {"format": "remote", "remote": {"url": "http://127.0.0.1:8000", **remote}}


def test_the_issue_example_parses_into_typed_options():
    config = config_from_dict("smol", ISSUE_EXAMPLE)
    remote = config.backend_options.remote
    assert config.is_remote and config.backends == ("vllm", "llamacpp")
    assert (remote.engine, remote.url, remote.model, remote.api_key_env) == (
        "vllm", "http://127.0.0.1:8000", "SmolLM2-135M-Instruct", "VLLM_API_KEY")
    assert (remote.timeout_s, remote.max_in_flight) == (600, 64)
    # the fallback file's format, from its name: what the local backends judge
    assert config.format is ModelFormat.GGUF and config.artifact_path == "model.gguf"


def test_defaults_and_no_fallback_artifact():
    config = config_from_dict("m", _remote())
    remote = config.backend_options.remote
    assert (remote.engine, remote.model, remote.api_key_env, remote.max_in_flight) == ("openai", "", "", 64)
    assert (remote.unhealthy_after, remote.probe_interval_s, remote.max_probe_interval_s) == (3, 2.0, 30.0)
    assert config.format is ModelFormat.REMOTE and config.artifact_path == ""


@pytest.mark.parametrize("artifact, fmt", [("model.gguf", ModelFormat.GGUF), ("1/model.onnx", ModelFormat.ONNX),
                                           ("w.safetensors", ModelFormat.SAFETENSORS)])
def test_fallback_format_follows_the_artifact_name(artifact, fmt):
    assert config_from_dict("m", {**_remote(), "artifact": artifact}).format is fmt


@pytest.mark.parametrize("raw, fragment", [
    ({"format": "remote"}, "needs a [remote] table with url"),
    ({"format": "gguf", "remote": {"url": "http://a:1"}}, "belongs to format = \"remote\""),
    (_remote(url="ftp://host/x"), "remote.url must be an http:// or https:// URL"),
    (_remote(url="http://"), "remote.url must be an http:// or https:// URL"),
    (_remote(url="localhost:8000"), "remote.url must be an http:// or https:// URL"),
    (_remote(engine="tensorrt"), "remote.engine must be one of openai, vllm, sglang, tgi"),
    (_remote(timeout_s=0), "remote.timeout_s must be a number > 0"),
    (_remote(timeout_s="10"), "remote.timeout_s must be a number > 0"),
    (_remote(max_in_flight=0), "remote.max_in_flight must be an integer >= 1"),
    (_remote(api_key_env="MY-KEY"), "remote.api_key_env must be the name of an environment variable"),
    (_remote(model=5), "remote.model must be a string"),
    (_remote(probe_interval_s=5, max_probe_interval_s=1), "remote.max_probe_interval_s must be at least"),
    (_remote(headers={}), "unknown config key remote.headers; known keys: api_key_env, engine"),
    ({**_remote(), "artifact": "weights.bin"}, "must be named *.gguf, *.onnx, *.safetensors"),
])
def test_bad_remote_config_is_invalid_argument_naming_the_key(raw, fragment):
    with pytest.raises(InvalidArgument) as err:
        config_from_dict("m", raw)
    assert fragment in str(err.value) and "model 'm'" in str(err.value)


def test_inline_json_takes_the_same_keys():
    config = config_from_json("m", json.dumps(ISSUE_EXAMPLE))
    assert config.is_remote and config.backend_options.remote.engine == "vllm"


def test_an_inline_remote_model_needs_no_files(tmp_path):
    repository = ModelRepository(None, tmp_path)
    source = repository.add_inline("m", json.dumps(_remote()), {})
    assert source.config.is_remote and source.model_dir.is_dir()
    assert repository.resolve("m") is source


REGISTRY = BackendRegistry()


@pytest.mark.parametrize("engine, serving", [
    ("openai", {"openai"}), ("vllm", {"vllm", "openai"}), ("sglang", {"sglang", "openai"}), ("tgi", {"tgi"}),
])
def test_each_remote_backend_serves_its_engines(engine, serving, tmp_path):
    config = config_from_dict("m", _remote(engine=engine))
    verdicts = {name: REGISTRY.get(name).can_serve(config, tmp_path) for name in ("openai", "vllm", "sglang", "tgi")}
    assert {name for name, v in verdicts.items() if v.ok} == serving
    for name, verdict in verdicts.items():
        if not verdict.ok:
            assert f"not [remote] engine = {engine!r}" in verdict.reason


def test_local_backends_judge_the_fallback_file_and_remote_ones_refuse_files(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    remote = config_from_dict("m", ISSUE_EXAMPLE)
    assert REGISTRY.get("llamacpp").can_serve(remote, tmp_path).ok
    without_file = config_from_dict("m", {**ISSUE_EXAMPLE, "artifact": "other.gguf"})
    assert "missing" in REGISTRY.get("llamacpp").can_serve(without_file, tmp_path).reason
    no_fallback = config_from_dict("m", _remote())
    assert "not remote" in REGISTRY.get("llamacpp").can_serve(no_fallback, tmp_path).reason
    local = config_from_dict("m", {"format": "gguf"})
    assert "not gguf files" in REGISTRY.get("vllm").can_serve(local, tmp_path).reason


def test_remote_backends_reserve_no_memory(tmp_path):
    config = config_from_dict("m", ISSUE_EXAMPLE)
    assert all(REGISTRY.get(n).estimate_bytes(config, Path(tmp_path)) == 0 for n in ("openai", "vllm", "sglang", "tgi"))


# -- an adapter over a remote base ----------------------------------------------------------


def test_an_adapters_remote_name_and_path_parse_and_default_to_empty():
    config = config_from_dict("acme-sql", {"format": "lora", "base": "smol", "remote_name": "sql-v1",
                                           "remote_path": "/srv/adapters/sql"})
    assert (config.remote_name, config.remote_path) == ("sql-v1", "/srv/adapters/sql")
    plain = config_from_dict("acme-sql", {"format": "lora", "base": "smol"})
    assert (plain.remote_name, plain.remote_path) == ("", "")
    assert config_from_json("acme-sql", json.dumps({"format": "lora", "base": "smol", "remote_name": "x"})
                            ).remote_name == "x"


@pytest.mark.parametrize("raw, fragment", [
    ({**_remote(engine="vllm"), "remote_name": "x"}, "config key remote_name belongs to format = \"lora\""),
    ({"format": "onnx", "remote_path": "/a"}, "config key remote_path belongs to format = \"lora\""),
    ({"format": "lora", "base": "smol", "remote_name": "a\nb"}, "config key remote_name must be at most 256"),
    ({"format": "lora", "base": "smol", "remote_name": "x" * 257}, "config key remote_name must be at most 256"),
    ({"format": "lora", "base": "smol", "remote_path": " /a"}, "config key remote_path must be at most 4096"),
    ({"format": "lora", "base": "smol", "remote_path": "/" * 4097}, "config key remote_path must be at most 4096"),
    ({"format": "lora", "base": "smol", "remote_name": 3}, "config key remote_name must be a string"),
])
def test_bad_remote_adapter_keys_are_invalid_argument_naming_the_key(raw, fragment):
    with pytest.raises(InvalidArgument, match=fragment.replace("(", r"\(")):
        config_from_dict("m", raw)
