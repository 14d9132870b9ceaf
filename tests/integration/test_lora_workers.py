"""LoRA adapters of a torch base that runs in a worker process (the daemon's
default isolation, auto, puts torch there): each adapter is loaded inside
the base's worker and its requests run there, on the base's loop, mixed
with the base's and the other adapter's in one step; greedy tokens equal
transformers + peft on the same weights. The base's unload takes its
adapters along, and when the worker dies no adapter stays served on it:
both are marked unloaded, saying why, and the next request naming one loads
the base and the adapter again in a new worker."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import tritonclient.grpc as tc

from daemon import MODELS, metric_sum, start_daemon
from lora_fixtures import RECIPES, cached_suite
from modeld.gen import generation_pb2 as g
from modeld.gen import generation_pb2_grpc as gg
from polling import wait_until
from modeld.gen import node_pb2, node_pb2_grpc
from test_kv_events_workers import _holds, _watch_until
from test_lora_torch import BASE, NEW_TOKENS, PROMPTS
from test_workers import worker_pids

# no isolation key: the daemon's default (auto) runs the torch base in a worker
BASE_TOML = """format = "gguf"
backends = ["torch"]
artifact = "model.gguf"

[torch]
compile = false
num_blocks = 256
context_length = 1024

[lora]
max_lora_rank = 16
max_loaded_loras = 2
"""
SQL, CHAT = RECIPES[0].name, RECIPES[1].name
LONG_PROMPT = "SELECT name, email FROM users WHERE signup_date > '2024-01-01' AND country = 'FR' ORDER BY name; " * 3


@pytest.fixture(scope="module")
def tokenize():
    from transformers import AutoTokenizer

    path = (MODELS / BASE / "model.gguf").resolve()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return lambda text: list(tokenizer(text)["input_ids"])


@pytest.fixture(scope="module")
def suite(tokenize):
    return cached_suite(PROMPTS, tokenize, NEW_TOKENS, BASE)


@pytest.fixture(scope="module")
def node(tmp_path_factory, suite):
    root = tmp_path_factory.mktemp("lora-worker-repo")
    (root / BASE).mkdir()
    (root / BASE / "model.toml").write_text(BASE_TOML)
    (root / BASE / "model.gguf").symlink_to((MODELS / BASE / "model.gguf").resolve())
    for name in (SQL, CHAT):
        shutil.copytree(suite.root / name, root / name)
    # loads at the normal priority: on a shared test machine a nice-10 load of
    # the torch base in a fresh worker took over 300 s (its load timeout)
    proc = start_daemon("--no-preload", repository=root,
                        env={"MODELD_WORKER_RESTART_BACKOFF_S": "0.5", "MODELD_WORKER_RESTART_BACKOFF_MAX_S": "2",
                             "MODELD_LOAD_NICENESS": "0"})
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def triton(node):
    client = tc.InferenceServerClient(node.address)
    yield client
    client.close()


def _generate(node, model: str, prompt: str, max_tokens: int = NEW_TOKENS) -> list[int]:
    with grpc.insecure_channel(node.address) as channel:
        request = g.GenerateRequest(model=model, prompt=prompt,
                                    sampling=g.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        responses = list(gg.GenerationStub(channel).Generate(request, timeout=300))
    return [t for r in responses[:-1] for t in r.token_ids]


def _generate_when_restarted(node, model: str, prompt: str) -> list[int]:
    """_generate, retried while the crashed worker's restart backoff refuses it."""
    def attempt():
        try:
            return _generate(node, model, prompt)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            return None
    return wait_until(attempt, 120, f"{model} served again", interval=0.5)


def _prompt_blocks(node, model: str, prompt: str = LONG_PROMPT) -> list[int]:
    request = node_pb2.PromptBlocksRequest(generate=g.GenerateRequest(model=model, prompt=prompt).SerializeToString())
    with grpc.insecure_channel(node.address) as channel:
        return list(node_pb2_grpc.NodeStub(channel).PromptBlocks(request, timeout=60).hashes)


def _cached_tokens(node, model: str, prompt: str = LONG_PROMPT) -> int:
    with grpc.insecure_channel(node.address) as channel:
        replies = list(gg.GenerationStub(channel).Generate(g.GenerateRequest(
            model=model, prompt=prompt, sampling=g.SamplingParams(max_tokens=2)), timeout=300))
    return replies[-1].usage.cached_prompt_tokens


def _status(triton, model: str) -> dict:
    return next(m for m in triton.get_model_repository_index(as_json=True)["models"] if m["name"] == model)


# slow too: a torch base in a worker compiling for its adapter takes about half a minute, and
# the default suite's 20 minutes are spent; test_lora_torch covers the adapter maths there
@pytest.mark.slow
def test_an_adapter_of_a_worker_base_runs_in_its_worker_and_matches_peft(node, triton, suite):
    assert _generate(node, SQL, PROMPTS[0]) == suite.references[SQL][PROMPTS[0]]
    assert triton.is_model_ready(BASE) and triton.is_model_ready(SQL)  # loaded on first use, base first
    # the base in a worker of its own; the adapter in no process of its own (it lives in the base's)
    assert len(worker_pids(node, BASE)) == 1 and not worker_pids(node, SQL)
    assert _generate(node, BASE, PROMPTS[0]) == suite.references[""][PROMPTS[0]]
    # its budget entry is its matrices as the worker measured them: q and v of 30 layers at rank 8, float32
    assert metric_sum(node, "modeld_loaded_bytes", model=SQL) == 30 * 8 * (576 + 576 + 576 + 192) * 4


