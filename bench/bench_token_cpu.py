"""Issue 30: CPU per generated token of modeld's own Python threads, apart
from llama.cpp's compute threads, and the per-token path's cost with a
zero-cost model.

Three parts (all by default; `--only unit`, `--only daemon` or `--only sampling`):

  unit    the shared GenerationLoop over the llama.cpp SlotScheduler with a
          model that costs nothing (a StepExecutor whose run returns
          preallocated zero logits over SmolLM2's 49,152-token vocabulary):
          wall microseconds per step and per token at 1, 16 and 32
          sequences, greedy, streams consumed on the event loop, hot and
          cold (each step first reads 150 MiB, as a decode reads the
          weights, which evicts the loop's code and data from the caches;
          the read itself is left out). What is left is the loop's own
          work per token: scheduling, sampling, detokenising, events.
  daemon  a real `modeld serve` with SmolLM2 (llama.cpp, in its worker
          process) and N concurrent OpenAI chat streams (1, 8, 32;
          ignore_eos, greedy, --tokens each). Each thread's CPU comes from
          /proc/<pid>/task/<tid>/schedstat (nanoseconds) before and after,
          by process (daemon, worker) and thread: Python threads (named by
          `py-spy dump`), native helper threads (gRPC's), and the worker's
          compute threads (llama.cpp's OpenMP team, excluded from the
          Python figure). The worker's step thread is also OpenMP's first
          compute thread, so its CPU is split by a clock around its calls
          into llama.cpp (bench/compute_clock: the thread's own CPU time
          inside llama_decode and llama_sampler_sample, summed in the
          worker, read before and after the phase): inside is compute, the
          rest of the thread's CPU Python, in the same phase. The older
          split is kept beside it (`*_perf` in the record): `perf record`
          on the step thread's task clock in a second run of the phase, its
          on-CPU samples with llama.cpp's libraries in the stack counted
          as compute (py-spy's busy share where perf is missing). A py-spy
          profile of every Python thread of both processes, by function,
          shows where the Python time goes.
          --before TREE races an earlier checkout of modeld (its packages
          on PYTHONPATH, its models/ settings) in the same rounds.
          Each round also takes the floor of each stream count where
          llama-batched-bench is built (`make llama-peer`): bare HTTP token
          streams (grpc_load.py --protocol http: a Python server that only
          writes one SSE event a token, a Python client that only reads
          them), as many as modeld decodes at once (smollm2's n_slots: 8 of
          32, the others wait), at the rate modeld's streams ran, beside
          batched-bench's decode of as many sequences (8 at most), so their
          caches are as cold as the daemon's. Its two processes' CPU per
          token is what any server pays that moves each token between two
          Python processes, as modeld's worker and daemon do, before it
          does any work.
          Each round also runs every stream count through the pipeline
          floor (pipeline_floor.py): a worker process that decodes with
          modeld's llama.cpp settings, as many sequences at once as modeld,
          and a front that streams the tokens as OpenAI chunks, nothing else
          on either side, clocked as the daemon is: the least a server of
          modeld's shape pays between two decodes.

  sampling  one sampled row of SmolLM2's real logits (8 rows a decode, at
          OpenAI's default temperature 1 over the whole vocabulary and at
          llama-server's top-k 40): microseconds per row drawn in numpy (the
          row copied out, then sample_rows), on llama.cpp's sampler chain in
          its buffer (native_sampling), and, for the whole vocabulary, by
          the loop's own path there (sampling.WholeDraw on the row in place).

  --temperature none sends the daemon's streams without a temperature, as
  aiperf does (OpenAI's default 1: sampled over the whole vocabulary, in
  numpy); --temperature 0, the default, is greedy.

    .venv/bin/python bench/bench_token_cpu.py [--only unit|daemon] [--streams 1,8,32] [--tokens 64]
                                              [--temperature 0|none|T] [--before TREE]

Writes bench/results/token_cpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from racing import machine, settle  # noqa: E402

RESULTS = ROOT / "bench/results"
COMPUTE_CLOCK = ROOT / "bench/compute_clock"  # its sitecustomize times llama.cpp's calls in the worker
PY_SPY = Path(sys.executable).parent / "py-spy"
SMOLLM2_VOCAB = 49152
PROMPTS = [
    "Write a short story about a lighthouse keeper.", "Explain how a bicycle gear works.",
    "List ten uses for a paperclip.", "Describe the water cycle to a child.",
    "What makes a good cup of coffee?", "Summarise the history of the printing press.",
    "Give advice to a new gardener.", "Why is the sky blue?",
]


# -- unit: the loop with a zero-cost model -----------------------------------------------

# bytes a cold step streams through the caches: about SmolLM2's Q8_0 GGUF,
# what a real decode reads before the loop's Python runs again
COLD_BYTES = 150 * 2**20


def unit_bench(sequences: int, tokens: int, repeats: int = 3, cold: bool = False) -> dict:
    """Wall time per step of the generation loop over `sequences` greedy
    streams of `tokens` tokens each, with a model that costs nothing.

    cold: each step first reads COLD_BYTES (as a decode reads the weights),
    which evicts the loop's code and objects from the caches; the read's
    own time and CPU are left out of the figures, so what differs from the
    hot run is the loop's work re-fetched from memory each step."""
    import numpy as np

    from modeld.backends.generation.executor import StepExecutor
    from modeld.backends.generation.loop import GenerationLoop
    from modeld.backends.generation.params import FinalEvent, GenerateRequest, SamplingParams
    from modeld.backends.generation.slot_scheduler import SlotConfig, SlotScheduler

    class ZeroCostRunner(StepExecutor):
        vocab_size = SMOLLM2_VOCAB

        def __init__(self) -> None:
            self.logits = np.zeros((512, SMOLLM2_VOCAB), dtype=np.float32)
            self.logits[:, 1] = 1.0  # every row's argmax: token 1, never an end of generation
            self.weights = np.ones(COLD_BYTES // 4, dtype=np.float32) if cold else None
            self.read_s = self.read_cpu_s = 0.0  # the cold reads' own, left out

        def run(self, plan):
            if self.weights is not None:
                wall, cpu = time.perf_counter(), time.thread_time()
                self.weights.sum()
                self.read_s += time.perf_counter() - wall
                self.read_cpu_s += time.thread_time() - cpu
            return self.logits[:sum(w.num_logits for w in plan.work)]

        def tokenize(self, text, add_special=True):
            return [2 + ord(c) % 100 for c in text]

        def token_bytes(self, token_id):
            return b"ab"

        def is_end_of_generation(self, token_id):
            return False

        def apply_chat_template(self, messages, tools=(), template_kwargs=None):
            raise NotImplementedError

    async def consume(loop, i):
        request = GenerateRequest("m", token_ids=tuple(range(2, 18 + i % 7)),
                                  params=SamplingParams(max_tokens=tokens, temperature=0.0))
        count = 0
        async for event in loop.generate(request):
            if isinstance(event, FinalEvent):
                return count
            count += len(event.token_ids)

    async def once() -> tuple[float, int, int, float]:
        scheduler = SlotScheduler(SlotConfig(num_slots=sequences, kv_capacity=sequences * 1024, context_length=1024))
        runner = ZeroCostRunner()
        loop = GenerationLoop(runner=runner, scheduler=scheduler)
        loop.start()
        try:
            cpu, start = time.process_time(), time.perf_counter()
            counts = await asyncio.gather(*(consume(loop, i) for i in range(sequences)))
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        finally:
            await loop.stop()
        return wall - runner.read_s, loop.step_counts.steps, sum(counts), cpu - runner.read_cpu_s

    runs = [asyncio.run(once()) for _ in range(repeats)]
    best = min(runs)  # the least disturbed run: this machine is shared
    wall, steps, count, cpu = best
    return {"sequences": sequences, "tokens_per_sequence": tokens, "cold": cold, "steps": steps, "tokens": count,
            "us_per_step": wall / steps * 1e6, "us_per_token": wall / count * 1e6,
            "cpu_us_per_token": cpu / count * 1e6,
            "us_per_step_runs": [r[0] / r[1] * 1e6 for r in runs]}


# -- sampling: one row, numpy against llama.cpp's chain ---------------------------------

def sampling_bench(repeats: int = 200) -> list[dict]:
    import numpy as np

    from modeld.backends.generation.params import SamplingParams
    from modeld.backends.generation.sampling import WholeDraw, make_rng, sample_rows, truncates
    from modeld.backends.llamacpp.context import LlamaContext, LlamaModel, _llama
    from modeld.backends.llamacpp.native_sampling import NativeSampler

    model = LlamaModel(ROOT / "models/smollm2/model.gguf")
    context = LlamaContext(model, 4096, 8, 512, 2)
    rows = 8
    try:
        ids = model.tokenize(PROMPTS[0])
        # 8 sequences' prompts in one decode, each one's last position a logit row
        context.submit([(t, p, s, p == len(ids) - 1) for s in range(rows) for p, t in enumerate(ids)])
        llama = _llama()
        view = np.ctypeslib.as_array(llama.llama_get_logits(context.ctx), shape=(rows, model.vocab_size))
        batch_index = [s * len(ids) + len(ids) - 1 for s in range(rows)]
        out = []
        for name, params in (("temperature 1, whole vocabulary", SamplingParams(temperature=1.0)),
                             ("top-k 40 (llama-server's default)", SamplingParams(temperature=0.8, top_k=40,
                                                                                  top_p=0.95, min_p=0.05))):
            rng = make_rng(1)
            started = time.perf_counter()
            for _ in range(repeats):
                for r in range(rows):
                    sample_rows(view[r:r + 1].copy(), [params], [rng])  # the loop's own path
            numpy_us = (time.perf_counter() - started) / (repeats * rows) * 1e6
            samplers = [NativeSampler(model, params, ids, []) for _ in range(rows)]
            started = time.perf_counter()
            for _ in range(repeats):
                for r in range(rows):
                    samplers[r].sample(context.ctx, batch_index[r])
            native_us = (time.perf_counter() - started) / (repeats * rows) * 1e6
            for sampler in samplers:
                sampler.close()
            row = {"sampling": name, "numpy_us_per_row": numpy_us, "native_us_per_row": native_us,
                   "ratio": native_us / numpy_us}
            if not truncates(params, model.vocab_size):  # the loop's path for it: drawn in llama.cpp's buffer
                draws = [WholeDraw(rng, params.temperature) for _ in range(rows)]
                started = time.perf_counter()
                for _ in range(repeats):
                    for r in range(rows):
                        draws[r].draw(view[r])
                row["in_buffer_us_per_row"] = (time.perf_counter() - started) / (repeats * rows) * 1e6
            out.append(row)
            print(f"sampling one row, {name}: numpy {numpy_us:.0f} us, llama.cpp chain {native_us:.0f} us"
                  + (f", numpy in llama.cpp's buffer {row['in_buffer_us_per_row']:.0f} us"
                     if "in_buffer_us_per_row" in row else ""), flush=True)
        return out
    finally:
        context.close()
        model.close()


# -- daemon: thread CPU per token ------------------------------------------------------

def tree_pids(pid: int) -> list[int]:
    import psutil

    root = psutil.Process(pid)
    return [root.pid] + [c.pid for c in root.children(recursive=True)]


def _thread_files(pids: list[int], name: str):
    """((pid, tid), text of /proc/<pid>/task/<tid>/<name>) for every live thread of pids."""
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            continue
        for tid in tids:
            try:
                yield (pid, int(tid)), Path(f"/proc/{pid}/task/{tid}/{name}").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue


def thread_cpu(pids: list[int]) -> dict[tuple[int, int], float]:
    """(pid, tid) -> CPU seconds of every thread of pids, from the
    scheduler's nanosecond run time (/proc/.../schedstat); /proc/.../stat
    counts in 10 ms ticks, which at 32 tokens a stream reads in steps of
    0.3 ms a token."""
    return {key: int(text.split()[0]) / 1e9 for key, text in _thread_files(pids, "schedstat") if text.split()}


def thread_comm(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except FileNotFoundError:
        return "?"


def python_threads(pid: int) -> dict[int, str]:
    """Native thread id -> Python thread name, from py-spy's dump."""
    out = subprocess.run([str(PY_SPY), "dump", "--pid", str(pid), "--json", "--nonblocking"],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"py-spy dump failed: {out.stderr.strip()}")
    return {t["os_thread_id"]: t.get("thread_name") or "?" for t in json.loads(out.stdout) if t.get("os_thread_id")}


class Daemon:
    """modeld serve with smollm2 loaded (in its worker process); with
    `tree`, an earlier checkout of modeld (--before) runs it instead: its
    packages on PYTHONPATH ahead of the installed ones, its own models/
    (the artifacts `modeld prepare` made here linked in)."""

    def __init__(self, tree: Path | None = None) -> None:
        from daemon import start_daemon

        self.label = "after" if tree is None else "before"
        self._tmp = None
        self._clock = tempfile.TemporaryDirectory(prefix="modeld-clock-")
        path, repository = [str(COMPUTE_CLOCK)], ROOT / "models"
        if tree is not None:
            self._tmp = tempfile.TemporaryDirectory(prefix="modeld-before-")
            path.append(_namespace(tree.resolve(), Path(self._tmp.name)))
            repository = _linked_models(tree.resolve(), Path(self._tmp.name))
        env = {"PYTHONPATH": os.pathsep.join(path), "MODELD_BENCH_COMPUTE_CLOCK": self._clock.name}
        self.daemon = start_daemon("--metrics-port", "-1", "--no-preload", repository=repository, env=env)
        import tritonclient.grpc as tc

        client = tc.InferenceServerClient(self.daemon.address)
        client.load_model("smollm2")
        client.close()
        self.pid = self.daemon.proc.pid
        workers = tree_pids(self.pid)[1:]
        if len(workers) != 1:
            raise RuntimeError(f"expected one worker process for smollm2, found {len(workers)}")
        self.worker = workers[0]

    def compute_ns(self) -> int | None:
        """CPU nanoseconds the worker's threads have spent inside llama.cpp's
        decode and sampler calls (bench/compute_clock); None before its
        first call."""
        return clock_ns(Path(self._clock.name), self.worker)

    def stop(self) -> None:
        self.daemon.stop()
        self._clock.cleanup()
        if self._tmp is not None:
            self._tmp.cleanup()


def clock_ns(folder: Path, pid: int) -> int | None:
    """The compute clock's sum for process pid (bench/compute_clock); None
    before its first llama.cpp call."""
    try:
        return int.from_bytes((folder / str(pid)).read_bytes()[:8], "little", signed=True)
    except FileNotFoundError:
        return None


class Pipeline:
    """bench/pipeline_floor.py's front and worker (no features), the
    worker clocked as a Daemon's is."""

    label = "pipeline"

    def __init__(self) -> None:
        from pipeline_floor import PipelineFloor

        self._clock = tempfile.TemporaryDirectory(prefix="modeld-clock-")
        env = {"PYTHONPATH": str(COMPUTE_CLOCK), "MODELD_BENCH_COMPUTE_CLOCK": self._clock.name}
        self._floor = PipelineFloor(env).__enter__()
        self.pid, self.worker, self.http_url = self._floor.pid, self._floor.worker, self._floor.http_url

    def compute_ns(self) -> int | None:
        return clock_ns(Path(self._clock.name), self.worker)

    def stop(self) -> None:
        self._floor.__exit__()
        self._clock.cleanup()


def measure_pipeline(node: Pipeline, n: int, tokens: int, others: list[int] = ()) -> dict:
    """n streams through the pipeline floor: the front's CPU and the
    worker's main thread less its time in llama_decode (its other threads
    are llama.cpp's compute), per token. It starts once the daemons
    (`others`) are idle and returns once it is, so neither's compute
    threads polling for work land on the other's phase."""
    pids = [node.pid, node.worker]
    settle([*pids, *others])
    before, compute_before = thread_cpu(pids), node.compute_ns()
    count, wall = asyncio.run(streams(node.http_url, n, tokens))
    after, compute_after = thread_cpu(pids), node.compute_ns()
    settle(pids)
    if compute_before is None or compute_after is None:
        raise RuntimeError("the pipeline floor's worker has no compute clock")
    return {"streams": n, **pipeline_figures(before, after, compute_after - compute_before, node.pid, node.worker,
                                             count, wall)}


def pipeline_figures(before: dict, after: dict, compute_ns: int, front: int, worker: int, count: int,
                     wall: float) -> dict:
    spent = {key: end - before.get(key, 0.0) for key, end in after.items()}
    front_s = sum(v for (pid, _), v in spent.items() if pid == front)
    step_python_s = spent.get((worker, worker), 0.0) - compute_ns / 1e9
    return {"tokens": count, "wall_s": wall, "tok_s": count / wall,
            "front_ms_per_token": front_s * 1e3 / count,
            "worker_python_ms_per_token": step_python_s * 1e3 / count,
            "python_ms_per_token": (front_s + step_python_s) * 1e3 / count}


def _namespace(tree: Path, tmp: Path) -> str:
    """A `modeld` namespace whose packages are tree's folders (as setuptools'
    package-dir maps ours), for PYTHONPATH; the installed editable finder
    comes after PYTHONPATH, so these win."""
    ns = tmp / "path" / "modeld"
    ns.mkdir(parents=True)
    for name in ("server", "backends", "clients", "gen"):
        (ns / name).symlink_to(tree / name)
    return str(ns.parent)


def _linked_models(tree: Path, tmp: Path) -> Path:
    """tree's smollm2 entries (its model.toml: the settings it shipped with),
    their artifacts linked from ours."""
    out = tmp / "models"
    for name in ("smollm2", "smollm2-draft"):
        (out / name).mkdir(parents=True)
        for item in (tree / "models" / name).iterdir():
            (out / name / item.name).symlink_to(item)
        gguf = out / name / "model.gguf"
        if not gguf.exists():
            gguf.unlink(missing_ok=True)
            gguf.symlink_to((ROOT / "models" / name / "model.gguf").resolve())
    return out


# the streams' temperature (--temperature); None: the field is left out
TEMPERATURE: float | None = 0.0


async def chat_stream(session, url: str, prompt: str, tokens: int) -> int:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    if TEMPERATURE is not None:
        body["temperature"] = TEMPERATURE
    used = 0
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    used = usage["completion_tokens"]
    return used


async def streams(url: str, n: int, tokens: int) -> tuple[int, float]:
    # aiohttp, not httpx: the client shares the two cores, and httpx costs more CPU per chunk
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=n + 4)) as session:
        start = time.perf_counter()
        counts = await asyncio.gather(*(chat_stream(session, url, PROMPTS[i % len(PROMPTS)], tokens)
                                        for i in range(n)))
        return sum(counts), time.perf_counter() - start


