"""ONNX graph -> IREE module (.vmfb) for the host CPU, in child processes.

The importer (`iree.compiler.tools.import_onnx`, the `iree-import-onnx`
script) turns the graph into MLIR text and `iree-compile` lowers that to a
VM flatbuffer for `llvm-cpu`. Both run as subprocesses: importing
iree.compiler in the daemon would map ~90 MB of MLIR libraries into it for
good, and an importer or compiler that aborts on a graph must fail one load,
not the daemon.

Dynamic dimensions stay dynamic: IREE compiles `?` dimensions, so one module
serves every batch size the batcher forms and every padded sentence length.
Measured on minilm (2-core AVX2, batch 32 x 65 tokens, CPU time per run):
onnxruntime 1.26 s, this dynamic module 1.95 s, a module compiled for that
exact shape with data tiling 1.58 s. Static modules would need one per
(batch, sequence length) bucket, each 15-50 s of compiling and a 90 MB copy
of the weights, and every batch padded up to its bucket: more than the 20%
they save.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

# The ONNX frontend for the local CPU; `host` lets LLVM use every feature of
# this CPU, which is why the target's features are part of the cache key.
# Tried on minilm and left out: --iree-opt-level=O3 and
# --iree-llvmcpu-enable-ukernels=all fail to compile it (layer norm passes
# the stack allocation limit), --iree-opt-data-tiling fails on the pooling
# with dynamic shapes, --iree-global-opt-data-tiling compiles but its
# pack/unpack costs what the faster matmuls save.
COMPILE_FLAGS = (
    "--iree-input-type=onnx",
    "--iree-hal-target-device=local",
    "--iree-hal-local-target-device-backends=llvm-cpu",
    "--iree-llvmcpu-target-cpu=host",
)

# minilm takes ~15 s of CPU (a minute of wall time on a busy 2-core box); a
# compiler still running after this is stuck, and the load falls back.
COMPILE_TIMEOUT_S = 1800.0

_MAX_REASON = 300


class CompileRefused(Exception):
    """IREE cannot compile this graph: deterministic, so worth remembering."""


class CompileFailed(Exception):
    """The compile did not finish (timeout, crash): worth trying again later."""


@dataclass(frozen=True)
class Toolchain:
    """The compiler and target a module was built with: part of its cache key."""

    compiler: Path
    version: str  # e.g. "3.13.0rc20261016-89ece87b"
    target: str  # "llvm-cpu-<hash of CPU features and flags>"


def compiler_path() -> Path | None:
    """iree-compile as shipped in iree-base-compiler, found without importing it."""
    spec = importlib.util.find_spec("iree.compiler")
    if spec is None or not spec.submodule_search_locations:
        return None
    tool = Path(next(iter(spec.submodule_search_locations))) / "_mlir_libs" / "iree-compile"
    return tool if tool.is_file() else None


@cache
def toolchain() -> Toolchain:
    compiler = compiler_path()
    if compiler is None:
        raise CompileFailed("iree-base-compiler is not installed")
    return Toolchain(compiler, _compiler_version(compiler), f"llvm-cpu-{_target_digest()}")


def _compiler_version(compiler: Path) -> str:
    out = subprocess.run([str(compiler), "--version"], capture_output=True, text=True, timeout=60).stdout
    # "IREE compiler version 3.13.0rc20261016 @ 89ece87b89852100c0a4ac3d515e14842d090967"
    found = re.search(r"version (\S+) @ ([0-9a-f]{8})", out)
    return f"{found[1]}-{found[2]}" if found else hashlib.sha256(out.encode()).hexdigest()[:12]


def _target_digest() -> str:
    """A module compiled for `host` may use any instruction this CPU has; a
    copy of the model folder on a CPU with fewer must not reuse it."""
    digest = hashlib.sha256(" ".join((platform.machine(), _cpu_features(), *COMPILE_FLAGS)).encode())
    return digest.hexdigest()[:12]


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def compile_onnx(onnx_path: Path, out_path: Path) -> None:
    """Import and compile `onnx_path` into `out_path`, written atomically.

    Raises CompileRefused when the importer or compiler rejects the graph,
    CompileFailed when either did not run to an answer.
    """
    chain = toolchain()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # the MLIR text holds the weights in hex (minilm: 180 MB); it lives next
    # to the output so the final rename stays on one file system
    with tempfile.TemporaryDirectory(dir=out_path.parent, prefix=".compiling-") as work:
        mlir, vmfb = Path(work) / "model.mlir", Path(work) / "model.vmfb"
        _run("the ONNX importer", [sys.executable, "-m", "iree.compiler.tools.import_onnx", str(onnx_path),
                                   "-o", str(mlir)])
        _run("iree-compile", [str(chain.compiler), str(mlir), *COMPILE_FLAGS, "-o", str(vmfb)])
        os.replace(vmfb, out_path)


def _run(what: str, command: list[str]) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise CompileFailed(f"{what} ran past {COMPILE_TIMEOUT_S:.0f} s") from None
    if done.returncode < 0:  # killed by a signal: out of memory, or a crash
        raise CompileFailed(f"{what} died of signal {-done.returncode}: {_reason(done.stderr)}")
    if done.returncode > 0:
        raise CompileRefused(f"{what}: {_reason(done.stderr)}")


def _reason(stderr: str) -> str:
    """The line a user can act on, out of pages of MLIR dumps or a traceback."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    if not errors:
        return (lines[-1] if lines else "no message")[:_MAX_REASON]
    text = errors[0].split("error:", 1)[1].strip()
    operator = re.search(r'"onnx\.(\w+)"', text)
    if operator:  # the rest of the line is the operation in MLIR, no help to a user
        text = f"operator {operator[1]} is not supported ({text.split(':', 1)[0]})"
    return text[:_MAX_REASON]
