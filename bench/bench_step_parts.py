"""Where the step thread's Python goes, by part of the step: a thread-CPU
clock around each of GenerationLoop's step methods, with SmolLM2 on
llama.cpp loaded in this process.

bench_token_cpu gives the step thread's Python per token as a whole (its
CPU less its time inside llama.cpp's calls); a sampling profiler at a rate
that leaves the decode alone catches a handful of samples between two
decodes, too few to split that. Here every part of a step is timed with
the calling thread's own CPU clock (CLOCK_THREAD_CPUTIME_ID, as
schedstat counts): the model is loaded as a worker loads it
(LlamaCppBackend.load, the compute thread), its streams' events go to the
worker's own step-thread sender over a socketpair that a thread drains,
and the parts that call into llama.cpp (the decode, a native sampler's
draw) are reported less that time. The clock is not free: a thread-CPU
read is a system call (0.6 us hot here, more on cold caches), two a part
a step, so each round first runs the same phase with the parts' clocks
off (`unclocked`: the step thread's Python as it is) and then with them
on (the parts, whose sum includes the reads). `other` is the step
thread's Python that no part covers (the burst loop, the observer's step
report). After the rounds, the same streams run with llama_decode
returning at once (its buffer keeps the last real decode's logits, so
every step still reads, draws and sends tokens): the step thread's
Python on caches no decode has emptied, beside the figure after each
decode (`after_decode_over_no_decode`).

    .venv/bin/python bench/bench_step_parts.py --streams 1,8 --tokens 128 --rounds 3
    .venv/bin/python bench/bench_step_parts.py --temperature 1   # sampled (llama.cpp's chain draws)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from racing import machine  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LOOP = "modeld.backends.generation.loop:GenerationLoop"
CONTEXT = "modeld.backends.llamacpp.context:LlamaContext"
# the parts of a step, in the order a step runs them; none calls another
PARTS = (
    f"{LOOP}._propose_drafts",
    "modeld.backends.llamacpp.lora:AdapterSlotScheduler.schedule",
    f"{LOOP}._start_masks",
    f"{LOOP}._plain_greedy",
    f"{LOOP}._picks",
    f"{CONTEXT}.run",  # greedy: the batch, llama_decode (left out), the logits view and its argmax
    f"{CONTEXT}.run_picking",  # sampled: the same with each row's native draw (left out)
    f"{LOOP}._count",
    f"{LOOP}._take_greedy",  # detokenising, stop checks, the token events to the sender
    f"{LOOP}._sample",
    "modeld.backends.generation.scheduler:BaseScheduler.update",
    f"{LOOP}._finished",
    f"{LOOP}._send_outbox",  # the step's frame: encoded and written to the daemon's socket
)
# llama.cpp's calls a step makes: compute, left out of every figure
COMPUTE_CALLS = ("llama_decode", "llama_sampler_sample")


class Clock:
    """Thread-CPU nanoseconds: inside llama.cpp's calls, and per part less those."""

    def __init__(self) -> None:
        self.compute_ns = 0
        self.parts: dict[str, int] = {}
        self.parts_on = True  # off: the parts run unclocked (the compute calls are always timed)
        # on: llama_decode returns at once, its logits buffer left as the last real decode wrote it
        self.skip_decode = False

    def wrap_compute(self, llama) -> None:
        for name in COMPUTE_CALLS:
            setattr(llama, name, self._timed_compute(getattr(llama, name), skippable=name == "llama_decode"))

    def _timed_compute(self, call, skippable: bool = False):
        def timed(*args):
            if skippable and self.skip_decode:
                return 0
            started = time.thread_time_ns()
            try:
                return call(*args)
            finally:
                self.compute_ns += time.thread_time_ns() - started
        return timed

    def wrap_part(self, spec: str) -> None:
        module, qualified = spec.split(":")
        owner_name, method = qualified.split(".")
        owner = getattr(importlib.import_module(module), owner_name)
        original = getattr(owner, method)
        label = f"{owner_name}.{method}"

        def timed(*args, **kwargs):
            if not self.parts_on:
                return original(*args, **kwargs)
            started, compute = time.thread_time_ns(), self.compute_ns
            try:
                return original(*args, **kwargs)
            finally:
                spent = time.thread_time_ns() - started - (self.compute_ns - compute)
                self.parts[label] = self.parts.get(label, 0) + spent
        setattr(owner, method, timed)


def thread_cpu_ns(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[0])


def summarise(parts_ns: dict[str, int], step_ns: int, compute_ns: int, tokens: int) -> dict:
    """us per token: the step thread's Python (its CPU less llama.cpp's
    calls), each part's, and `other`, what no part covers."""
    python_ns = step_ns - compute_ns
    out = {"step_thread_python_us_per_token": python_ns / tokens / 1e3,
           "parts_us_per_token": {k: v / tokens / 1e3 for k, v in sorted(parts_ns.items(), key=lambda kv: -kv[1])}}
    out["parts_us_per_token"]["other"] = (python_ns - sum(parts_ns.values())) / tokens / 1e3
    return out


