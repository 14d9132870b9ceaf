"""Issue 30: modeld's OpenAI endpoint and llama.cpp's llama-server under a
benchmark harness neither of us wrote: NVIDIA's aiperf (PyPI `aiperf`, in
its own environment, bench/peers/aiperf_env.sh), run as a user would run it:

    aiperf profile --endpoint-type chat --streaming --concurrency C
        --synthetic-input-tokens-mean 128 --output-tokens-mean 64 ...

Same SmolLM2 GGUF (models/smollm2/model.gguf) on both sides, same llama.cpp
(llama-server built from the llama-cpp-python sdist our venv runs:
bench/peers/llama_server.sh), llama-server with -np 8 slots and 2 threads.
Sampling is each server's default for a request that names none (aiperf
sends no temperature); ignore_eos makes every answer 64 tokens on both.

Both servers stay up for a round; each aiperf run starts once both are idle
(racing.settle), and sends each request on a connection of its own (aiperf's
pool wrote requests into keep-alive connections llama-server had closed).
A side's failed requests are recorded with their cause (`errors`).
Per round, per concurrency (8, 32) and per placement of the harness:
unpinned (as a user runs it: harness and server share both cores) and
pinned (`taskset -c 1`: the harness on one core; the server still sees
both), the sides run in an order that alternates between rounds.
Ratios are modeld / llama-server per round, reported as medians: output
token throughput (higher is better), time to first token p50 and
inter-token latency p50 (lower is better).

Where vLLM's CPU build is set up (`.venv-vllm` and the Hugging Face copy
of the weights in var/hf/smollm2, both from `make test-remote`), two more
sides run in the same rounds: vLLM serving those weights (float32) and
modeld's torch runtime serving the same weights (`smollm2-torch`), each in
a server of its own; their ratios (modeld-torch / vLLM) are reported
beside the llama.cpp pair's. Every cell of the race (round, concurrency,
placement) draws prompts of its own (cell_seed).
vLLM gets both cores for its compute (VLLM_CPU_NUM_OF_RESERVED_CPU=0,
VLLM_CPU_OMP_THREADS_BIND=0-1, OMP_NUM_THREADS=2; by default it keeps one
of two cores for itself) and otherwise its defaults, prefix caching
included, as modeld keeps its prefix cache.
`--vllm off` leaves them out, `--vllm on` fails where vLLM is missing.

--omp-wait-policy PASSIVE,ACTIVE races two modeld daemons in the same
rounds, one per OpenMP wait policy of llama.cpp's compute threads
(OMP_WAIT_POLICY; unless the environment gives it or GOMP_SPINCOUNT,
modeld runs PASSIVE with a 300-turn spin):
sides "modeld" (the first policy) and "modeld-ACTIVE", each against
llama-server, and ACTIVE against PASSIVE. A policy may instead be
`+`-joined KEY=VALUE environment entries (`GOMP_SPINCOUNT=0`: pure
PASSIVE), and an empty one is modeld's default (`,GOMP_SPINCOUNT=0`). An
entry whose KEY has a dot sets an option of smollm2's model.toml for that
side instead (`llamacpp.max_prefill_tokens=128`).

    .venv/bin/python bench/bench_aiperf.py [--rounds 2] [--concurrency 8,32] [--placements unpinned,pinned] [--waves 2]
                                           [--omp-wait-policy PASSIVE[,ACTIVE]] [--vllm auto|on|off]

Writes bench/results/aiperf.json.
"""

from __future__ import annotations

import argparse
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
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests/remote"))
from bench_llama_server import PEER_BIN, LlamaServer  # noqa: E402
from racing import goal, machine, median_ratio, round_order, settle  # noqa: E402
from vllm_server import SERVED_NAME, VllmServer  # noqa: E402
from vllm_server import missing as vllm_missing  # noqa: E402

