"""ONNX Runtime backend: the fast path for tensor models.

Uses the CPU execution provider, and the CUDA or TensorRT providers first
when the installed onnxruntime build has them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from modeld.backends.artifact_paths import scrub_paths
from modeld.backends.base import Backend, Capability, Verdict
from modeld.backends.dtypes import DATATYPE_BY_ORT, shape_from_dims
from modeld.backends.errors import BackendFailure, InvalidArgument, LoadFailed
from modeld.backends.model_config import ModelConfig, ModelFormat, TensorSpec
from modeld.backends.onnx.external_data import check_model_file
from modeld.backends.tensor_model import GraphModel, process_rss

_PREFERRED_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")


class OnnxBackend(Backend):
    name = "onnx"
    priority = 100
    capabilities = frozenset({Capability.TENSOR_INFERENCE, Capability.DYNAMIC_BATCHING})

    def availability(self) -> Verdict:
        try:
            import onnxruntime  # noqa: F401
        except ImportError as exc:
            return Verdict.no(f"onnxruntime is not installed: {exc}")
        return Verdict.yes()

    def providers(self) -> list[str]:
        import onnxruntime as ort

        available = set(ort.get_available_providers())
        return [p for p in _PREFERRED_PROVIDERS if p in available]

    def can_serve(self, config: ModelConfig, model_dir: Path) -> Verdict:
        return self._serves_file(config, model_dir, ModelFormat.ONNX)

    def load(self, config: ModelConfig, model_dir: Path) -> OnnxModel:
        return OnnxModel(config, model_dir, self.providers())


class OnnxModel(GraphModel):
    def __init__(self, config: ModelConfig, model_dir: Path, providers: list[str]) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        opts = config.backend_options.onnx
        options.intra_op_num_threads = opts.intra_op_threads
        options.inter_op_num_threads = opts.inter_op_threads
        options.log_severity_level = 3
        # Spinning worker threads pick up the next parallel section sooner
        # (measured here: minilm p50 5.9 ms spinning, 8.2 ms not) at the cost
        # of CPU; `allow_spinning = 0` under [onnx] trades back.
        options.add_session_config_entry("session.intra_op.allow_spinning", str(opts.allow_spinning))
        # ...but only within a run: a worker still spinning after the run has
        # returned holds a core while the daemon answers (gRPC, the event loop,
        # and on one host the client itself), and on a 2-core machine that
        # doubled the overhead around a minilm request (p50 4.5 ms -> 2.5 ms
        # with this, under load). The next run wakes the workers, once.
        options.add_session_config_entry("session.force_spinning_stop", "1")
        # The CPU arena grows to the largest batch it has run and keeps that
        # memory unless asked to shrink after each run: a 10-minute soak
        # left the daemon at 2.1 GB for a 90 MB model. Shrinking frees the
        # chunks the run no longer uses; the next large batch asks again.
        self._run_options = ort.RunOptions()
        if opts.arena_shrinkage:
            self._run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        path = model_dir / config.artifact_path
        # onnxruntime is handed the graph only once every external data
        # location in it is known to stay inside the folder
        check_model_file(config.name, path.parent, path)
        rss_before = process_rss()
        try:
            self._session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph/...
            reason = scrub_paths(_first_line(exc), (model_dir,))
            raise LoadFailed(f"onnxruntime cannot load {config.artifact_path!r}: {reason}") from exc
        # Weights are at least the file; the session's arenas and pre-packed
        # weights show up as resident growth during the load (loads are
        # serialised by the engine, so the growth is this model's).
        self.nbytes = max(path.stat().st_size, process_rss() - rss_before)
        self.providers = tuple(self._session.get_providers())
        try:
            graph_in = tuple(_spec(a) for a in self._session.get_inputs())
            graph_out = tuple(_spec(a) for a in self._session.get_outputs())
        except UnicodeDecodeError as exc:
            # onnxruntime hands a graph's names and symbolic dimensions back as
            # str: a graph whose bytes there are not UTF-8 loads, but cannot be described
            self._session = None
            raise LoadFailed(f"{config.artifact_path!r} names an input, output or dimension in bytes that are "
                             f"not UTF-8 ({exc.reason} at byte {exc.start}); rename it in the graph") from exc
        super().__init__(config, model_dir, graph_in, graph_out)

    def _run(self, feeds: dict[str, np.ndarray], output_names: tuple[str, ...]) -> dict[str, np.ndarray]:
        import onnxruntime as ort

        try:
            results = self._session.run(list(output_names), feeds, self._run_options)
        except (ort.capi.onnxruntime_pybind11_state.InvalidArgument, ort.capi.onnxruntime_pybind11_state.InvalidGraph) as exc:
            raise InvalidArgument(f"the model rejected the input: {scrub_paths(_first_line(exc))}") from exc
        except Exception as exc:
            raise BackendFailure(f"onnxruntime failed while running: {scrub_paths(_first_line(exc))}") from exc
        return dict(zip(output_names, results))

    def unload(self) -> None:
        self._session = None


def _spec(arg) -> TensorSpec:
    return TensorSpec(arg.name, DATATYPE_BY_ORT.get(arg.type, arg.type), shape_from_dims(list(arg.shape)))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
