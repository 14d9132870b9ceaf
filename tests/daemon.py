"""Start and stop a real `modeld serve` process for tests and benchmarks."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _die_with_parent() -> None:
    # a test run killed from outside (a timeout, ^C twice) skips its fixtures'
    # teardown; without this its daemons and their workers stay up and hold
    # gigabytes until someone finds them. SIGKILL, not SIGTERM: with the test
    # gone, the daemon's stderr pipe is closed and a graceful drain that logs
    # can stall on it; its workers follow it by their own death signal.
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


# The death signal follows the thread that forked, not the process: a daemon
# started from a test's thread pool would die when that pool closes. Every
# start forks from this one thread, which lives as long as the test run.
_SPAWNER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-daemon-spawner")


def _spawn(cmd: list[str], env: dict | None) -> subprocess.Popen:
    return _SPAWNER.submit(subprocess.Popen, cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                           env={**os.environ, **(env or {})}, cwd=ROOT, preexec_fn=_die_with_parent).result()


@dataclass
class DaemonProcess:
    """A `modeld serve` subprocess on a free loopback port."""

    proc: subprocess.Popen
    port: int = 0
    metrics_port: int = 0
    http_port: int = 0  # 0 when the daemon serves no HTTP (--http-port -1)
    logs: list[dict] = field(default_factory=list)
    _lines: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def events(self, name: str) -> list[dict]:
        return [e for e in list(self.logs) if e.get("event") == name]

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def tree_rss(self) -> int:
        """Resident bytes of the daemon and its worker processes together."""
        import psutil

        total = 0
        root = psutil.Process(self.proc.pid)
        for process in (root, *root.children(recursive=True)):
            try:
                total += process.memory_info().rss
            except psutil.NoSuchProcess:
                pass  # a worker that ended meanwhile holds nothing
        return total


def metric_sum(process: "DaemonProcess", name: str, **labels) -> float:
    """The sum of every series of `name` on the process's metrics port whose
    labels include `labels` (0 when none)."""
    import re
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{process.metrics_port}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"{re.escape(name)}(?:\{{(.*)\}})? ([0-9.e+-]+)$", line)
        if not match:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


def _pump(daemon: DaemonProcess, started: threading.Event, ready_event: str = "daemon_started") -> None:
    for line in daemon.proc.stderr:
        daemon._lines.append(line)
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        daemon.logs.append(event)
        if event.get("event") == ready_event:
            daemon.port, daemon.metrics_port = event["grpc_port"], event["metrics_port"]
            daemon.http_port = event.get("http_port") or 0
            started.set()


def start_daemon(*args: str, repository: Path | None = MODELS, env: dict | None = None,
                 wait_for_preload: bool = True, timeout: float = 300) -> DaemonProcess:
    # every port 0: concurrent test daemons would collide on the defaults
    # (HTTP's 8000 included); a later flag in `args` overrides these
    cmd = [sys.executable, "-m", "modeld.server.cli", "serve", "--grpc-port", "0", "--http-port", "0",
           "--metrics-port", "0", "--log-format", "json"]
    if repository is not None:
        cmd += ["--model-repository", str(repository)]
    proc = _spawn(cmd + list(args), env)
    daemon = DaemonProcess(proc)
    started = threading.Event()
    threading.Thread(target=_pump, args=(daemon, started), daemon=True).start()
    deadline = time.monotonic() + timeout
    while not started.wait(0.1):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("daemon did not start:\n" + "".join(daemon._lines[-30:]))
    if wait_for_preload and "--no-preload" not in args:
        try:
            _wait_preloaded(daemon, repository, deadline)
        except RuntimeError:
            proc.kill()
            raise
    return daemon


def _wait_preloaded(daemon: DaemonProcess, repository: Path | None, deadline: float) -> None:
    names = {p.parent.name for p in repository.glob("*/model.toml")} if repository else set()
    while time.monotonic() < deadline:
        done = {e.get("model") for e in daemon.logs if e.get("event") in ("model_loaded", "preload_skipped")}
        if names <= done:
            return
        time.sleep(0.1)
    raise RuntimeError("models did not preload")


def start_gateway(*nodes: str, args: tuple[str, ...] = (), env: dict | None = None,
                  timeout: float = 60) -> DaemonProcess:
    """A `modeld gateway` subprocess on a free loopback port in front of `nodes`."""
    # every port free and chosen by the system, HTTP's too (its default is 8000): gateways
    # started side by side must not collide; a later --http-port in args wins
    cmd = [sys.executable, "-m", "modeld.server.cli", "gateway", "--grpc-port", "0", "--metrics-port", "0",
           "--http-port", "0", "--log-format", "json"]
    for node in nodes:
        cmd += ["--node", node]
    proc = _spawn(cmd + list(args), env)
    gateway = DaemonProcess(proc)
    started = threading.Event()
    threading.Thread(target=_pump, args=(gateway, started, "gateway_started"), daemon=True).start()
    deadline = time.monotonic() + timeout
    while not started.wait(0.1):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("gateway did not start:\n" + "".join(gateway._lines[-30:]))
    return gateway


_SHARE: list[int] = []


def daemon_share() -> int:
    """The bytes an idle daemon holds of its own memory budget (its resident
    memory at start, `daemon_bytes` in its start event), measured once per
    test run on a daemon of its own. Tests that size a budget for N models
    add it: the budget holds for the whole process."""
    if not _SHARE:
        import tempfile

        with tempfile.TemporaryDirectory() as empty:
            probe = start_daemon("--no-preload", repository=Path(empty))
            try:
                _SHARE.append(int(probe.events("daemon_started")[0]["daemon_bytes"]))
            finally:
                probe.stop()
    return _SHARE[0]


def add_small_smollm2(root: Path, n_ctx: int = 4096, n_slots: int = 4, context_length: int = 2048) -> None:
    """smollm2 on llama.cpp with a small KV cache, in the test repository
    `root`: the full repository's models would load for a minute first."""
    (root / "smollm2").mkdir()
    (root / "smollm2" / "model.gguf").symlink_to((MODELS / "smollm2" / "model.gguf").resolve())
    (root / "smollm2" / "model.toml").write_text(
        'format = "gguf"\nbackends = ["llamacpp"]\nartifact = "model.gguf"\n[llamacpp]\n'
        f"n_ctx = {n_ctx}\nn_slots = {n_slots}\ncontext_length = {context_length}\nn_threads = 2\n")