AIPERF = ROOT / ".venv-aiperf/bin/aiperf"
TOKENIZER = ROOT / "var/hf/smollm2"
RESULTS = ROOT / "bench/results"
INPUT_TOKENS, OUTPUT_TOKENS = 128, 64
WARMUP_REQUESTS = 4


class ModeldHttp:
    """modeld serve with one model loaded (smollm2: llama.cpp; smollm2-torch:
    the torch runtime), its OpenAI API on a free port."""

    def __init__(self, wait_policy: str = "", model: str = "smollm2") -> None:
        from daemon import start_daemon

        env, options = policy_env(wait_policy), model_options(wait_policy)
        self.repository = None
        repository = ROOT / "models"
        if options:
            self.repository = Path(tempfile.mkdtemp(prefix="modeld-aiperf-"))
            repository = with_options(self.repository, options)
        self.daemon = start_daemon("--metrics-port", "-1", "--no-preload", repository=repository, env=env)
        import tritonclient.grpc as tc

        client = tc.InferenceServerClient(self.daemon.address)
        client.load_model(model)
        client.close()
        self.url = self.daemon.http_url
        self.pid = self.daemon.proc.pid
        self.model = model

    def stop(self) -> None:
        self.daemon.stop()
        if self.repository is not None:
            shutil.rmtree(self.repository, ignore_errors=True)


def _entries(policy: str) -> list[tuple[str, str]]:
    if not policy:
        return []
    if "=" not in policy:
        return [("OMP_WAIT_POLICY", policy)]
    return [tuple(entry.split("=", 1)) for entry in policy.split("+")]


def policy_env(policy: str) -> dict | None:
    """A side's environment: "" for modeld's own, a bare OMP_WAIT_POLICY value, or KEY=VALUE[+KEY=VALUE]
    (a KEY with a dot is a model option instead, see model_options)."""
    env = {key: value for key, value in _entries(policy) if "." not in key}
    return env or None


def model_options(policy: str) -> dict[tuple[str, str], str]:
    """A side's smollm2 model.toml options: SECTION.KEY=VALUE entries (llamacpp.max_prefill_tokens=128)."""
    return {tuple(key.split(".", 1)): value for key, value in _entries(policy) if "." in key}


def with_options(folder: Path, options: dict[tuple[str, str], str]) -> Path:
    """A repository in folder holding smollm2 (and its draft) with options set
    in smollm2's model.toml; every other file is a link to the shipped one."""
    import tomllib

    for name in ("smollm2", "smollm2-draft"):
        source, target = ROOT / "models" / name, folder / name
        target.mkdir()
        for item in source.iterdir():
            if item.name != "model.toml" or name != "smollm2":
                (target / item.name).symlink_to(item.resolve())
    lines, section = [], ""
    for line in (ROOT / "models/smollm2/model.toml").read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("[") and stripped.endswith("]"):
            section = stripped[1:-1]
        key = stripped.split("=", 1)[0].strip() if "=" in stripped and not stripped.startswith("#") else ""
        lines.append(f"{key} = {options[(section, key)]}" if (section, key) in options else line)
    text = "\n".join(lines) + "\n"
    config = tomllib.loads(text)
    for (section, key), value in options.items():
        if config.get(section, {}).get(key) != tomllib.loads(f"v = {value}")["v"]:
            sys.exit(f"model option {section}.{key} is not in smollm2's model.toml")
    (folder / "smollm2/model.toml").write_text(text)
    return folder


class AiperfVllm(VllmServer):
    """vLLM as a user would start it for this race: its defaults, both cores."""

    def environment(self) -> dict[str, str]:
        return {**super().environment(), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                "OMP_NUM_THREADS": "2"}


class VllmSide:
    """A started AiperfVllm as a side of the race."""

    def __init__(self) -> None:
        self.server = AiperfVllm().start()
        self.url, self.pid, self.model = self.server.url, self.server.proc.pid, SERVED_NAME

    def stop(self) -> None:
        self.server.stop()