def classify(node: Daemon, names: dict[int, dict[int, str]], key: tuple[int, int]) -> tuple[str, str]:
    """(group, thread label) of one thread: group is daemon-python,
    daemon-native, worker-python, worker-step or worker-compute."""
    pid, tid = key
    proc = "daemon" if pid == node.pid else "worker"
    py = names.get(pid, {}).get(tid)
    if py is None:
        return f"{proc}-{'native' if proc == 'daemon' else 'compute'}", thread_comm(pid, tid)
    if proc == "worker" and py.startswith("modeld-compute"):
        return "worker-step", py
    return f"{proc}-python", py


def measure_phase(node: Daemon, n: int, tokens: int) -> dict:
    pids = [node.pid, node.worker]
    settle(pids)
    before, ticks_before, compute_before = thread_cpu(pids), thread_ticks(pids), node.compute_ns()
    count, wall = asyncio.run(streams(node.daemon.http_url, n, tokens))
    after, ticks_after, compute_after = thread_cpu(pids), thread_ticks(pids), node.compute_ns()
    names = {pid: python_threads(pid) for pid in pids}
    groups: dict[str, float] = collections.defaultdict(float)
    threads: dict[str, float] = collections.defaultdict(float)
    ticks: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for key, end in after.items():
        spent = end - before.get(key, 0.0)
        group, label = classify(node, names, key)
        groups[group] += spent
        threads[f"{group}:{label}"] += spent
        for i, (a, b) in enumerate(zip(ticks_before.get(key, (0, 0)), ticks_after.get(key, (0, 0)))):
            ticks[group][i] += b - a
    per_token = {g: v * 1e3 / count for g, v in groups.items()}
    phase = {"streams": n, "tokens": count, "wall_s": wall, "tok_s": count / wall,
             "cpu_ms_per_token": dict(sorted(per_token.items()))}
    if compute_before is not None and compute_after is not None:
        # the step thread's CPU inside llama.cpp's calls: compute, left out of the Python figure
        phase["step_compute_ms_per_token"] = (compute_after - compute_before) / 1e6 / count
    return {**phase,
            # the kernel's share of each group (system over user + system ticks): socket writes, wake-ups
            "system_share": {g: round(sys_ / (user + sys_), 3) for g, (user, sys_) in sorted(ticks.items())
                             if user + sys_},
            "threads_cpu_ms_per_token": {k: round(v * 1e3 / count, 4) for k, v in sorted(threads.items())
                                         if v * 1e3 / count >= 0.005}}