async def run(streams: list[int], tokens: int, rounds: int, temperature: float) -> list[dict]:
    from modeld.backends.generation.params import GenerateRequest, SamplingParams
    from modeld.backends.generation.step_sink import STEP_SINK
    from modeld.backends.compute_thread import COMPUTE_THREAD
    from modeld.backends.llamacpp import context
    from modeld.backends.llamacpp.backend import LlamaCppBackend
    from modeld.backends.model_config import load_model_toml
    from modeld.server.workers.frames import ThreadChannel
    from modeld.server.workers.main import _StepThreadSender

    directory = ROOT / "models" / "smollm2"
    model = LlamaCppBackend().load(load_model_toml("smollm2", directory / "model.toml"), directory)
    clock = Clock()
    clock.wrap_compute(context._llama())
    for spec in PARTS:
        clock.wrap_part(spec)
    ours, theirs = socket.socketpair()

    def drain() -> None:  # the daemon's end: read and drop
        while theirs.recv(1 << 20):
            pass

    threading.Thread(target=drain, daemon=True).start()
    channel = ThreadChannel(ours, asyncio.get_running_loop(), lambda m: True, lambda m: None, lambda e: None)
    sender = _StepThreadSender(channel)
    model.loop.observer = sender  # as a worker's loop reports its figures
    model.loop.start()
    tid = COMPUTE_THREAD.submit(threading.get_native_id).result()

    async def one(key: int, prompt: str) -> None:
        STEP_SINK.set((sender, key))
        request = GenerateRequest("smollm2", prompt=prompt, params=SamplingParams(
            max_tokens=tokens, ignore_eos=True, temperature=temperature, seed=key))
        async for _ in model.loop.generate(request):
            pass

    async def phase(n: int) -> tuple[int, int, float]:
        """n streams at once: the step thread's CPU, its part inside llama.cpp (ns) and the wall time (s)."""
        step, compute, wall = thread_cpu_ns(tid), clock.compute_ns, time.perf_counter()
        await asyncio.gather(*(one(i, f"Write a long story, number {i}, about a lighthouse keeper.")
                               for i in range(n)))
        return thread_cpu_ns(tid) - step, clock.compute_ns - compute, time.perf_counter() - wall

    rows = []
    try:
        for r in range(rounds):
            for n in streams:
                await phase(n)  # the prompts' prefixes cached first: the phases time decode steps
                measured = []
                for parts_on in (False, True):
                    clock.parts.clear()
                    clock.parts_on = parts_on
                    step, compute, wall = await phase(n)
                    measured.append((summarise(clock.parts, step, compute, n * tokens), n * tokens / wall))
                (unclocked, _), (clocked, tok_s) = measured
                row = {"round": r, "streams": n, "tok_s": tok_s,
                       "unclocked_step_thread_python_us_per_token": unclocked["step_thread_python_us_per_token"],
                       **clocked}
                rows.append(row)
                parts = ", ".join(f"{k} {v:.1f}" for k, v in row["parts_us_per_token"].items() if abs(v) >= 0.5)
                print(f"round {r}, {n} streams: step thread Python "
                      f"{row['unclocked_step_thread_python_us_per_token']:.1f} us/token unclocked, "
                      f"{row['step_thread_python_us_per_token']:.1f} clocked; {parts}", flush=True)
        # The same steps with no decode between them: the step thread's
        # Python on caches the decode has not emptied. Last, since the
        # sequences' KV cells then stop matching what the scheduler holds.
        clock.parts_on, clock.skip_decode = False, True
        for r in range(rounds):
            for n in streams:
                step, compute, _ = await phase(n)
                hot = summarise({}, step, compute, n * tokens)["step_thread_python_us_per_token"]
                rows.append({"round": r, "streams": n, "no_decode": True,
                             "unclocked_step_thread_python_us_per_token": hot})
                print(f"round {r}, {n} streams, no decode between steps: step thread Python {hot:.1f} us/token",
                      flush=True)
    finally:
        await model.loop.stop()
        await channel.close()
        theirs.close()
        model.unload()
    return rows


def medians(rows: list[dict]) -> dict:
    out = {}
    for n in sorted({r["streams"] for r in rows}):
        got = [r for r in rows if r["streams"] == n and not r.get("no_decode")]
        parts = {k for r in got for k in r["parts_us_per_token"]}
        out[n] = {"unclocked_step_thread_python_us_per_token": statistics.median(
                      r["unclocked_step_thread_python_us_per_token"] for r in got),
                  "step_thread_python_us_per_token": statistics.median(r["step_thread_python_us_per_token"]
                                                                       for r in got),
                  "parts_us_per_token": dict(sorted(
                      ((k, statistics.median(r["parts_us_per_token"].get(k, 0.0) for r in got)) for k in parts),
                      key=lambda kv: -kv[1]))}
        hot = [r["unclocked_step_thread_python_us_per_token"] for r in rows
               if r["streams"] == n and r.get("no_decode")]
        if hot:
            hot_median = out[n]["no_decode_step_thread_python_us_per_token"] = statistics.median(hot)
            out[n]["after_decode_over_no_decode"] = round(
                out[n]["unclocked_step_thread_python_us_per_token"] / hot_median, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--output", default=str(ROOT / "bench/results/step_parts.json"))
    args = parser.parse_args()
    streams = [int(n) for n in args.streams.split(",")]
    rows = asyncio.run(run(streams, args.tokens, args.rounds, args.temperature))
    record = {"command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "machine": machine(),
              "temperature": args.temperature, "rounds": rows, "medians": medians(rows)}
    for n, row in record["medians"].items():
        print(f"{n} streams (medians): step thread Python {row['unclocked_step_thread_python_us_per_token']:.1f} "
              f"us/token unclocked, {row['step_thread_python_us_per_token']:.1f} clocked; "
              + ", ".join(f"{k} {v:.1f}" for k, v in row["parts_us_per_token"].items()), flush=True)
        if "no_decode_step_thread_python_us_per_token" in row:
            print(f"{n} streams (medians): with no decode between steps "
                  f"{row['no_decode_step_thread_python_us_per_token']:.1f} us/token; after each decode "
                  f"{row['after_decode_over_no_decode']}x that", flush=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