@pytest.mark.slow
def test_the_base_and_two_adapters_share_steps_in_the_worker(node, triton, suite):
    triton.load_model(CHAT)
    prompts = PROMPTS[1:3]
    jobs = [(model, p) for model in ("", SQL, CHAT) for p in prompts]
    most_running = [0.0]
    done = threading.Event()

    def watch_running() -> None:  # the base's loop runs every sequence: its running count covers all three
        while not done.is_set():
            most_running[0] = max(most_running[0], metric_sum(node, "modeld_running_sequences", model=BASE))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch_running)
    watcher.start()
    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda job: _generate(node, job[0] or BASE, job[1]), jobs))
    finally:
        done.set()
        watcher.join()
    for (model, prompt), tokens in zip(jobs, results):
        assert tokens == suite.references[model][prompt], (model or "base", prompt)
    # two sequences per model: five or more running at once is at least two models in one step
    assert most_running[0] >= 5, most_running


@pytest.mark.slow
def test_an_adapters_blocks_in_the_worker_hash_under_its_own_salt(node, triton):
    for model in (SQL, BASE):
        _cached_tokens(node, model)
    adapter, base = _prompt_blocks(node, SQL), _prompt_blocks(node, BASE)
    # the same prompt, as many blocks, none alike: a prompt cached under one is never served to the other
    assert len(adapter) == len(base) >= 4 and not set(adapter) & set(base)
    # each as the worker's cache stored it (under the adapter's name: its base's cache)
    _watch_until(node, lambda index, kinds: _holds(SQL, adapter, "paged")(index, kinds)
                 and _holds(BASE, base, "paged")(index, kinds), "the adapter's and the base's blocks")
    assert _cached_tokens(node, SQL) == 16 * len(adapter)  # its own blocks serve it again


@pytest.mark.slow
def test_unloading_the_worker_base_unloads_its_adapters(node, triton, suite):
    triton.load_model(SQL)
    triton.load_model(CHAT)
    triton.unload_model(BASE)
    wait_until(lambda: not triton.is_model_ready(BASE), 60, "the base unloaded")
    assert not triton.is_model_ready(SQL) and not triton.is_model_ready(CHAT)
    wait_until(lambda: not worker_pids(node, BASE), 60, "the base's worker gone")
    # a request names the adapter again: base (in a new worker) and adapter come back
    assert _generate(node, CHAT, PROMPTS[3]) == suite.references[CHAT][PROMPTS[3]]
    assert len(worker_pids(node, BASE)) == 1


@pytest.mark.slow
def test_a_dead_worker_leaves_no_adapter_served_and_the_next_request_reloads_it(node, triton, suite):
    assert _generate(node, SQL, PROMPTS[4]) == suite.references[SQL][PROMPTS[4]]
    triton.load_model(CHAT)
    [pid] = worker_pids(node, BASE)
    salted = _prompt_blocks(node, SQL)
    in_flight: dict = {}
    streaming = threading.Event()

    def long_generation() -> None:
        request = g.GenerateRequest(model=CHAT, prompt=PROMPTS[5],
                                    sampling=g.SamplingParams(max_tokens=600, ignore_eos=True))
        try:
            with grpc.insecure_channel(node.address) as channel:
                for _ in gg.GenerationStub(channel).Generate(request, timeout=300):
                    streaming.set()
        except grpc.RpcError as exc:
            in_flight["error"] = exc
        finally:
            streaming.set()

    caller = threading.Thread(target=long_generation)
    caller.start()
    assert streaming.wait(120) and "error" not in in_flight, in_flight
    os.kill(pid, signal.SIGKILL)
    caller.join(120)
    assert in_flight["error"].code() == grpc.StatusCode.UNAVAILABLE, in_flight
    # neither adapter stays served on the dead worker; each says why it is not
    wait_until(lambda: not triton.is_model_ready(BASE), 60, "the base dropped")
    for name in (SQL, CHAT):
        assert not triton.is_model_ready(name), name
        assert "worker died" in _status(triton, name).get("reason", ""), _status(triton, name)
    # the next request naming an adapter loads the base in a new worker, then
    # the adapter in it: the adapter's own tokens, not the base's
    assert _generate_when_restarted(node, SQL, PROMPTS[4]) == suite.references[SQL][PROMPTS[4]]
    [new_pid] = worker_pids(node, BASE)
    assert new_pid != pid
    # the adapter's salt is its identity, not its load order: the new worker hashes its prompts alike
    assert _prompt_blocks(node, SQL) == salted
    assert not triton.is_model_ready(CHAT)  # loaded again only when asked for
    assert _generate(node, CHAT, PROMPTS[0]) == suite.references[CHAT][PROMPTS[0]]