def thread_ticks(pids: list[int]) -> dict[tuple[int, int], tuple[int, int]]:
    """(pid, tid) -> (user, system) clock ticks of every thread of pids
    (/proc/.../stat): coarse, but the only split of the two."""
    out = {}
    for key, stat in _thread_files(pids, "stat"):
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        out[key] = (int(fields[11]), int(fields[12]))
    return out


def profile_phase(node: Daemon, n: int, tokens: int, rate: int = 100) -> dict:
    """The same phase under py-spy (both processes): busy samples by
    thread and by function; the step thread's share inside llama_decode."""
    pids = [node.pid, node.worker]
    settle(pids)
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for pid in pids:
            out = Path(tmp) / f"{pid}.txt"
            procs.append((pid, out, subprocess.Popen(
                [str(PY_SPY), "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw", "--threads",
                 "--nonblocking", "--output", str(out)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
        time.sleep(1.0)  # py-spy attaches
        count, _ = asyncio.run(streams(node.daemon.http_url, n, tokens))
        stacks: dict[int, list[tuple[list[str], int]]] = {}
        for pid, out, proc in procs:
            proc.send_signal(2)  # SIGINT: py-spy writes its file and exits
            proc.wait(60)
            stacks[pid] = _read_raw(out)
    return summarise_profile(node, stacks, count)


def split_phase(node: Daemon, n: int, tokens: int, rate: int = 1000) -> float | None:
    """The share of the step thread's on-CPU samples inside llama.cpp (its
    libllama, libggml or libgomp frames anywhere in the stack): `perf record`
    on the task clock, stacks unwound from DWARF (ggml keeps no frame
    pointers). py-spy cannot give this share: it calls a thread busy while
    it is runnable, so on two shared cores a step thread that waits for a
    core reads as Python time. None where perf is missing or refused."""
    step = next((tid for tid, name in python_threads(node.worker).items() if name.startswith("modeld-compute")), None)
    if step is None or shutil.which("perf") is None:
        return None
    settle([node.pid, node.worker])
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "step.perf"
        proc = subprocess.Popen(["perf", "record", "-e", "task-clock", "-F", str(rate), "--call-graph", "dwarf,16384",
                                 "-t", str(step), "-o", str(data)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # perf attaches
        asyncio.run(streams(node.daemon.http_url, n, tokens))
        proc.send_signal(2)
        proc.wait(60)
        if not data.exists():
            return None
        script = subprocess.run(["perf", "script", "-i", str(data), "-F", "ip,dso"], capture_output=True, text=True,
                                check=False).stdout
    stacks = [block for block in script.split("\n\n") if block.strip()]
    inside = sum(1 for block in stacks if any(lib in block for lib in _COMPUTE_LIBRARIES))
    return inside / len(stacks) if stacks else None


# the step thread's samples in these are llama.cpp's compute (its sampler chain included)
_COMPUTE_LIBRARIES = ("libllama", "libggml", "libgomp")


def _read_raw(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's raw (collapsed) format: `frame;frame;... count` per line, root first."""
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            rows.append((stack.split(";"), int(count)))
    return rows


def _short(frame: str) -> str:
    """`fn (path/to/modeld/x/y.py:12)` -> `fn (x/y.py)`."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")").rsplit(":", 1)[0]
    for marker in ("/modeld/", "/site-packages/", "/lib/python3"):
        if marker in where:
            where = where.split(marker, 1)[1]
            break
    return f"{name} ({where})" if where else name


_OURS = ("backends/", "server/", "gen/", "clients/", "modeld/", str(ROOT) + "/")


def _in_decode(frame: str) -> bool:
    """A frame that is llama.cpp's forward pass: LlamaContext.submit's line
    calling llama_decode (py-spy shows the ctypes call as its caller's
    line; decode_picking calls submit without _decode)."""
    name = frame.partition(" (")[0]
    return name in ("llama_decode", "_decode", "LlamaContext._decode", "submit", "LlamaContext.submit") or \
        name.endswith(".llama_decode")


def _in_native_sampling(frame: str) -> bool:
    """A frame drawing a token on llama.cpp's sampler chain (NativeSampler.sample's
    llama_sampler_sample call): sampling work in C, apart from the forward pass."""
    name, _, where = frame.partition(" (")
    return name in ("sample", "NativeSampler.sample", "llama_sampler_sample") and (
        "native_sampling" in where or name == "llama_sampler_sample")


def _is_modeld(frame: str) -> bool:
    """A frame of modeld's own code (py-spy names files relative to sys.path)."""
    where = frame.partition(" (")[2]
    return where.startswith(_OURS) and "/site-packages/" not in where


def summarise_profile(node: Daemon, stacks: dict[int, list[tuple[list[str], int]]], tokens: int) -> dict:
    out: dict = {"tokens": tokens, "processes": {}}
    for pid, rows in stacks.items():
        proc = "daemon" if pid == node.pid else "worker"
        by_thread: dict[str, int] = collections.defaultdict(int)
        leaf: dict[str, int] = collections.defaultdict(int)
        own: dict[str, int] = collections.defaultdict(int)
        step_leaf: dict[str, int] = collections.defaultdict(int)
        decode = step = native = 0
        for frames, count in rows:
            thread = frames[0]
            by_thread[thread] += count
            body = frames[1:]
            if not body:
                continue
            if "modeld-compute" in thread:
                step += count
                if any(_in_decode(f) for f in body[-2:]):
                    decode += count
                elif any(_in_native_sampling(f) for f in body[-2:]):
                    native += count
            leaf[_short(body[-1])] += count
            if "modeld-compute" in thread:
                step_leaf[_short(body[-1])] += count
            # the innermost modeld frame: which of our functions the time is under
            mine = next((f for f in reversed(body) if _is_modeld(f)), None)
            if mine is not None:
                own[_short(mine)] += count
        total = sum(by_thread.values()) or 1
        out["processes"][proc] = {
            "samples": total,
            "by_thread": dict(sorted(by_thread.items(), key=lambda kv: -kv[1])),
            "top_leaf_functions": dict(sorted(leaf.items(), key=lambda kv: -kv[1])[:25]),
            "top_modeld_functions": dict(sorted(own.items(), key=lambda kv: -kv[1])[:25]),
        }
        if proc == "worker":
            out["step_thread_decode_share"] = decode / step if step else None
            # counted in the Python figure below: it is per-token work outside the model
            out["step_thread_native_sampling_share"] = native / step if step else None
            out["step_thread_top_leaves"] = dict(sorted(step_leaf.items(), key=lambda kv: -kv[1])[:12])
    return out


# batched-bench's context (4,096 cells) holds 8 sequences of its 160 tokens, not 32
FLOOR_MOST_SEQUENCES = 8


def running_at_once(n: int) -> int:
    """How many of n streams models/smollm2 decodes at once (its n_slots;
    the others wait their turn): the streams that carry tokens together."""
    import tomllib

    config = tomllib.loads((ROOT / "models" / "smollm2" / "model.toml").read_text())
    return min(n, config["llamacpp"]["n_slots"])


def stream_floor(n: int, rate: float, settle_pids: list[int]) -> dict | None:
    """Bare HTTP token streams at `rate` tokens a second in all, as many as
    modeld runs at once of n (running_at_once), beside batched-bench's
    decode of as many sequences (at most FLOOR_MOST_SEQUENCES; three runs,
    medians, for one), and the decode right before without them; None
    where batched-bench is not built."""
    from bench_llama_server import PEER_BIN, batched_bench
    from grpc_load import GrpcStreamLoad

    if not (PEER_BIN / "llama-batched-bench").exists():
        return None
    concurrent = running_at_once(n)
    sequences = min(concurrent, FLOOR_MOST_SEQUENCES)
    runs = ",".join([str(sequences)] * (3 if sequences == 1 else 1))  # one sequence's decode is too short alone
    settle(settle_pids)
    plain = batched_bench(runs)[sequences]["decode_tok_s"]
    with GrpcStreamLoad(rate, streams=concurrent, protocol="http") as load:
        loaded = batched_bench(runs)[sequences]["decode_tok_s"]
    cost = load.figures
    return {"streams": n, "bare_streams": concurrent, "decode_sequences": sequences, "decode_tok_s": loaded,
            "plain_decode_tok_s": plain, "load": cost,
            "python_ms_per_token": cost["server_cpu_ms_per_message"] + cost["client_cpu_ms_per_message"]}


def daemon_bench(stream_counts: list[int], tokens: int, rounds: int, profile: bool,
                 before: Path | None = None) -> dict:
    """Each round measures every stream count on every side (this tree, and
    with --before the earlier one), in alternating order; then one profile
    phase per side and stream count splits the step thread."""
    nodes = [Daemon()] + ([Daemon(before)] if before is not None else [])
    pipeline = Pipeline()
    try:
        for node in nodes:
            asyncio.run(streams(node.daemon.http_url, 2, 8))  # warm up: first prompt, first compile
        asyncio.run(streams(pipeline.http_url, 2, 8))
        phases, floors, pipelines = [], [], []
        for r in range(rounds):
            for n in (stream_counts if r % 2 == 0 else list(reversed(stream_counts))):
                for node in (nodes if (r + n) % 2 == 0 else list(reversed(nodes))):
                    phase = measure_phase(node, n, tokens)
                    phase["round"], phase["side"] = r, node.label
                    phases.append(phase)
                    clocked = (f", of which in llama.cpp {phase['step_compute_ms_per_token']:.3f}"
                               if "step_compute_ms_per_token" in phase else "")
                    print(f"round {r}, {node.label}, {n} streams: {phase['tok_s']:.1f} tok/s, CPU ms/token "
                          + ", ".join(f"{g} {v:.3f}" for g, v in phase["cpu_ms_per_token"].items()) + clocked,
                          flush=True)
            for n in stream_counts:
                ours = [p for p in phases if p["round"] == r and p["streams"] == n and p["side"] == "after"]
                floor = stream_floor(n, ours[0]["tok_s"], [node.pid for node in nodes]) if ours else None
                if floor is not None:
                    floor["round"] = r
                    floors.append(floor)
                    print(f"round {r}, floor of {n} streams: bare HTTP streams {floor['python_ms_per_token']:.3f} "
                          f"CPU ms/token (server + client), the decode beside them {floor['decode_tok_s']:.1f} "
                          f"tok/s ({floor['plain_decode_tok_s']:.1f} alone)", flush=True)
            for n in stream_counts:
                got = measure_pipeline(pipeline, n, tokens, [node.pid for node in nodes])
                got["round"] = r
                pipelines.append(got)
                print(f"round {r}, pipeline floor, {n} streams: {got['tok_s']:.1f} tok/s, Python CPU ms/token "
                      f"{got['python_ms_per_token']:.3f} (front {got['front_ms_per_token']:.3f}, worker "
                      f"{got['worker_python_ms_per_token']:.3f})", flush=True)
        profiles: dict = {node.label: {} for node in nodes}
        if profile:
            for n in stream_counts:
                for node in nodes:
                    profiles[node.label][n] = got = profile_phase(node, n, tokens)
                    got["step_thread_compute_share_perf"] = split_phase(node, n, tokens)
                    print(f"profile, {node.label}, {n} streams: step thread in llama.cpp "
                          f"{got['step_thread_compute_share_perf']} (perf), in llama_decode "
                          f"{got['step_thread_decode_share']} (py-spy)", flush=True)
    finally:
        for node in nodes:
            node.stop()
        pipeline.stop()
    summary = {node.label: _summary([p for p in phases if p["side"] == node.label], profiles[node.label],
                                    stream_counts) for node in nodes}
    out = {"phases": phases, "profiles": profiles, "summary": summary["after"]}
    if floors:
        out["floor"] = {"rounds": floors, "by_streams": floor_summary(floors, summary, before is not None)}
    if pipelines:
        out["pipeline_floor"] = pipeline_summary(pipelines, summary)
    if before is not None:
        out["before"] = summary["before"]
        out["after_over_before"] = {
            n: {key: _ratio(summary["after"][n].get(key), summary["before"][n].get(key))
                for key in ("python_ms_per_token", "python_ms_per_token_without_step_thread",
                            "python_ms_per_token_perf")}
            for n in stream_counts}
    return out


def floor_summary(floors: list[dict], summary: dict, with_before: bool) -> dict:
    """The floor's medians by stream count beside modeld's: how far above
    the floor modeld's Python is, and (with --before) the most the
    after/before ratio could fall to were modeld's own work free."""
    out = {}
    for n in sorted({f["streams"] for f in floors}):
        got = [f for f in floors if f["streams"] == n]
        floor = statistics.median(f["python_ms_per_token"] for f in got)
        row = {"python_ms_per_token": floor,
               "decode_beside_stream_over_alone": statistics.median(f["decode_tok_s"] / f["plain_decode_tok_s"]
                                                                    for f in got)}
        row["after_over_floor"] = _ratio(summary["after"].get(n, {}).get("python_ms_per_token"), floor)
        if with_before:
            row["floor_over_before"] = _ratio(floor, summary["before"].get(n, {}).get("python_ms_per_token"))
        out[n] = row
    return out


def pipeline_summary(rounds: list[dict], summary: dict) -> dict:
    """The pipeline floor's medians by stream count beside modeld's: how
    far above it modeld is, and (beside a --before tree) the least
    after/before any server of modeld's shape could reach."""
    out = {"rounds": rounds, "by_streams": {}}
    for n in sorted({p["streams"] for p in rounds}):
        got = [p for p in rounds if p["streams"] == n]
        row = {key: statistics.median(p[key] for p in got)
               for key in ("python_ms_per_token", "front_ms_per_token", "worker_python_ms_per_token", "tok_s")}
        row["after_over_pipeline"] = _ratio(summary["after"].get(n, {}).get("python_ms_per_token"),
                                            row["python_ms_per_token"])
        if "before" in summary:
            row["pipeline_over_before"] = _ratio(row["python_ms_per_token"],
                                                 summary["before"].get(n, {}).get("python_ms_per_token"))
        out["by_streams"][n] = row
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _summary(phases: list[dict], profiles: dict, stream_counts: list[int]) -> dict:
    """Medians by stream count; the step thread's Python share from its profile."""
    summary = {}
    for n in stream_counts:
        got = [p for p in phases if p["streams"] == n]
        groups = sorted({g for p in got for g in p["cpu_ms_per_token"]})
        med = {g: statistics.median(p["cpu_ms_per_token"].get(g, 0.0) for p in got) for g in groups}
        profile = profiles.get(n, {})
        share = profile.get("step_thread_compute_share_perf")
        if share is None:  # no perf here: py-spy's share, which counts a waiting step thread as busy
            share = profile.get("step_thread_decode_share")
        step = med.get("worker-step", 0.0)
        python = med.get("daemon-python", 0.0) + med.get("worker-python", 0.0)
        shares = {g: statistics.median(p["system_share"][g] for p in got if g in p.get("system_share", {}))
                  for g in groups if any(g in p.get("system_share", {}) for p in got)}
        row = {"tok_s": statistics.median(p["tok_s"] for p in got), "cpu_ms_per_token": med, "system_share": shares,
               "python_ms_per_token_without_step_thread": python}
        if share is not None:
            row["step_thread_python_ms_per_token_perf"] = step * (1 - share)
            row["python_ms_per_token_perf"] = python + step * (1 - share)
        if got and all("step_compute_ms_per_token" in p for p in got):
            # per phase, then the median: the clock and the thread times come from the same phase
            row["step_thread_python_ms_per_token"] = statistics.median(
                p["cpu_ms_per_token"].get("worker-step", 0.0) - p["step_compute_ms_per_token"] for p in got)
            row["python_ms_per_token"] = statistics.median(_python_ms(p) for p in got)
        elif share is not None:
            row["step_thread_python_ms_per_token"] = row["step_thread_python_ms_per_token_perf"]
            row["python_ms_per_token"] = row["python_ms_per_token_perf"]
        summary[n] = row
    return summary


def _python_ms(phase: dict) -> float:
    """One phase's Python CPU ms per token: the daemon's and the worker's
    Python threads, and the step thread less its time inside llama.cpp."""
    cpu = phase["cpu_ms_per_token"]
    return (cpu.get("daemon-python", 0.0) + cpu.get("worker-python", 0.0)
            + cpu.get("worker-step", 0.0) - phase["step_compute_ms_per_token"])


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=["unit", "daemon", "sampling"])
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--temperature", default="0", help="the daemon streams' temperature; none: not sent")
    parser.add_argument("--output", default=str(RESULTS / "token_cpu.json"))
    parser.add_argument("--before", type=Path,
                        help="an earlier checkout of modeld (e.g. `git worktree add`) raced in the same rounds")
    args = parser.parse_args()
    global TEMPERATURE
    TEMPERATURE = None if args.temperature == "none" else float(args.temperature)
    record: dict = {"command": "python bench/bench_token_cpu.py " + " ".join(sys.argv[1:]), "machine": machine()}
    path = Path(args.output)
    if path.exists():  # a part run alone keeps the other's figures
        record = {**json.loads(path.read_text()), **record}
    if args.only in (None, "unit"):
        record["unit"] = [unit_bench(n, 128, cold=cold) for cold in (False, True) for n in (1, 16, 32)]
        for row in record["unit"]:
            print(f"zero-cost model, {row['sequences']} sequences{', cold' if row['cold'] else ''}: "
                  f"{row['us_per_step']:.0f} us/step, {row['us_per_token']:.1f} us/token, "
                  f"{row['cpu_us_per_token']:.1f} us CPU/token", flush=True)
    if args.only in (None, "sampling"):
        record["sampling"] = sampling_bench()
    if args.only in (None, "daemon"):
        counts = [int(n) for n in args.streams.split(",")]
        record["daemon"] = daemon_bench(counts, args.tokens, args.rounds, not args.no_profile, args.before)
        record["daemon"]["temperature"] = "not sent (OpenAI's default, 1)" if TEMPERATURE is None else TEMPERATURE
        sides = {"after": record["daemon"]["summary"], "before": record["daemon"].get("before", {})}
        for side, summary in sides.items():
            for n, row in summary.items():
                print(f"{side if args.before else ''} {n} streams: {row['tok_s']:.1f} tok/s; Python ms/token "
                      f"{row.get('python_ms_per_token', row['python_ms_per_token_without_step_thread']):.3f}; "
                      + ", ".join(f"{g} {v:.3f}" for g, v in row["cpu_ms_per_token"].items()), flush=True)
        for n, ratio in record["daemon"].get("after_over_before", {}).items():
            print(f"{n} streams: Python CPU per token after/before {ratio['python_ms_per_token']}", flush=True)
        for n, floor in record["daemon"].get("floor", {}).get("by_streams", {}).items():
            print(f"{n} streams: the bare two-process streams' {floor['python_ms_per_token']:.3f} CPU ms/token; "
                  f"modeld {floor['after_over_floor']} of it" + (f"; it is {floor['floor_over_before']} of before's"
                                                                 if "floor_over_before" in floor else ""), flush=True)
        for n, pipeline in record["daemon"].get("pipeline_floor", {}).get("by_streams", {}).items():
            print(f"{n} streams: the pipeline floor's {pipeline['python_ms_per_token']:.3f} Python CPU ms/token; "
                  f"modeld {pipeline['after_over_pipeline']} of it" + (
                      f"; it is {pipeline['pipeline_over_before']} of before's" if "pipeline_over_before" in pipeline
                      else ""), flush=True)
    record["load_average_after"] = list(os.getloadavg())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str))


if __name__ == "__main__":
    main()
