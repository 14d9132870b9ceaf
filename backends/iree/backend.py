"""IREE backend: ONNX graphs compiled ahead of time for this CPU.

`can_serve` refuses, with the reason, models IREE could never import
(operator domains outside the standard ONNX set) and models a load has
already failed to compile. `load` takes the compiled module from the daemon's own
cache (cache.py) or compiles it (compiler.py); a graph IREE
rejects fails the load, so the engine counts a fallback and tries the next
backend, and the refusal is kept in the cache for later loads. Modules
run on iree.runtime's `local-task` driver, one worker per core, shared by
every model this backend holds.
"""

from __future__ import annotations

import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
import structlog

from modeld.backends.artifact_paths import ArtifactPathError
from modeld.backends.base import Backend, Capability, Verdict
from modeld.backends.errors import BackendFailure, InvalidArgument, LoadFailed
from modeld.backends.iree.cache import CacheEntry, ModuleCache
from modeld.backends.iree.compiler import CompileFailed, CompileRefused, compile_onnx, compiler_path, toolchain
from modeld.backends.iree.graph import STANDARD_DOMAINS, GraphInfo, declared_domains, read_graph
from modeld.backends.model_config import ModelConfig, ModelFormat
from modeld.backends.tensor_model import GraphModel, process_rss

log = structlog.get_logger("modeld.iree")


@dataclass(frozen=True)
class ModuleBuild:
    """How a load got its module: what the benchmark and the logs report."""

    path: Path
    is_cached: bool
    compile_s: float  # 0 when the cache had it


class IreeBackend(Backend):
    name = "iree"
    # the design's order for ONNX graphs is ONNX Runtime, then this compiled
    # path, then the pure-Python reference: here higher runs first, so it sits
    # between onnx (100) and reference (0), and a model prefers it only by
    # naming it (backends = ["iree", "onnx"])
    priority = 90
    capabilities = frozenset({Capability.TENSOR_INFERENCE, Capability.DYNAMIC_BATCHING})

    def __init__(self, cache: ModuleCache | None = None) -> None:
        self.cache = cache or ModuleCache()
        # (path, size, mtime) of a model file -> why IREE cannot compile it;
        # can_serve runs on the event loop, so it looks up files, never hashes them
        self._refused: dict[tuple, str] = {}
        self._runtime = None  # iree.runtime.Config: one device and thread pool for all models
        self._lock = threading.Lock()

    def availability(self) -> Verdict:
        try:
            import iree.runtime  # noqa: F401
        except ImportError as exc:
            return Verdict.no(f"iree-base-runtime is not installed: {exc}")
        if compiler_path() is None:
            return Verdict.no("iree-base-compiler is not installed (its iree-compile is not found)")
        return Verdict.yes()

    def can_serve(self, config: ModelConfig, model_dir: Path) -> Verdict:
        """Cheap: the declared operator domains and a refusal this process
        saw. A refusal kept on disk by an earlier process is found by the
        next load, which fails at once (counted) and is remembered here."""
        verdict = self._serves_file(config, model_dir, ModelFormat.ONNX)
        if not verdict.ok:
            return verdict
        path = model_dir / config.artifact_path
        try:
            foreign = sorted(declared_domains(path) - STANDARD_DOMAINS)
        except (OSError, ValueError) as exc:
            return Verdict.no(f"cannot read {config.artifact_path!r} as an ONNX model: {exc}")
        if foreign:
            return Verdict.no(f"IREE imports only standard ONNX operators; the model declares operator "
                              f"domain {', '.join(foreign)}")
        reason = self._refused.get(_stamp(path))
        if reason is not None:
            return Verdict.no(reason)
        return Verdict.yes()

    def load(self, config: ModelConfig, model_dir: Path) -> IreeModel:
        path = model_dir / config.artifact_path
        try:
            graph = read_graph(path, config.name)
        except ArtifactPathError:
            raise
        except Exception as exc:  # onnx raises DecodeError and friends
            raise LoadFailed(f"cannot read {config.artifact_path!r} as an ONNX graph: {_first_line(exc)}") from exc
        if graph.foreign_ops:
            self._refuse(path, "IREE imports only standard ONNX operators; the graph uses "
                               + ", ".join(graph.foreign_ops))
        try:
            entry = self.cache.entry(list(graph.files), toolchain(), config.policy.iree_cache_dir)
        except (CompileFailed, OSError, subprocess.SubprocessError) as exc:
            raise LoadFailed(f"IREE's compiler or the model's files cannot be used here: {exc}") from None
        build = self._build(config, path, entry)
        started = time.perf_counter()
        model = IreeModel(config, model_dir, graph, build, self._device())
        log.info("iree_module_loaded", model=config.name, cached=build.is_cached,
                 compile_s=round(build.compile_s, 3), load_s=round(time.perf_counter() - started, 3),
                 module=str(build.path))
        return model

    def _build(self, config: ModelConfig, artifact: Path, entry: CacheEntry) -> ModuleBuild:
        reason = self.cache.refusal(entry)
        if reason is not None:
            self._refuse(artifact, f"IREE could not compile {config.artifact_path!r} at an earlier load: {reason}")
        if self.cache.find(entry):
            return ModuleBuild(entry.module, True, 0.0)
        started = time.perf_counter()
        try:
            compile_onnx(artifact, entry.module)
        except CompileRefused as exc:
            self.cache.refuse(entry, str(exc))
            self._refuse(artifact, f"IREE cannot compile {config.artifact_path!r}: {exc}")
        except (CompileFailed, OSError) as exc:  # not remembered: a later load may succeed
            raise LoadFailed(f"compiling {config.artifact_path!r} with IREE failed: {exc}") from None
        return ModuleBuild(entry.module, False, time.perf_counter() - started)

    def _refuse(self, artifact: Path, reason: str) -> NoReturn:
        self._refused[_stamp(artifact)] = reason
        raise LoadFailed(reason)

    def _device(self):
        with self._lock:
            if self._runtime is None:
                import iree.runtime as rt

                self._runtime = rt.Config("local-task")
            return self._runtime


