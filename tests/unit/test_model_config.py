"""Model configs: model.toml and Triton-style JSON into one frozen ModelConfig."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modeld.backends.errors import InvalidArgument
from modeld.backends.model_config import (
    ModelConfig, ModelFormat, TensorSpec, TextSpec, config_from_dict, config_from_json, load_model_toml,
    validate_model_name,
)

MINILM_TOML = """
format = "onnx"
backends = ["onnx", "reference"]
memory_estimate = "120MiB"
warmup = true

[batching]
max_batch_size = 64
max_queue_delay_us = 250
max_queue_size = 32

[text]
tokenizer = "tokenizer.json"
input = "text"
max_length = 128

[onnx]
intra_op_threads = 2

[[inputs]]
name = "text"
datatype = "BYTES"
shape = [-1]

[[outputs]]
name = "embedding"
datatype = "FP32"
shape = [-1, 384]
"""


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "model.toml"
    path.write_text(text, encoding="utf-8")
    return path


# -- model.toml ----------------------------------------------------------------


def test_model_toml_parses_every_section(tmp_path):
    config = load_model_toml("minilm", write_toml(tmp_path, MINILM_TOML))
    assert config.name == "minilm"
    assert config.format is ModelFormat.ONNX
    assert config.backends == ("onnx", "reference")
    assert config.memory_estimate == 120 * 1024**2
    assert config.warmup is True
    assert config.pinned is False
    assert config.lazy_load is None
    assert (config.max_batch_size, config.max_queue_delay_us, config.max_queue_size) == (64, 250, 32)
    assert config.is_batched
    assert config.text == TextSpec(tokenizer="tokenizer.json", input="text", max_length=128)
    assert config.backend_options == {"onnx": {"intra_op_threads": 2}}
    assert config.inputs == (TensorSpec("text", "BYTES", (-1,)),)
    assert config.outputs == (TensorSpec("embedding", "FP32", (-1, 384)),)
    assert config.artifact_path == "model.onnx"


def test_model_toml_defaults(tmp_path):
    config = load_model_toml("plain", write_toml(tmp_path, ""))
    assert config == ModelConfig(name="plain")
    assert config.max_batch_size == 0 and not config.is_batched
    assert config.max_queue_size == 1024
    assert config.memory_estimate is None
    assert config.text is None
    assert config.artifact_path == "model.onnx"


def test_embedded_repository_configs_parse():
    root = Path(__file__).resolve().parents[2] / "models"
    minilm = load_model_toml("minilm", root / "minilm" / "model.toml")
    assert minilm.memory_estimate == 120 * 1024**2
    assert minilm.max_batch_size == 64
    assert minilm.text is not None and minilm.text.tokenizer == "tokenizer.json"
    softcap = load_model_toml("softcap_demo", root / "softcap_demo" / "model.toml")
    assert softcap.max_batch_size == 8 and softcap.backends == ()


@pytest.mark.parametrize(("text", "nbytes"), [
    ('memory_estimate = "120MiB"', 120 * 1024**2),
    ('memory_estimate = "2GiB"', 2 * 1024**3),
    ('memory_estimate = "512MB"', 512 * 1000**2),
    ('memory_estimate = "1.5KiB"', 1536),
    ("memory_estimate = 1048576", 1048576),
])
def test_memory_estimate_sizes(tmp_path, text, nbytes):
    assert load_model_toml("m", write_toml(tmp_path, text)).memory_estimate == nbytes


def test_gguf_format_changes_the_default_artifact(tmp_path):
    config = load_model_toml("llm", write_toml(tmp_path, 'format = "gguf"\n'))
    assert config.format is ModelFormat.GGUF
    assert config.artifact_path == "model.gguf"


def test_explicit_artifact_is_kept(tmp_path):
    config = load_model_toml("m", write_toml(tmp_path, 'artifact = "1/graph.onnx"\n'))
    assert config.artifact_path == "1/graph.onnx"


def test_a_single_backend_string_becomes_a_tuple(tmp_path):
    assert load_model_toml("m", write_toml(tmp_path, 'backends = "reference"\n')).backends == ("reference",)


def test_invalid_toml_names_the_file(tmp_path):
    with pytest.raises(InvalidArgument, match=r"model 'm': model.toml is not valid TOML"):
        load_model_toml("m", write_toml(tmp_path, "format = \n"))


# -- errors from config_from_dict ---------------------------------------------------


def test_unknown_keys_are_refused_and_known_keys_listed():
    with pytest.raises(InvalidArgument) as info:
        config_from_dict("m", {"formatt": "onnx", "warmup": True})
    message = str(info.value)
    assert "unknown config keys ['formatt']" in message
    assert "'format'" in message and "'batching'" in message  # the known keys are listed


def test_unknown_key_in_a_toml_file(tmp_path):
    with pytest.raises(InvalidArgument, match="unknown config keys"):
        load_model_toml("m", write_toml(tmp_path, "max_batch_size = 8\n"))


@pytest.mark.parametrize(("raw", "fragment"), [
    ({"warmup": "yes"}, "config key warmup must be true or false, got 'yes'"),
    ({"pinned": 1}, "config key pinned must be true or false"),
    ({"format": "tensorflow"}, "config key format must be one of onnx, gguf"),
    ({"backends": [1, 2]}, "config key backends must be a list of strings"),
    ({"artifact": 5}, "config key artifact must be a string"),
    ({"batching": {"max_batch_size": -1}}, "config key batching.max_batch_size must be an integer >= 0, got -1"),
    ({"batching": {"max_batch_size": True}}, "config key batching.max_batch_size must be an integer"),
    ({"batching": {"max_batch_size": "8"}}, "batching.max_batch_size must be an integer"),
    ({"batching": {"max_queue_size": 0}}, "batching.max_queue_size must be an integer >= 1"),
    ({"batching": 8}, "config key batching must be a table"),
    ({"memory_estimate": "lots"}, "config key memory_estimate must be a size such as 120MiB"),
    ({"memory_estimate": -5}, "config key memory_estimate must be a size"),
    ({"text": {"max_length": 0}}, "config key text.max_length must be an integer >= 1"),
    ({"inputs": {"name": "x"}}, "config key inputs must be a list of tensors"),
    ({"inputs": [{"datatype": "FP32"}]}, "each entry of inputs needs a string 'name'"),
    ({"outputs": [{"name": "y", "datatype": "FLOAT"}]}, "outputs tensor 'y' has datatype 'FLOAT'"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [-2]}]}, "shape must be a list of integers >= -1"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [True]}]}, "shape must be a list of integers >= -1"),
    ({"name": "other"}, "config names a different model 'other'"),
])
def test_bad_types_are_invalid_argument_naming_the_key(raw, fragment):
    with pytest.raises(InvalidArgument) as info:
        config_from_dict("m", raw)
    assert fragment in str(info.value)
    assert str(info.value).startswith("model 'm'")


@pytest.mark.parametrize("artifact", ["../x", "/etc/passwd", "a/../../b", "sub/../../escape.onnx", "\\share\\x",
                                      "a\x00b"])
def test_artifact_paths_may_not_leave_the_model_folder(artifact):
    with pytest.raises(InvalidArgument) as info:
        config_from_dict("m", {"artifact": artifact})
    assert "must stay inside the model folder" in str(info.value)
    assert repr(artifact) in str(info.value)


def test_tokenizer_path_may_not_leave_the_model_folder():
    with pytest.raises(InvalidArgument, match="must stay inside the model folder"):
        config_from_dict("m", {"text": {"tokenizer": "../../secret.json"}})


@pytest.mark.parametrize("artifact", ["model.onnx", "1/model.onnx", "sub/dir/x.onnx", "a..b.onnx"])
def test_artifact_paths_inside_the_folder_are_accepted(artifact):
    assert config_from_dict("m", {"artifact": artifact}).artifact == artifact


def test_config_is_frozen():
    config = config_from_dict("m", {})
    with pytest.raises(AttributeError):
        config.max_batch_size = 3  # type: ignore[misc]


# -- Triton JSON ----------------------------------------------------------------------

TRITON_JSON = {
    "name": "densenet",
    "platform": "onnxruntime_onnx",
    "max_batch_size": 8,
    "dynamic_batching": {"max_queue_delay_microseconds": 100, "preferred_batch_size": [4, 8]},
    "input": [{"name": "data_0", "data_type": "TYPE_FP32", "dims": [3, 224, 224]},
              {"name": "label", "data_type": "TYPE_STRING", "dims": [1]}],
    "output": [{"name": "prob", "data_type": "TYPE_FP32", "dims": ["1000"]}],
    "instance_group": [{"kind": "KIND_CPU", "count": 1}],
}


def test_triton_json_maps_onto_model_config():
    config = config_from_json("densenet", json.dumps(TRITON_JSON))
    assert config.format is ModelFormat.ONNX
    assert config.max_batch_size == 8
    assert config.max_queue_delay_us == 100
    assert config.inputs == (
        TensorSpec("data_0", "FP32", (-1, 3, 224, 224)),
        TensorSpec("label", "BYTES", (-1, 1)),
    )
    # 64-bit dims arrive as strings in protobuf JSON
    assert config.outputs == (TensorSpec("prob", "FP32", (-1, 1000)),)


def test_triton_json_without_batching_has_no_leading_batch_dimension():
    raw = {"backend": "onnxruntime", "max_batch_size": 0,
           "input": [{"name": "x", "data_type": "TYPE_INT64", "dims": [2, 3]}],
           "output": [{"name": "y", "data_type": "TYPE_FP16", "dims": [-1]}]}
    config = config_from_json("m", json.dumps(raw))
    assert config.max_batch_size == 0 and not config.is_batched
    assert config.inputs == (TensorSpec("x", "INT64", (2, 3)),)
    assert config.outputs == (TensorSpec("y", "FP16", (-1,)),)


def test_triton_json_may_mix_native_keys():
    raw = {"platform": "onnxruntime_onnx", "max_batch_size": 4, "warmup": True, "memory_estimate": "1MiB",
           "batching": {"max_queue_size": 7}}
    config = config_from_json("m", json.dumps(raw))
    assert (config.max_batch_size, config.max_queue_size, config.warmup) == (4, 7, True)
    assert config.memory_estimate == 1024**2


def test_triton_json_empty_object_gives_defaults():
    assert config_from_json("m", "{}") == ModelConfig(name="m")


def test_invalid_json_is_invalid_argument():
    with pytest.raises(InvalidArgument, match="inline config is not valid JSON"):
        config_from_json("m", "{not json")


def test_json_that_is_not_an_object_is_invalid_argument():
    with pytest.raises(InvalidArgument, match="must be a JSON object"):
        config_from_json("m", "[1, 2]")


def test_unserved_triton_platform_is_refused_with_alternatives():
    with pytest.raises(InvalidArgument) as info:
        config_from_json("m", json.dumps({"platform": "tensorflow_savedmodel"}))
    assert "'tensorflow_savedmodel'" in str(info.value)
    assert "onnxruntime_onnx" in str(info.value)


def test_triton_bad_datatype_names_the_tensor():
    raw = {"max_batch_size": 2, "input": [{"name": "x", "data_type": "TYPE_FLOAT", "dims": [1]}]}
    with pytest.raises(InvalidArgument, match="inputs tensor 'x' has datatype 'FLOAT'"):
        config_from_json("m", json.dumps(raw))


def test_triton_bad_max_batch_size_type():
    with pytest.raises(InvalidArgument, match="batching.max_batch_size must be an integer"):
        config_from_json("m", json.dumps({"max_batch_size": "eight"}))


def test_triton_json_name_mismatch_is_refused():
    with pytest.raises(InvalidArgument, match="config names a different model"):
        config_from_json("m", json.dumps({"name": "other"}))


@pytest.mark.parametrize("artifact", ["../x", "/etc/passwd"])
def test_triton_json_artifact_escape_is_refused(artifact):
    with pytest.raises(InvalidArgument, match="must stay inside the model folder"):
        config_from_json("m", json.dumps({"artifact": artifact}))


def test_native_unknown_key_in_json_is_dropped_like_other_triton_keys():
    # Triton configs carry many keys modeld ignores; the JSON path accepts them.
    config = config_from_json("m", json.dumps({"optimization": {"x": 1}, "version_policy": {}}))
    assert config == ModelConfig(name="m")


@pytest.mark.parametrize("raw", [{"onnx": 5}, {"reference": "fast"}])
def test_backend_options_must_be_tables(raw):
    with pytest.raises(InvalidArgument):
        config_from_dict("m", raw)


@pytest.mark.parametrize("text", ['{"input": 5}', '{"output": null}', '{"batching": 5}',
                                  '{"input": [{"name": "x", "data_type": "TYPE_FP32", "dims": 3}]}'])
def test_triton_json_bad_container_types_are_invalid_argument(text):
    with pytest.raises(InvalidArgument):
        config_from_json("m", text)


def test_triton_string_dims_are_refused():
    with pytest.raises(InvalidArgument):
        config_from_json("m", '{"input": [{"name": "x", "data_type": "TYPE_FP32", "dims": "16"}]}')


# -- model names ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["minilm", "softcap_demo", "a", "A.b-c_1", "9lives", "x" * 128])
def test_valid_model_names(name):
    assert validate_model_name(name) == name


@pytest.mark.parametrize("name", ["../x", "a/b", "", "a\x00b", "..", "a..b", ".hidden", "-x", "a b", "a\\b",
                                  "x" * 129, "/abs"])
def test_invalid_model_names(name):
    with pytest.raises(InvalidArgument) as info:
        validate_model_name(name)
    assert repr(name) in str(info.value)
    assert "letters, digits" in str(info.value)


def test_invalid_model_name_is_checked_by_config_parsing():
    with pytest.raises(InvalidArgument, match="invalid model name"):
        config_from_dict("../x", {})
    with pytest.raises(InvalidArgument, match="invalid model name"):
        config_from_json("a/b", "{}")


def test_model_name_with_trailing_newline_is_refused():
    with pytest.raises(InvalidArgument):
        validate_model_name("abc\n")
