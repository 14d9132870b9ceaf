"""GGUF LoRA adapters over a llama.cpp base in a real daemon, the base in
the daemon and in a worker process: named as the
model over gRPC Generate they load their base first and give
llama-cpp-python's Llama(lora_path=...) tokens; their budget entry is
their measured bytes; a bad one is refused over RepositoryModelLoad with
INVALID_ARGUMENT naming it and the reason, and the base keeps serving.
Slow: a daemon and its loads; the runtime's comparisons run in `make test`
(test_lora_llamacpp.py)."""

from __future__ import annotations

import json
import shutil

import grpc
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from daemon import MODELS, metric_sum, start_daemon
from lora_gguf_fixtures import ADAPTER_FILE, RECIPES, cached_gguf_suite
from modeld.gen import generation_pb2 as g
from modeld.gen import generation_pb2_grpc as gg
from test_lora_llamacpp import BASE, NEW_TOKENS, PROMPTS

pytestmark = pytest.mark.slow

BASE_TOML = """format = "gguf"
backends = ["llamacpp"]
artifact = "model.gguf"
isolation = "{isolation}"

[llamacpp]
n_ctx = 4096
n_slots = 4
"""


@pytest.fixture(scope="module")
def suite():
    return cached_gguf_suite(PROMPTS, NEW_TOKENS, BASE)


# the adapters live on the base's runtime: in the daemon, or in the base's worker process
@pytest.fixture(scope="module", params=["in-process", "process"])
def node(tmp_path_factory, suite, request):
    root = tmp_path_factory.mktemp("lora-gguf-repo")
    (root / BASE).mkdir()
    (root / BASE / "model.toml").write_text(BASE_TOML.format(isolation=request.param))
    (root / BASE / "model.gguf").symlink_to((MODELS / BASE / "model.gguf").resolve())
    for recipe in RECIPES:
        shutil.copytree(suite.root / recipe.name, root / recipe.name)
    proc = start_daemon("--no-preload", repository=root)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def triton(node):
    client = tc.InferenceServerClient(node.address)
    yield client
    client.close()


def _generate(node, model: str, prompt: str) -> list[int]:
    with grpc.insecure_channel(node.address) as channel:
        request = g.GenerateRequest(model=model, prompt=prompt, sampling=g.SamplingParams(
            max_tokens=NEW_TOKENS, ignore_eos=True, cache_prompt=False))
        responses = list(gg.GenerationStub(channel).Generate(request, timeout=300))
    return [t for r in responses[:-1] for t in r.token_ids]


def test_an_adapter_named_as_the_model_loads_its_base_and_matches_llama_cpp_python(node, triton, suite):
    name = RECIPES[1].name
    assert _generate(node, name, PROMPTS[0]) == suite.references[name][PROMPTS[0]]
    assert triton.is_model_ready(BASE) and triton.is_model_ready(name)
    assert _generate(node, BASE, PROMPTS[0]) == suite.references[""][PROMPTS[0]]


def test_an_adapters_budget_entry_is_its_measured_bytes(node, triton):
    name = RECIPES[0].name
    triton.load_model(name)
    # f32 lora_a / lora_b of q and v, 30 layers, rank 8
    assert metric_sum(node, "modeld_loaded_bytes", model=name) == 30 * 8 * (576 + 576 + 576 + 192) * 4


def test_a_truncated_adapter_is_refused_naming_it_and_the_base_keeps_serving(node, triton, suite):
    good = suite.adapter_file(RECIPES[0].name).read_bytes()
    config = {"format": "lora", "base": BASE, "artifact": ADAPTER_FILE}
    with pytest.raises(InferenceServerException) as info:
        triton.load_model("bad-gguf", config=json.dumps(config), files={f"file:{ADAPTER_FILE}": good[:len(good) // 3]})
    message = f"{info.value.status()} {info.value.message()}"
    assert message.startswith("StatusCode.INVALID_ARGUMENT") and "bad-gguf" in message and "truncated" in message
    assert _generate(node, BASE, PROMPTS[2]) == suite.references[""][PROMPTS[2]]
    assert _generate(node, RECIPES[0].name, PROMPTS[2]) == suite.references[RECIPES[0].name][PROMPTS[2]]
