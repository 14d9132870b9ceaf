"""LoRA adapters of the embedded SmolLM2, made at test time with `peft`.

Hugging Face's LlamaForCausalLM reads the same GGUF the torch runtime
serves (transformers dequantizes it), peft wraps it with random, non-zero A
and B (its default B is zero: a no-op adapter would test nothing), and
save_pretrained writes the PEFT layout: adapter_config.json +
adapter_model.safetensors. The same peft model computes the reference
continuations, so runtime and reference run exactly the same weights.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from daemon import MODELS

BASE_GGUF = MODELS / "smollm2-torch" / "model.gguf"
ATTENTION_QV = ["q_proj", "v_proj"]
EVERY_PROJECTION = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class AdapterRecipe:
    name: str
    rank: int
    alpha: int
    targets: tuple[str, ...]
    seed: int
    use_rslora: bool = False


# two ranks, two target sets, and rsLoRA's scaling on one
RECIPES = (
    AdapterRecipe("smollm2-sql", 8, 16, tuple(ATTENTION_QV), seed=1),
    AdapterRecipe("smollm2-chat", 16, 32, tuple(EVERY_PROJECTION), seed=2),
    AdapterRecipe("smollm2-rs", 8, 8, tuple(EVERY_PROJECTION), seed=3, use_rslora=True),
)

# scale of the random A and B entries: large enough that each adapter's
# greedy text parts from the base's within a few tokens, small enough that
# it stays text rather than noise
WEIGHT_SCALE = 0.05


def hf_base():
    from transformers import AutoModelForCausalLM

    path = BASE_GGUF.resolve()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    return model.eval()


def make_adapter(base_model, recipe: AdapterRecipe, folder: Path):
    """peft's LoRA of base_model per recipe, saved to folder; returns the peft model."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=recipe.rank, lora_alpha=recipe.alpha, target_modules=list(recipe.targets),
                        lora_dropout=0.0, bias="none", use_rslora=recipe.use_rslora, task_type="CAUSAL_LM",
                        init_lora_weights=False)
    peft_model = get_peft_model(base_model, config, adapter_name="default")
    generator = torch.Generator().manual_seed(recipe.seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * WEIGHT_SCALE)
    peft_model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(folder))
    return peft_model


def write_adapter_toml(folder: Path, base: str) -> None:
    (folder / "model.toml").write_text(f'format = "lora"\nbase = "{base}"\n')


def greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    """new_tokens argmax tokens, end-of-sequence included and passed (the
    runtime is asked with ignore_eos), through the model's own KV cache."""
    out: list[int] = []
    past, step = None, torch.tensor([ids])
    with torch.inference_mode():
        for _ in range(new_tokens):
            result = model(input_ids=step, past_key_values=past, use_cache=True)
            past = result.past_key_values
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            step = torch.tensor([[token]])
    return out


@dataclass
class AdapterSuite:
    """Adapters saved under root/<name>/ and each one's (and the base's,
    under "") greedy reference tokens per prompt."""

    root: Path
    references: dict[str, dict[str, list[int]]]


def cached_suite(prompts: list[str], tokenize, new_tokens: int, base_name: str) -> AdapterSuite:
    """The suite from a folder under the system's temp directory keyed by
    everything it depends on (recipes, prompts, library versions), made
    there once: a second test session reads it in milliseconds."""
    import hashlib
    import json
    import tempfile

    import peft
    import transformers

    key = hashlib.sha256(repr(("greedy-v2", RECIPES, WEIGHT_SCALE, prompts, new_tokens, base_name, BASE_GGUF.resolve().name,
                               torch.__version__, peft.__version__, transformers.__version__)).encode()).hexdigest()
    root = Path(tempfile.gettempdir()) / "modeld-test-lora" / key[:16]
    done = root / "references.json"
    if done.is_file():
        return AdapterSuite(root, json.loads(done.read_text()))
    staging = root.with_name(f"{root.name}.{os.getpid()}")
    suite = build_suite(staging, prompts, tokenize, new_tokens, base_name)
    (staging / "references.json").write_text(json.dumps(suite.references))
    try:
        staging.rename(root)  # whole or not at all: a session killed mid-way leaves only its staging folder
    except OSError:  # another session finished first: its copy is as good
        shutil.rmtree(staging, ignore_errors=True)
    return AdapterSuite(root, json.loads(done.read_text()))


def build_suite(root: Path, prompts: list[str], tokenize, new_tokens: int, base_name: str) -> AdapterSuite:
    """Make every recipe's adapter in root and its reference continuations."""
    from peft import PeftModel

    model = hf_base()
    references = {"": {p: greedy(model, tokenize(p), new_tokens) for p in prompts}}
    for recipe in RECIPES:
        folder = root / recipe.name
        peft_model = make_adapter(model, recipe, folder)
        write_adapter_toml(folder, base_name)
        references[recipe.name] = {p: greedy(peft_model, tokenize(p), new_tokens) for p in prompts}
        model = peft_model.unload()  # the plain base again, for the next recipe
        assert not isinstance(model, PeftModel)
    return AdapterSuite(root, references)
