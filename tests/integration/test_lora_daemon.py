"""LoRA adapters as repository models of a real daemon: listed, requested by
their own name over gRPC Generate, loaded with their base, inside the one
budget, and refused at load with a status and a reason when they cannot
serve. Slow: a daemon, the base and its adapters loaded more than once
take minutes on two shared cores; the runtime's own comparison with peft
(test_lora_torch.py) runs in `make test`."""

from __future__ import annotations

import json
import shutil

import grpc
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from daemon import MODELS, metric_sum, start_daemon
from lora_fixtures import RECIPES, cached_suite
from modeld.gen import generation_pb2 as g
from modeld.gen import generation_pb2_grpc as gg
from polling import wait_until
from test_lora_torch import BASE, NEW_TOKENS, PROMPTS

pytestmark = pytest.mark.slow

BASE_TOML = f"""format = "gguf"
backends = ["torch"]
artifact = "model.gguf"
isolation = "in-process"  # adapters live on the base's runtime, in the daemon

[torch]
compile = false
num_blocks = 256
context_length = 1024

[lora]
max_lora_rank = 16
max_loaded_loras = 2
"""


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
def repo(tmp_path_factory, suite):
    root = tmp_path_factory.mktemp("lora-repo")
    (root / BASE).mkdir()
    (root / BASE / "model.toml").write_text(BASE_TOML)
    (root / BASE / "model.gguf").symlink_to((MODELS / BASE / "model.gguf").resolve())
    for recipe in RECIPES:
        shutil.copytree(suite.root / recipe.name, root / recipe.name)
    # the same base on llama.cpp, which cannot apply them yet
    (root / "smollm2").mkdir()
    (root / "smollm2" / "model.toml").write_text('format = "gguf"\nbackends = ["llamacpp"]\n[llamacpp]\nn_ctx = 2048\n'
                                                 'n_slots = 2\n')
    (root / "smollm2" / "model.gguf").symlink_to((MODELS / "smollm2" / "model.gguf").resolve())
    return root


@pytest.fixture(scope="module")
def node(repo):
    proc = start_daemon("--no-preload", repository=repo)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def triton(node):
    client = tc.InferenceServerClient(node.address)
    yield client
    client.close()


def _generate(node, model: str, prompt: str) -> list[int]:
    with grpc.insecure_channel(node.address) as channel:
        request = g.GenerateRequest(model=model, prompt=prompt,
                                    sampling=g.SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        responses = list(gg.GenerationStub(channel).Generate(request, timeout=300))
    return [t for r in responses[:-1] for t in r.token_ids]


def _ready(triton, model: str) -> bool:
    return triton.is_model_ready(model)


def test_repository_index_lists_the_adapters(triton):
    names = {m["name"] for m in triton.get_model_repository_index(as_json=True)["models"]}
    assert {r.name for r in RECIPES} <= names


def test_an_adapter_named_as_the_model_loads_its_base_and_matches_peft(node, triton, suite):
    name = RECIPES[0].name
    assert _generate(node, name, PROMPTS[0]) == suite.references[name][PROMPTS[0]]
    assert _ready(triton, BASE) and _ready(triton, name)  # loaded on first use, base first
    # the base still answers as itself, and the adapter again, now from its own cached prompt blocks
    assert _generate(node, BASE, PROMPTS[0]) == suite.references[""][PROMPTS[0]]
    assert _generate(node, name, PROMPTS[0]) == suite.references[name][PROMPTS[0]]


def test_an_adapters_budget_entry_is_its_measured_bytes(node, triton):
    name = RECIPES[0].name
    triton.load_model(name)
    # q and v of 30 layers at rank 8 in float32: 30 * 8 * (576 + 576 + 576 + 192) * 4 bytes
    assert metric_sum(node, "modeld_loaded_bytes", model=name) == 30 * 8 * (576 + 576 + 576 + 192) * 4


def test_max_loaded_loras_unloads_the_least_recently_used_adapter(node, triton):
    first, second, third = (r.name for r in RECIPES)
    triton.load_model(first)
    triton.load_model(second)
    triton.load_model(third)  # the base's lora.max_loaded_loras is 2
    assert not _ready(triton, first) and _ready(triton, second) and _ready(triton, third)


def test_unloading_the_base_unloads_its_adapters(node, triton, suite):
    second, third = RECIPES[1].name, RECIPES[2].name
    triton.load_model(second)
    triton.unload_model(BASE)
    wait_until(lambda: not _ready(triton, BASE), timeout=60)
    assert not _ready(triton, second) and not _ready(triton, third)
    # a request names the adapter again: base and adapter come back
    assert _generate(node, third, PROMPTS[1]) == suite.references[third][PROMPTS[1]]


def _load_inline(triton, name: str, config: dict, files: dict[str, bytes]) -> str:
    with pytest.raises(InferenceServerException) as info:
        triton.load_model(name, config=json.dumps(config), files={f"file:{k}": v for k, v in files.items()})
    return f"{info.value.status()} {info.value.message()}"


def _adapter_files(suite, name: str = RECIPES[0].name) -> dict[str, bytes]:
    folder = suite.root / name
    return {f: (folder / f).read_bytes() for f in ("adapter_config.json", "adapter_model.safetensors")}


@pytest.mark.parametrize("case", ["unknown base", "rank above the limit", "unknown target", "truncated",
                                  "base on llama.cpp"])
def test_bad_adapters_are_refused_at_load_naming_the_adapter_and_the_reason(node, triton, suite, case):
    files = _adapter_files(suite)
    config = {"format": "lora", "base": BASE}
    adapter_config = json.loads(files["adapter_config.json"])
    want = "StatusCode.INVALID_ARGUMENT"
    if case == "unknown base":
        config["base"], reason = "no-such-model", "no-such-model"
    elif case == "rank above the limit":
        files = _adapter_files(suite, "smollm2-chat")  # rank 16: allowed; claim 32, over max_lora_rank 16
        adapter_config = {**json.loads(files["adapter_config.json"]), "r": 32}
        reason = "max_lora_rank"
    elif case == "unknown target":
        adapter_config["target_modules"] = ["q_proj", "lm_head"]
        reason = "lm_head"
    elif case == "truncated":
        files["adapter_model.safetensors"] = files["adapter_model.safetensors"][:5000]
        reason = "corrupt or truncated"
    else:
        config["base"], reason, want = "smollm2", "llamacpp", "StatusCode.FAILED_PRECONDITION"
    files["adapter_config.json"] = json.dumps(adapter_config).encode()
    message = _load_inline(triton, "bad-adapter", config, files)
    assert message.startswith(want) and "bad-adapter" in message and reason in message, message
    # the base keeps serving
    assert _generate(node, BASE, PROMPTS[2]) == _generate(node, BASE, PROMPTS[2])