class IreeModel(GraphModel):
    def __init__(self, config: ModelConfig, model_dir: Path, graph: GraphInfo, build: ModuleBuild, runtime) -> None:
        import iree.runtime as rt

        rss_before = process_rss()
        try:
            module = rt.VmModule.mmap(runtime.vm_instance, str(build.path))
            # creating the context runs the module's initializer, which moves
            # the weights into device buffers: the resident growth below
            self._context = rt.SystemContext(config=runtime, vm_modules=(module,))
            self._function = self._context.modules[module.name][_entry_point(module)]
        except (RuntimeError, ValueError, KeyError) as exc:
            raise LoadFailed(f"iree.runtime cannot load the module compiled from {config.artifact_path!r}: "
                             f"{_first_line(exc)}") from exc
        # The module of a real model carries its weights (minilm: 90 MB of
        # graph, 90 MB of module), so the graph's size is the floor as for
        # onnx; a toy graph whose weights fold away is over-counted, never under.
        self.nbytes = max((model_dir / config.artifact_path).stat().st_size, build.path.stat().st_size,
                          process_rss() - rss_before)
        self.build = build
        self.symbols = graph.symbols
        super().__init__(config, model_dir, graph.inputs, graph.outputs)

    def _run(self, feeds: dict[str, np.ndarray], output_names: tuple[str, ...]) -> dict[str, np.ndarray]:
        self._check_symbols(feeds)
        args = [np.ascontiguousarray(feeds[spec.name]) for spec in self.graph_inputs]
        try:
            results = self._function(*args)
        except ValueError as exc:  # iree.runtime reports every failed invocation as one
            if "INVALID_ARGUMENT" in str(exc):
                raise InvalidArgument(f"the model rejected the input: {_first_line(exc)}") from exc
            raise BackendFailure(f"iree.runtime failed while running: {_first_line(exc)}") from exc
        except Exception as exc:
            raise BackendFailure(f"iree.runtime failed while running: {_first_line(exc)}") from exc
        if len(self.outputs) == 1:
            results = (results,)
        by_name = dict(zip((spec.name for spec in self.outputs), results))
        return {name: by_name[name].to_host() for name in output_names}

    def _check_symbols(self, feeds: dict[str, np.ndarray]) -> None:
        """Inputs that share a named dimension must agree on it. onnxruntime
        checks this in its kernels; a compiled module trusts the shapes it is
        given and would read past a shorter buffer."""
        for symbol, uses in self.symbols.items():
            sizes = {name: feeds[name].shape[axis] for name, axis in uses
                     if name in feeds and feeds[name].ndim > axis}
            if len(set(sizes.values())) > 1:
                raise InvalidArgument(f"inputs {sorted(sizes)} share dimension {symbol!r} but have sizes {sizes}")

    def unload(self) -> None:
        self._function = None
        self._context = None


def _stamp(path: Path) -> tuple:
    stat = path.stat()
    return str(path), stat.st_size, stat.st_mtime_ns


def _entry_point(module) -> str:
    """The graph's function: the importer names it after the graph, next to
    an `$async` twin and the module's `__init`."""
    names = [n for n in module.function_names if not n.startswith("__") and not n.endswith("$async")]
    if len(names) != 1:
        raise KeyError(f"expected one entry point in the module, found {names}")
    return names[0]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
