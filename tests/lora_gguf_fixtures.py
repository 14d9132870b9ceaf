"""GGUF LoRA adapters of the embedded SmolLM2 for the llama.cpp backend,
made at test time the way a user makes them.

peft makes the adapters (lora_fixtures' recipes, on the Hugging Face model
transformers reads from the same GGUF llama.cpp serves); llama.cpp's own
convert_lora_to_gguf.py, from the llama-cpp-python source distribution at
the installed version (pip downloads it once), turns each into a GGUF
LoRA; and llama-cpp-python's own `Llama(model_path=base, lora_path=...)`
computes the reference continuations. Everything lands in a folder under
the system's temp directory keyed by what it depends on, so only the first
session pays for it (about a minute on two cores).

Two of lora_fixtures' recipes: rank 8 on q/v and rank 16 on every
projection. Its third uses rsLoRA (alpha / sqrt(r)); the converter writes
lora_alpha alone and llama.cpp scales by alpha / r, so it is not one a
GGUF LoRA can carry.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from daemon import MODELS
from lora_fixtures import RECIPES as PEFT_RECIPES, WEIGHT_SCALE

BASE_GGUF = MODELS / "smollm2" / "model.gguf"
RECIPES = PEFT_RECIPES[:2]
ADAPTER_FILE = "adapter.gguf"
CACHE = Path(tempfile.gettempdir()) / "modeld-test-lora-gguf"
SDIST_DIR = Path(__file__).resolve().parent.parent / "var" / "sdist"
# the reference runs as the daemon does: flash attention (backends/llamacpp/context.py)
REFERENCE_OPTIONS = {"n_ctx": 512, "n_threads": 2, "flash_attn": True, "verbose": False}


def llama_cpp_version() -> str:
    return importlib.metadata.version("llama-cpp-python")


def converter() -> Path:
    """convert_lora_to_gguf.py (with the conversion/ and gguf-py/ packages
    it imports) from the sdist of the installed llama-cpp-python."""
    version = llama_cpp_version()
    root = CACHE / f"llama.cpp-{version}"
    script = root / "convert_lora_to_gguf.py"
    if script.is_file():
        return script
    staging = root.with_name(f"{root.name}.{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    download = staging / "sdist"
    # `make test` fetches the sdist at set-up (make lora-sdist); pip here only where a run skipped it
    fetched = SDIST_DIR / f"llama_cpp_python-{version}.tar.gz"
    if fetched.is_file():
        download.mkdir(parents=True)
        shutil.copy(fetched, download / fetched.name)
    else:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", str(download)], check=True, timeout=600)
    (archive,) = download.glob("llama_cpp_python-*.tar.gz")
    prefix = f"{archive.name[:-len('.tar.gz')]}/vendor/llama.cpp/"
    wanted = ("convert_lora_to_gguf.py", "conversion/", "gguf-py/")
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.name[len(prefix):].startswith(wanted)]
        if not any(m.name.endswith("convert_lora_to_gguf.py") for m in members):
            raise RuntimeError(f"llama-cpp-python {version}'s sdist ships no convert_lora_to_gguf.py")
        for member in members:
            member.name = member.name[len(prefix):]
        tar.extractall(staging, members=members, filter="data")
    shutil.rmtree(download)
    try:
        staging.rename(root)
    except OSError:  # another session finished first
        shutil.rmtree(staging, ignore_errors=True)
    return script


def hf_config(base_model, folder: Path) -> Path:
    """The base's config.json, all the converter reads of the base: its
    architecture and sizes (not transformers' note that it came from a GGUF)."""
    base_model.config.save_pretrained(str(folder))
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.pop("quantization_config", None)
    config.setdefault("architectures", [type(base_model).__name__])
    path.write_text(json.dumps(config, indent=1))
    return folder


def convert(peft_folder: Path, base_config: Path, out: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(converter()), "--base", str(base_config), "--outfile", str(out), "--outtype", "f32",
         str(peft_folder)],
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"convert_lora_to_gguf.py failed:\n{result.stderr[-3000:]}")


