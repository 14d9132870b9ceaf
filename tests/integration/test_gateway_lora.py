"""LoRA adapters behind the gateway: three real daemons share one repository
holding a torch base and two of its adapters, and every call naming an
adapter goes to the node the ring gives the base, whatever the ring gives
the adapter's own name, so the base loads once in the fleet. The gateway
learns each adapter's base from the nodes' Stats (ModelLoad.base), which
list the repository before anything is loaded. Slow: a torch base loading
on a shared 2-core machine, and peft's adapters made the first time."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from daemon import MODELS, metric_sum, start_daemon, start_gateway
from lora_fixtures import RECIPES, cached_suite
from modeld.gen import generation_pb2 as g
from modeld.gen import generation_pb2_grpc as gg
from modeld.server.gateway.ring import HashRing
from polling import wait_until
from test_lora_torch import BASE, NEW_TOKENS, PROMPTS

pytestmark = pytest.mark.slow

BASE_TOML = """format = "gguf"
backends = ["torch"]
artifact = "model.gguf"
isolation = "in-process"  # adapters live on the base's runtime, in the daemon

[torch]
compile = false
num_blocks = 128
context_length = 512

[lora]
max_lora_rank = 16
"""


@pytest.fixture(scope="module")
def suite():
    from transformers import AutoTokenizer

    path = (MODELS / BASE / "model.gguf").resolve()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return cached_suite(PROMPTS, lambda text: list(tokenizer(text)["input_ids"]), NEW_TOKENS, BASE)


def _names_homed_elsewhere(ring: HashRing, base_home: str, stem: str) -> str:
    """A name the ring puts on another node than the base: a gateway that
    hashed the adapter's own name would then send it there."""
    return next(n for n in (f"{stem}-{i}" for i in range(200)) if ring.replicas(n, 1)[0] != base_home)


def _generate(address: str, model: str, prompt: str) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        request = g.GenerateRequest(model=model, prompt=prompt,
                                    sampling=g.SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        replies = list(gg.GenerationStub(channel).Generate(request, timeout=300))
    return [t for r in replies[:-1] for t in r.token_ids]


def test_adapters_land_on_the_node_of_their_base(tmp_path, suite):
    repo = tmp_path / "repo"
    (repo / BASE).mkdir(parents=True)
    (repo / BASE / "model.toml").write_text(BASE_TOML)
    (repo / BASE / "model.gguf").symlink_to((MODELS / BASE / "model.gguf").resolve())
    with ThreadPoolExecutor(3) as pool:
        daemons = list(pool.map(lambda _: start_daemon("--no-preload", repository=repo), range(3)))
    gateway = None
    try:
        # the gateway names static nodes by address; its ring is this one
        ring = HashRing(150)
        for d in daemons:
            ring.add(d.address)
        base_home = ring.replicas(BASE, 1)[0]
        # the repository is read on each listing: adapters added now are listed
        adapters = []
        for recipe in RECIPES[:2]:
            name = _names_homed_elsewhere(ring, base_home, recipe.name)
            shutil.copytree(suite.root / recipe.name, repo / name)
            adapters.append((name, recipe.name))
        # an in-process torch load holds the daemon's interpreter for seconds
        # at a time on a busy machine: a late Stats answer must not read as a
        # frozen node (the call would move off the base's home)
        config = tmp_path / "gateway.toml"
        config.write_text("[gateway]\nstats_timeout_s = 20.0\n")
        gateway = start_gateway(*(d.address for d in daemons), args=("--replicas", "1", "--config", str(config)))
        wait_until(lambda: metric_sum(gateway, "modeld_gateway_node_serving") == 3, 60, "every node serving")
        address = f"127.0.0.1:{gateway.port}"
        for (name, recipe), prompt in zip(adapters, PROMPTS):
            assert _generate(address, name, prompt) == suite.references[recipe][prompt]
        # the OpenAI route through the gateway's HTTP front is placed the same way
        reply = httpx.post(f"http://127.0.0.1:{gateway.http_port}/v1/completions", timeout=300,
                           json={"model": adapters[0][0], "prompt": PROMPTS[2], "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        home = next(d for d in daemons if d.address == base_home)
        served = {d.address: sum(metric_sum(d, "modeld_requests_total", model=n) for n, _ in adapters)
                  for d in daemons}
        assert served[base_home] >= 3 and sum(served.values()) == served[base_home], served
        # the base loaded on its home only
        assert metric_sum(home, "modeld_loaded_bytes", model=BASE) > 0
        assert all(metric_sum(d, "modeld_loaded_bytes", model=BASE) == 0 for d in daemons if d is not home)
        picks = {d.address: metric_sum(gateway, "modeld_gateway_picks_total", node=d.address) for d in daemons}
        assert picks[base_home] >= 3 and sum(picks.values()) == picks[base_home], picks
    finally:
        for process in [p for p in (gateway, *daemons) if p is not None]:
            if process.proc.poll() is None:
                process.stop()
