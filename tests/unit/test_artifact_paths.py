"""The paths a model's own files name, checked before any runtime reads
them: ONNX external data anywhere in a graph (backends/onnx/external_data.py)
and genai_config.json's file keys and code-loading keys
(backends/onnx_genai/config_check.py). No runtime is started."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from onnx import TensorProto, helper

from daemon import MODELS
from modeld.backends.artifact_paths import ArtifactPathError
from modeld.backends.errors import LoadFailed
from modeld.backends.onnx.external_data import check_model_file
from modeld.backends.onnx_genai.config_check import GenaiConfigRefused, check_genai_config


def _external(name: str, location: str) -> TensorProto:
    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[4], data_location=TensorProto.EXTERNAL)
    tensor.external_data.add(key="location", value=location)
    return tensor


def _graph_with_constant_in_a_branch(location: str) -> bytes:
    """An If whose then-branch holds a Constant node with external data."""
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    constant = helper.make_node("Constant", [], ["y"], value=_external("c", location))
    branch = helper.make_graph([constant], "branch", [], [out])
    graph = helper.make_graph([helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)],
                              "g", [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])], [out])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_external_data_is_found_in_subgraphs_and_attributes_too(tmp_path):
    (tmp_path / "model.onnx").write_bytes(_graph_with_constant_in_a_branch("../../etc/passwd"))
    with pytest.raises(ArtifactPathError, match="tensor 'c' external data location '../../etc/passwd' leaves"):
        check_model_file("m", tmp_path, tmp_path / "model.onnx")
    (tmp_path / "model.onnx").write_bytes(_graph_with_constant_in_a_branch("weights/c.bin"))
    assert check_model_file("m", tmp_path, tmp_path / "model.onnx") == [(tmp_path / "weights" / "c.bin").resolve()]


def test_a_file_that_is_no_graph_fails_the_load_by_name(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"\x08\x01junk" * 10)
    with pytest.raises(LoadFailed, match="cannot read 'model.onnx' as an ONNX model") as err:
        check_model_file("m", tmp_path, tmp_path / "model.onnx")
    assert str(tmp_path) not in str(err.value)


GENAI_FOLDER = MODELS / "smollm2-onnx" / "fp32"


@pytest.fixture(scope="module")
def genai() -> dict:
    path = GENAI_FOLDER / "genai_config.json"
    if not path.is_file():
        pytest.skip("the onnx-genai model is not built (make models)")
    return json.loads(path.read_text())


def test_the_model_builders_config_passes(genai):
    check_genai_config("smollm2-onnx", GENAI_FOLDER, genai, frozenset())


def _session_options(genai: dict) -> dict:
    return genai["model"]["decoder"]["session_options"]


@pytest.mark.parametrize("key, value", [
    ("custom_ops_library", "libops.so"),
    ("enable_profiling", "/tmp/profile"),
    ("session.optimized_model_filepath", "/tmp/model.onnx"),
    ("ep.context_file_path", "ctx.onnx"),
])
def test_session_options_that_load_or_write_are_refused_by_name(genai, key, value):
    config = copy.deepcopy(genai)
    _session_options(config)[key] = value
    with pytest.raises(GenaiConfigRefused, match=f"key model.decoder.session_options.{key} can load code"):
        check_genai_config("m", GENAI_FOLDER, config, frozenset())
    check_genai_config("m", GENAI_FOLDER, config, frozenset({key}))  # the operator allowed it


def test_provider_options_naming_a_library_are_refused_and_tuning_ones_pass(genai):
    config = copy.deepcopy(genai)
    _session_options(config)["provider_options"] = [{"cuda": {"enable_cuda_graph": "0"}}]
    check_genai_config("m", GENAI_FOLDER, config, frozenset())
    _session_options(config)["provider_options"] = [{"qnn": {"backend_path": "libQnnHtp.so"}}]
    with pytest.raises(GenaiConfigRefused, match="provider_options.qnn.backend_path"):
        check_genai_config("m", GENAI_FOLDER, config, frozenset())


@pytest.mark.parametrize("where, value", [
    (("model", "decoder", "filename"), "../../minilm/model.onnx"),
    (("model", "tokenizer_dir"), "/etc"),
    (("model", "embedding", "filename"), "/srv/embed.onnx"),
])
def test_file_keys_must_stay_in_the_folder(genai, where, value):
    config = copy.deepcopy(genai)
    table = config
    for key in where[:-1]:
        table = table.setdefault(key, {})
    table[where[-1]] = value
    with pytest.raises(ArtifactPathError, match=f"genai_config.json key {'.'.join(where)}") as err:
        check_genai_config("m", GENAI_FOLDER, config, frozenset())
    assert "/srv" not in str(err.value) and str(Path("/etc")) + "'" not in str(err.value)


def test_a_config_nested_past_reason_is_refused(genai):
    config: dict = {}
    table = config
    for _ in range(40):
        table = table.setdefault("x", {})
    with pytest.raises(GenaiConfigRefused, match="nests deeper"):
        check_genai_config("m", GENAI_FOLDER, config, frozenset())


def test_the_scan_finds_what_onnx_itself_finds_in_a_function_and_training_graph(tmp_path):
    from onnx import FunctionProto, TrainingInfoProto

    model = helper.make_model(helper.make_graph([], "g", [], []), opset_imports=[helper.make_opsetid("", 17)])
    function = FunctionProto(name="f", domain="d")
    function.node.append(helper.make_node("Constant", [], ["y"], value=_external("in_function", "../f.bin")))
    model.functions.append(function)
    training = TrainingInfoProto()
    training.initialization.CopyFrom(helper.make_graph([], "init", [], [], initializer=[_external("t", "t.bin")]))
    model.training_info.append(training)
    (tmp_path / "model.onnx").write_bytes(model.SerializeToString())
    with pytest.raises(ArtifactPathError, match="tensor 'in_function' external data location '../f.bin'"):
        check_model_file("m", tmp_path, tmp_path / "model.onnx")


def test_a_tokenizer_config_naming_a_file_outside_is_refused(tmp_path):
    from modeld.backends.artifact_paths import check_tokenizer_config

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_file": "/etc/passwd", "model_max_length": 8}))
    with pytest.raises(ArtifactPathError, match="tokenizer_config.json key tokenizer_file is an absolute path"):
        check_tokenizer_config("m", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_file": "tokenizer.json", "x_file": None}))
    check_tokenizer_config("m", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    check_tokenizer_config("m", tmp_path)  # transformers reports an unreadable config itself