class LlamaServerSide:
    def __init__(self) -> None:
        self.server = LlamaServer()
        self.url, self.pid, self.model = self.server.url, self.server.proc.pid, "smollm2"

    def stop(self) -> None:
        self.server.stop()


def aiperf(url: str, concurrency: int, pinned: bool, artifacts: Path, waves: int, model: str = "smollm2",
           seed: int = 7) -> dict:
    """One aiperf profile run; its summary figures. `seed` picks aiperf's
    synthetic prompts: the same for every side of one cell of the race."""
    cmd = [str(AIPERF), "profile", "--url", url, "-m", model, "--endpoint-type", "chat", "--streaming",
           "--tokenizer", str(TOKENIZER), "--use-server-token-count", "--concurrency", str(concurrency),
           "--request-count", str(concurrency * waves),
           "--warmup-request-count", str(WARMUP_REQUESTS),
           "--synthetic-input-tokens-mean", str(INPUT_TOKENS), "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(OUTPUT_TOKENS), "--output-tokens-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--random-seed", str(seed),
           # a connection per request: llama-server (cpp-httplib) closes a keep-alive
           # connection idle for 5 s, and aiperf's pool then wrote requests into closed
           # ones (ClientOSError, 1-3 failed requests a run, left out of its figures)
           "--connection-reuse-strategy", "never",
           "--artifact-dir", str(artifacts), "--ui", "none"]
    if pinned:
        cmd = ["taskset", "-c", "1"] + cmd
    # aiperf resolves a local tokenizer folder as a hub repo id when offline
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    started = time.monotonic()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"aiperf failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    found = sorted(artifacts.rglob("profile_export_aiperf.json"))
    if not found:
        raise RuntimeError(f"aiperf wrote no profile_export_aiperf.json under {artifacts}")
    data = json.loads(found[-1].read_text())

    def metric(name: str) -> dict:
        value = data.get(name) or data.get("records", {}).get(name) or {}
        return {k: value.get(k) for k in ("avg", "p50", "p90", "p99", "unit") if k in value}

    return {"output_token_throughput": metric("output_token_throughput"),
            "time_to_first_token": metric("time_to_first_token"),
            "inter_token_latency": metric("inter_token_latency"),
            "request_count": metric("request_count"), "error_request_count": metric("error_request_count"),
            "errors": errors(data), "wall_s": time.monotonic() - started}


def errors(data: dict) -> list[dict]:
    """aiperf's failed requests by cause (its error_summary): a failed
    request leaves the side's throughput and latency figures, so a side
    with failures must say why."""
    out = []
    for entry in data.get("error_summary") or []:
        details = entry.get("error_details") or {}
        out.append({"count": entry.get("count"), "code": details.get("code"), "type": details.get("type"),
                    "message": str(details.get("message") or "")[:300]})
    return out