def write_adapter_toml(folder: Path, base: str) -> None:
    (folder / "model.toml").write_text(f'format = "lora"\nbase = "{base}"\nartifact = "{ADAPTER_FILE}"\n')


def reference(prompts: list[str], new_tokens: int, lora_path: Path | None) -> dict[str, list[int]]:
    """llama-cpp-python's greedy continuation of each prompt (end of
    sequence passed, as the runtime is asked with ignore_eos)."""
    from llama_cpp import Llama

    extra = {"lora_path": str(lora_path)} if lora_path is not None else {}
    llm = Llama(str(BASE_GGUF.resolve()), **REFERENCE_OPTIONS, **extra)
    try:
        out = {}
        for prompt in prompts:
            tokens = []
            for token in llm.generate(llm.tokenize(prompt.encode()), temp=0.0, reset=True):
                tokens.append(token)
                if len(tokens) == new_tokens:
                    break
            out[prompt] = tokens
        return out
    finally:
        llm.close()


@dataclass
class GgufSuite:
    """Adapters under root/<name>/ (model.toml + adapter.gguf, and the PEFT
    files they came from under root/peft/<name>/), and each one's (the
    base's under "") reference tokens per prompt."""

    root: Path
    references: dict[str, dict[str, list[int]]]

    def adapter_file(self, name: str) -> Path:
        return self.root / name / ADAPTER_FILE


def cached_gguf_suite(prompts: list[str], new_tokens: int, base_name: str) -> GgufSuite:
    import peft
    import torch
    import transformers

    key = hashlib.sha256(repr(("gguf-v1", RECIPES, WEIGHT_SCALE, prompts, new_tokens, base_name,
                               BASE_GGUF.resolve().name, llama_cpp_version(), torch.__version__, peft.__version__,
                               transformers.__version__)).encode()).hexdigest()
    root = CACHE / key[:16]
    done = root / "references.json"
    if not done.is_file():
        staging = root.with_name(f"{root.name}.{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        references = build_gguf_suite(staging, prompts, new_tokens, base_name)
        (staging / "references.json").write_text(json.dumps(references))
        try:
            staging.rename(root)  # whole or not at all
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return GgufSuite(root, json.loads(done.read_text()))


def build_gguf_suite(root: Path, prompts: list[str], new_tokens: int, base_name: str) -> dict:
    from lora_fixtures import hf_base, make_adapter

    model = hf_base()
    base_config = hf_config(model, root / "hf-base")
    for recipe in RECIPES:
        peft_folder = root / "peft" / recipe.name
        model = make_adapter(model, recipe, peft_folder).unload()
        (root / recipe.name).mkdir(parents=True)
        convert(peft_folder, base_config, root / recipe.name / ADAPTER_FILE)
        write_adapter_toml(root / recipe.name, base_name)
    del model
    references = {"": reference(prompts, new_tokens, None)}
    for recipe in RECIPES:
        references[recipe.name] = reference(prompts, new_tokens, root / recipe.name / ADAPTER_FILE)
    return references


def write_lora_gguf(path: Path, architecture: str, pairs: dict[str, tuple[int, int, int]], alpha: float = 16.0) -> None:
    """A GGUF LoRA written with the gguf package: pairs maps a base weight
    name to (in, rank, out), ggml's ne of its lora_a [in, r] and lora_b [r, out]."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    rng = np.random.default_rng(0)
    for weight, (d_in, rank, d_out) in pairs.items():
        # numpy shapes are ggml's ne reversed
        writer.add_tensor(f"{weight}.lora_a", (rng.standard_normal((rank, d_in)) * 0.05).astype(np.float32))
        writer.add_tensor(f"{weight}.lora_b", (rng.standard_normal((d_out, rank)) * 0.05).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
