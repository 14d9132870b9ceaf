"""Model configs: model.toml and Triton-style JSON into one frozen ModelConfig."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from modeld.backends.errors import ErrorKind, InvalidArgument
from modeld.backends.model_config import (
    ModelConfig, ModelFormat, TensorSpec, TextSpec, config_from_dict, config_from_json, load_model_toml,
    validate_model_name,
)
from modeld.backends.options import BackendOptions, LlamaCppOptions, OnnxOptions, TorchOptions

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
    assert config.backend_options == BackendOptions(onnx=OnnxOptions(intra_op_threads=2))
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
    smollm2 = load_model_toml("smollm2", root / "smollm2" / "model.toml")
    assert smollm2.backend_options.llamacpp.draft_model == "smollm2-draft"
    assert smollm2.backend_options.llamacpp.n_ctx == 16384
    torch_llm = load_model_toml("smollm2-torch", root / "smollm2-torch" / "model.toml")
    assert torch_llm.backend_options.torch.compile is True and torch_llm.backend_options.torch.dtype == "float32"
    assert load_model_toml("smollm2-draft", root / "smollm2-draft" / "model.toml").backend_options.llamacpp.n_slots == 4


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
    config = config_from_json("m", json.dumps({"optimization": {"x": 1}, "instance_group": [{"kind": "KIND_CPU"}]}))
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


# -- backend options ---------------------------------------------------------------------


def test_a_model_without_option_tables_gets_every_backend_default():
    options = config_from_dict("m", {}).backend_options
    assert options == BackendOptions()
    assert (options.onnx.intra_op_threads, options.onnx.inter_op_threads, options.onnx.allow_spinning) == (0, 0, 1)
    llama = options.llamacpp
    assert (llama.n_ctx, llama.n_slots, llama.context_length, llama.n_threads, llama.max_step_tokens,
            llama.max_waiting, llama.draft_model, llama.draft_path) == (32768, 8, 4096, 2, 2048, 256, "", "")
    torch = options.torch
    assert (torch.block_size, torch.num_blocks, torch.context_length, torch.max_running, torch.max_step_tokens,
            torch.max_waiting, torch.dtype, torch.threads, torch.device, torch.compile, torch.draft_model) == (
        16, 1024, 2048, 16, 512, 256, "float32", 0, "auto", True, "")


def test_one_table_keeps_the_other_backends_defaults():
    options = config_from_dict("m", {"torch": {"dtype": "bfloat16", "device": "cuda:1"}}).backend_options
    assert options.torch == TorchOptions(dtype="bfloat16", device="cuda:1")
    assert options.llamacpp == LlamaCppOptions()


@pytest.mark.parametrize(("section", "key", "value", "accepted"), [
    ("torch", "num_blocks", 0, "an integer >= 1"),
    ("torch", "block_size", True, "an integer >= 1"),
    ("torch", "threads", -1, "an integer >= 0"),
    ("torch", "dtype", "float64", "one of float32, bfloat16, float16"),
    ("torch", "compile", "yes", "true or false"),
    ("torch", "device", "gpu", "one of auto, cpu, cuda, cuda:<index>, mps"),
    ("torch", "max_waiting", 0, "an integer >= 1"),
    ("llamacpp", "n_ctx", "4096", "an integer >= 1"),
    ("llamacpp", "n_slots", 0, "an integer >= 1"),
    ("llamacpp", "n_threads", 2.5, "an integer >= 1"),
    ("llamacpp", "draft_model", "../x", "the name of another model"),
    ("llamacpp", "draft_model", 7, "the name of another model"),
    ("onnx", "allow_spinning", 2, "0 or 1"),
    ("onnx", "allow_spinning", True, "0 or 1"),
    ("onnx", "intra_op_threads", -1, "an integer >= 0"),
])
def test_a_bad_option_value_names_model_key_value_and_what_is_accepted(section, key, value, accepted):
    with pytest.raises(InvalidArgument) as info:
        config_from_dict("m", {section: {key: value}})
    message = str(info.value)
    assert "model 'm'" in message
    assert f"{section}.{key}" in message
    assert repr(value) in message
    assert accepted in message
    assert info.value.kind is ErrorKind.INVALID_ARGUMENT


def test_an_unknown_option_is_refused_with_the_known_keys():
    with pytest.raises(InvalidArgument) as info:
        config_from_dict("m", {"torch": {"num_block": 64}})
    message = str(info.value)
    assert "torch.num_block" in message
    assert "known keys: admission, admission_batch, admission_window_ms, block_size, compile, context_length, device" in message
    assert "draft_path" not in message  # the daemon's own key is not offered


def test_the_reference_backend_takes_no_options():
    with pytest.raises(InvalidArgument, match=r"reference\.threads; the reference backend takes no options"):
        config_from_dict("m", {"reference": {"threads": 2}})


@pytest.mark.parametrize("section", ["torch", "llamacpp"])
def test_draft_path_is_the_daemons_to_set(section):
    with pytest.raises(InvalidArgument, match=rf"{section}\.draft_path is set by the daemon"):
        config_from_dict("m", {section: {"draft_path": "/etc/passwd"}})


def test_a_model_cannot_draft_for_itself():
    with pytest.raises(InvalidArgument, match=r"llamacpp\.draft_model must name another model"):
        config_from_dict("m", {"llamacpp": {"draft_model": "m"}})


def test_llamacpp_needs_a_kv_cell_per_slot():
    with pytest.raises(InvalidArgument, match=r"llamacpp\.n_ctx must be at least n_slots \(8\), got 4"):
        config_from_dict("m", {"llamacpp": {"n_ctx": 4}})


def test_inline_json_options_are_checked_the_same_way():
    with pytest.raises(InvalidArgument, match=r"model 'm': config key torch\.dtype must be one of"):
        config_from_json("m", json.dumps({"format": "gguf", "torch": {"dtype": "int8"}}))
    assert config_from_json("m", json.dumps({"onnx": {"intra_op_threads": 3}})).backend_options.onnx.intra_op_threads == 3


def test_options_cannot_be_built_invalid_nor_changed():
    # an invalid options object cannot exist, so backends never re-check
    with pytest.raises(InvalidArgument, match=r"torch\.compile must be true or false"):
        dataclasses.replace(TorchOptions(), compile="yes")
    with pytest.raises(dataclasses.FrozenInstanceError):
        TorchOptions().num_blocks = 3  # type: ignore[misc]


def test_llamacpp_estimate_reads_the_typed_n_ctx(tmp_path):
    from modeld.backends.llamacpp.backend import LlamaCppBackend

    (tmp_path / "model.gguf").write_bytes(b"x" * 100)
    config = config_from_dict("m", {"format": "gguf", "llamacpp": {"n_ctx": 1024}})
    assert LlamaCppBackend().estimate_bytes(config, tmp_path) == 100 + 1024 * 32 * 1024


async def test_a_load_with_a_bad_option_comes_back_invalid_argument(tmp_path):
    import grpc

    from modeld.backends.registry import BackendRegistry
    from modeld.server.engine import Engine
    from modeld.server.memory import MemoryManager
    from modeld.server.metrics import Metrics
    from modeld.server.repository import ModelRepository
    from modeld.server.services.status import STATUS_BY_KIND

    (tmp_path / "repo" / "llm").mkdir(parents=True)
    (tmp_path / "repo" / "llm" / "model.toml").write_text('format = "gguf"\n[torch]\nnum_blocks = 0\n')
    engine = Engine(ModelRepository(tmp_path / "repo", tmp_path / "inline"), BackendRegistry(),
                    MemoryManager(1 << 30), Metrics())
    with pytest.raises(InvalidArgument, match=r"model 'llm': config key torch\.num_blocks") as info:
        await engine.load("llm")
    assert STATUS_BY_KIND[info.value.kind] is grpc.StatusCode.INVALID_ARGUMENT
    # RepositoryModelLoad with an inline config parses it before the engine loads
    with pytest.raises(InvalidArgument, match=r"config key llamacpp\.max_waiting must be an integer >= 1, got 0"):
        engine.repository.add_inline("llm", json.dumps({"format": "gguf", "llamacpp": {"max_waiting": 0}}), {})