def race(rounds: int, concurrencies: list[int], placements: list[str], waves: int,
         policies: list[str], with_vllm: bool = False) -> list[dict]:
    runs = []
    sides = sides_of(policies)
    everyone = sides + ["llama-server"] + (TORCH_PAIR if with_vllm else [])
    with tempfile.TemporaryDirectory(prefix="modeld-aiperf-") as tmp:
        for r in range(rounds):
            # the first policy is the side named "modeld"; "" leaves modeld's own default. An
            # ACTIVE daemon's idle OpenMP team spins for seconds on end, on the cores the
            # other sides run on: it is up only for its own runs
            policy_of = dict(zip(sides, policies))
            nodes: dict = {}
            try:
                nodes.update({side: ModeldHttp(policy) for side, policy in policy_of.items() if policy != "ACTIVE"})
                nodes["llama-server"] = LlamaServerSide()
                if with_vllm:
                    nodes["vllm"] = VllmSide()
                    nodes["modeld-torch"] = ModeldHttp(model="smollm2-torch")
                got: dict = {"round": r, "first": round_order(everyone, r)[0]}
                for concurrency in concurrencies:
                    for placement in placements:
                        for side in round_order(everyone, r):
                            if side not in nodes:
                                nodes[side] = ModeldHttp(policy_of[side])  # aiperf's warmup requests warm it
                            settle([n.pid for n in nodes.values()])
                            node = nodes[side]
                            artifacts = Path(tmp) / f"r{r}-c{concurrency}-{placement}-{side}"
                            figures = aiperf(node.url, concurrency, placement == "pinned", artifacts, waves, node.model,
                                             cell_seed(r, concurrency, placement))
                            if policy_of.get(side) == "ACTIVE":
                                nodes.pop(side).stop()
                            shutil.rmtree(artifacts, ignore_errors=True)
                            got[f"{side} c{concurrency} {placement}"] = figures
                            print(f"round {r}, {side}, concurrency {concurrency}, {placement}: "
                                  f"{figures['output_token_throughput'].get('avg', 0):.1f} tok/s, ttft p50 "
                                  f"{figures['time_to_first_token'].get('p50', 0):.0f} ms, itl p50 "
                                  f"{figures['inter_token_latency'].get('p50', 0):.1f} ms"
                                  + "".join(f"; {e['count']} failed: {e['code']} {e['message'][:120]}"
                                            for e in figures["errors"]), flush=True)
            finally:
                for node in nodes.values():
                    node.stop()
            runs.append(got)
    return runs


def cell_seed(round_index: int, concurrency: int, placement: str) -> int:
    """aiperf's prompt seed for one (round, concurrency, placement) cell.
    Every cell gets prompts of its own: replayed prompts would reach a
    server's prompt cache from its earlier runs in the round (llama-server
    keeps up to 8 GiB of prompt state in host memory by default,
    --cache-ram), so later cells would time cache hits, not prefills."""
    return 7 + 1000 * round_index + 10 * concurrency + (1 if placement == "pinned" else 0)


# the torch runtime's pair: modeld serving smollm2-torch, and vLLM on the same weights
TORCH_PAIR = ["vllm", "modeld-torch"]


def sides_of(policies: list[str]) -> list[str]:
    """The modeld sides' names: "modeld" for the first policy, "modeld-POLICY" for the others."""
    return ["modeld"] + [f"modeld-{p}" for p in policies[1:]]


