"""The iree backend's bookkeeping, without compiling anything: reading a
graph, the cache key and its refusals, and the reasons users see.
(tests/integration/test_iree.py compiles and runs; the conformance suite
holds its capability row.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from onnx import TensorProto, helper

import onnx_fixtures
from modeld.backends.iree import backend as iree_backend
from modeld.backends.iree.backend import IreeBackend
from modeld.backends.iree.cache import ModuleCache
from modeld.backends.iree.compiler import Toolchain, _reason
from modeld.backends.iree.graph import read_graph
from modeld.backends.errors import LoadFailed
from modeld.backends.model_config import ModelConfig

CHAIN = Toolchain(Path("iree-compile"), "3.13.0-abcdef12", "llvm-cpu-0123456789ab")


@pytest.fixture
def no_compiler(monkeypatch):
    """The key's compiler and target, without asking iree-compile."""
    monkeypatch.setattr(iree_backend, "toolchain", lambda: CHAIN)


def _model(folder: Path, graph: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.onnx").write_bytes(graph)
    return folder


def _nested_foreign_op() -> bytes:
    """A standard If whose branch holds com.microsoft's FusedGemm."""
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    branch = helper.make_graph([helper.make_node("FusedGemm", ["x", "x"], ["y"], domain="com.microsoft")],
                               "branch", [], [out])
    graph = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)], "g",
                              [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                               helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])], [out])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return model.SerializeToString()


def test_the_graph_gives_the_signature_and_its_shared_dimensions(tmp_path):
    folder = _model(tmp_path, onnx_fixtures.add_fp32())
    graph = read_graph(folder / "model.onnx")
    assert [(t.name, t.datatype, t.shape) for t in graph.inputs] == [("x", "FP32", (-1, 4))]
    assert [(t.name, t.datatype, t.shape) for t in graph.outputs] == [("y", "FP32", (-1, 4))]
    assert graph.symbols == {}  # one input: nothing to agree with
    assert graph.foreign_ops == () and graph.files == (folder / "model.onnx",)


def test_operators_outside_the_standard_set_are_found_in_subgraphs_too(tmp_path):
    assert read_graph(_model(tmp_path / "a", onnx_fixtures.softcap()) / "model.onnx").foreign_ops == ("ai.modeld.Softcap",)
    assert read_graph(_model(tmp_path / "b", _nested_foreign_op()) / "model.onnx").foreign_ops == ("com.microsoft.FusedGemm",)


def test_can_serve_refuses_foreign_operators_without_compiling(tmp_path, no_compiler):
    folder = _model(tmp_path, onnx_fixtures.softcap())
    verdict = IreeBackend(ModuleCache(tmp_path / "fallback")).can_serve(ModelConfig("softcap"), folder)
    assert not verdict.ok and "domain ai.modeld" in verdict.reason and "standard ONNX operators" in verdict.reason
    assert not (tmp_path / "fallback").exists() or not any((tmp_path / "fallback").iterdir())


def test_can_serve_says_why_for_a_file_that_is_no_graph(tmp_path, no_compiler):
    folder = _model(tmp_path, b"not a protobuf at all")
    verdict = IreeBackend(ModuleCache(tmp_path / "fallback")).can_serve(ModelConfig("junk"), folder)
    assert not verdict.ok and "cannot read 'model.onnx' as an ONNX model" in verdict.reason


def test_the_key_follows_the_bytes_the_compiler_and_the_target(tmp_path):
    cache = ModuleCache(tmp_path / "fallback")
    folder = _model(tmp_path / "m", onnx_fixtures.double_int64())
    files = [folder / "model.onnx"]
    key = cache.entry(files, CHAIN).key
    assert key.endswith("-3.13.0-abcdef12-llvm-cpu-0123456789ab")
    assert cache.entry(files, CHAIN).module == tmp_path / "fallback" / f"{key}.vmfb"
    newer = Toolchain(CHAIN.compiler, "3.14.0-00000000", CHAIN.target)
    other_cpu = Toolchain(CHAIN.compiler, CHAIN.version, "llvm-cpu-ffffffffffff")
    assert len({key, cache.entry(files, newer).key, cache.entry(files, other_cpu).key}) == 3
    (folder / "model.onnx").write_bytes(onnx_fixtures.add_fp32())
    assert cache.entry(files, CHAIN).key != key


def test_a_refusal_outlives_the_process_and_then_answers_can_serve(tmp_path, no_compiler, monkeypatch):
    folder = _model(tmp_path, onnx_fixtures.double_int64())
    config = ModelConfig("double")
    first = IreeBackend(ModuleCache(tmp_path / "fallback"))
    first.cache.refuse(first.cache.entry([folder / "model.onnx"], CHAIN), "operator Foo is not supported")

    def compile_onnx(*args):
        raise AssertionError("a refused graph must not be compiled again")

    monkeypatch.setattr(iree_backend, "compile_onnx", compile_onnx)
    # a new backend (a restarted daemon): can_serve does not hash the file,
    # so the load finds the refusal in the cache and fails at once
    second = IreeBackend(ModuleCache(tmp_path / "fallback"))
    assert second.can_serve(config, folder).ok
    with pytest.raises(LoadFailed, match="operator Foo is not supported"):
        second.load(config, folder)
    verdict = second.can_serve(config, folder)
    assert not verdict.ok and "operator Foo is not supported" in verdict.reason and "earlier load" in verdict.reason


def test_declared_domains_are_read_without_parsing_the_graph(tmp_path):
    from modeld.backends.iree.graph import declared_domains

    model = _model(tmp_path / "ok", onnx_fixtures.softcap()) / "model.onnx"
    assert declared_domains(model) == {"", "ai.modeld"}
    truncated = _model(tmp_path / "cut", onnx_fixtures.add_fp32(1000)[:200]) / "model.onnx"
    with pytest.raises(ValueError, match="not an ONNX model"):
        declared_domains(truncated)


def test_the_same_bytes_under_another_name_find_the_module(tmp_path):
    cache = ModuleCache(tmp_path / "fallback")
    one, two = (_model(tmp_path / n, onnx_fixtures.double_int64()) for n in ("one", "two"))
    first = cache.entry([one / "model.onnx"], CHAIN)
    assert not cache.find(first)
    first.module.write_bytes(b"compiled")
    second = cache.entry([two / "model.onnx"], CHAIN)
    assert second == first and cache.find(second)


@pytest.mark.parametrize("stderr, reason", [
    ('model.mlir:4:10: error: failed to legalize operation \'torch.operator\' that was explicitly marked illegal: '
     '%1 = "torch.operator"(%arg0) <{name = "onnx.Unique"}> {torch.onnx.sorted = 1 : si64}\n'
     "    %0 = torch.operator ...\nmodel.mlir:4:10: note: see current operation: ...",
     "operator Unique is not supported (failed to legalize operation 'torch.operator' "
     "that was explicitly marked illegal)"),
    ("m.mlir:120:12: error: 'func.func' op exceeded stack allocation limit of 32768 bytes\n<pages of MLIR>",
     "'func.func' op exceeded stack allocation limit of 32768 bytes"),
    ('Traceback (most recent call last):\n  File "x.py", line 1\nonnx.onnx_cpp2py_export.checker.ValidationError: bad',
     "onnx.onnx_cpp2py_export.checker.ValidationError: bad"),
    ("", "no message"),
])
def test_the_reason_is_the_line_a_user_can_act_on(stderr, reason):
    assert _reason(stderr) == reason