def summarise(runs: list[dict], concurrencies: list[int], placements: list[str], policies: list[str],
              with_vllm: bool = False) -> dict:
    out = {}
    sides = sides_of(policies)
    for concurrency in concurrencies:
        for placement in placements:
            key = f"c{concurrency} {placement}"

            def series(side: str, metric: str, stat: str) -> list[float]:
                return [g[f"{side} {key}"][metric][stat] for g in runs]

            def ratios_of(side: str, against: str) -> dict:
                return {"output_token_throughput": median_ratio(series(side, "output_token_throughput", "avg"),
                                                                series(against, "output_token_throughput", "avg")),
                        "time_to_first_token_p50": median_ratio(series(side, "time_to_first_token", "p50"),
                                                                series(against, "time_to_first_token", "p50")),
                        "inter_token_latency_p50": median_ratio(series(side, "inter_token_latency", "p50"),
                                                                series(against, "inter_token_latency", "p50"))}
            mine = ratios_of("modeld", "llama-server")
            out[key] = {
                "medians": {f"{side} {m}": statistics.median(series(side, m, s))
                            for side in sides + ["llama-server"] + (TORCH_PAIR if with_vllm else [])
                            for m, s in (("output_token_throughput", "avg"), ("time_to_first_token", "p50"),
                                         ("inter_token_latency", "p50"))},
                "goals": {"output throughput vs llama-server": goal(mine["output_token_throughput"], 1.0),
                          "ttft p50 vs llama-server": goal(mine["time_to_first_token_p50"], 1.0,
                                                           higher_is_better=False),
                          "itl p50 vs llama-server": goal(mine["inter_token_latency_p50"], 1.0,
                                                          higher_is_better=False)},
            }
            for side in sides[1:]:
                out[key][f"{side} vs llama-server"] = ratios_of(side, "llama-server")
                out[key][f"{side} vs modeld"] = ratios_of(side, "modeld")
            if with_vllm:
                out[key]["modeld-torch vs vllm"] = ratios_of("modeld-torch", "vllm")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--placements", default="unpinned,pinned")
    parser.add_argument("--waves", type=int, default=2, help="requests per run: concurrency x waves")
    parser.add_argument("--omp-wait-policy", default="",
                        help="comma-separated OMP_WAIT_POLICY values, one modeld daemon each (default: modeld's own)")
    parser.add_argument("--vllm", choices=["auto", "on", "off"], default="auto",
                        help="race vLLM CPU and modeld's torch runtime too (auto: where .venv-vllm is set up)")
    parser.add_argument("--output", default=str(RESULTS / "aiperf.json"))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # modeld's side; aiperf's own env drops it
    for need, how in ((AIPERF, "make aiperf-env"), (PEER_BIN / "llama-server", "make llama-peer"),
                      (TOKENIZER / "tokenizer.json", "make var/hf/smollm2/.modeld-complete")):
        if not need.exists():
            sys.exit(f"{need.relative_to(ROOT)} is missing: run `{how}` (or `make bench`)")
    if os.cpu_count() < 2 and "pinned" in args.placements:
        sys.exit("a pinned run needs two cores (the harness on core 1)")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    placements = args.placements.split(",")
    before = machine()
    policies = args.omp_wait_policy.split(",") if args.omp_wait_policy else [""]
    if any(p not in ("", "PASSIVE", "ACTIVE") and "=" not in p for p in policies):
        sys.exit(f"--omp-wait-policy takes PASSIVE, ACTIVE and KEY=VALUE entries, got {args.omp_wait_policy!r}")
    why_not = vllm_missing()
    if args.vllm == "on" and why_not:
        sys.exit(f"--vllm on: {why_not}")
    with_vllm = args.vllm == "on" or (args.vllm == "auto" and why_not is None)
    if args.vllm == "auto" and why_not:
        print(f"vLLM left out: {why_not}", flush=True)
    runs = race(args.rounds, concurrencies, placements, args.waves, policies, with_vllm)
    summary = summarise(runs, concurrencies, placements, policies, with_vllm)
    record = {"command": "python bench/bench_aiperf.py " + " ".join(sys.argv[1:]), "harness": "aiperf",
              "aiperf_version": subprocess.run([str(ROOT / ".venv-aiperf/bin/python"), "-c",
                                                "import importlib.metadata as m; print(m.version('aiperf'))"],
                                               capture_output=True, text=True).stdout.strip(),
              "machine": before, "load_average_after": list(os.getloadavg()),
              "omp_wait_policy": {side: policy or "modeld's default"
                                  for side, policy in zip(sides_of(policies), policies)},
              "vllm": {"command": AiperfVllm().command(), "served_name": SERVED_NAME} if with_vllm else None,
              "input_tokens": INPUT_TOKENS, "output_tokens": OUTPUT_TOKENS, "rounds": runs, "summary": summary}
    path = Path(args.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    for key, row in summary.items():
        print(f"{key}: " + ", ".join(f"{name} {g['ratio']:.2f}x ({'met' if g['met'] else 'missed'})"
                                     for name, g in row["goals"].items()))
        if "modeld-torch vs vllm" in row:
            print(f"{key}: modeld-torch vs vLLM " + ", ".join(f"{name} {ratio:.2f}x"
                                                              for name, ratio in row["modeld-torch vs vllm"].items()))


if __name__ == "__main__":
    main()
