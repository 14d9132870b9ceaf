"""Llama-family weights into torch tensors: from GGUF (dequantized with the
`gguf` package) or from Hugging Face safetensors plus config.json. Never
from pickle."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from modeld.backends.errors import LoadFailed


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    norm_eps: float
    rope_theta: float
    max_seq_len: int
    tie_embeddings: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# GGUF tensor name -> ours (per layer "{i}")
_GGUF_NAMES = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
    "blk.{i}.attn_norm.weight": "layers.{i}.attention_norm.weight",
    "blk.{i}.attn_q.weight": "layers.{i}.attention.wq.weight",
    "blk.{i}.attn_k.weight": "layers.{i}.attention.wk.weight",
    "blk.{i}.attn_v.weight": "layers.{i}.attention.wv.weight",
    "blk.{i}.attn_output.weight": "layers.{i}.attention.wo.weight",
    "blk.{i}.ffn_norm.weight": "layers.{i}.ffn_norm.weight",
    "blk.{i}.ffn_gate.weight": "layers.{i}.feed_forward.w1.weight",
    "blk.{i}.ffn_up.weight": "layers.{i}.feed_forward.w3.weight",
    "blk.{i}.ffn_down.weight": "layers.{i}.feed_forward.w2.weight",
}

_HF_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attention_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.attention.wq.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.attention.wk.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.attention.wv.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.attention.wo.weight",
    "model.layers.{i}.self_attn.q_proj.bias": "layers.{i}.attention.wq.bias",
    "model.layers.{i}.self_attn.k_proj.bias": "layers.{i}.attention.wk.bias",
    "model.layers.{i}.self_attn.v_proj.bias": "layers.{i}.attention.wv.bias",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.feed_forward.w1.weight",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.feed_forward.w3.weight",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.feed_forward.w2.weight",
}


def _rename(name: str, table: dict[str, str]) -> str | None:
    parts = name.split(".")
    for index, part in enumerate(parts):
        if part.isdigit():
            pattern = ".".join(parts[:index] + ["{i}"] + parts[index + 1:])
            target = table.get(pattern)
            return target.replace("{i}", part) if target else None
    return table.get(name)


def _header(path: Path):
    from modeld.backends.gguf_header import GGUFHeader, GGUFHeaderError

    try:
        return GGUFHeader(path)
    except GGUFHeaderError as exc:
        raise LoadFailed(f"not a GGUF file {path.name}: {exc}") from exc
    except OSError as exc:  # its message would name the machine's path
        raise LoadFailed(f"cannot read {path.name}: {exc.strerror or type(exc).__name__}") from None


def _unpermute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (its rope pairs adjacent values;
    ours, like Hugging Face's, rotates the two halves of each head)."""
    rows = weight.shape[0]
    return (weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def load_gguf(path: Path) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    from gguf.quants import dequantize

    reader = _header(path)
    arch = reader.get("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise LoadFailed(f"the torch runtime serves llama and qwen2 architectures, not {arch!r}")
    n_heads = int(reader.get(f"{arch}.attention.head_count"))
    n_kv = int(reader.get(f"{arch}.attention.head_count_kv", n_heads))
    state = {}
    for tensor in reader.tensors:
        name = _rename(tensor.name, _GGUF_NAMES) or _rename(tensor.name.replace(".bias", ".weight"), _GGUF_NAMES)
        if name is None:
            continue
        if tensor.name.endswith(".bias"):
            name = name.replace(".weight", ".bias")
        values = dequantize(reader.tensor_bytes(tensor), tensor.tensor_type).reshape(list(reversed(tensor.shape)))
        if arch == "llama" and ".attn_q." in tensor.name:
            values = _unpermute(values, n_heads)
        elif arch == "llama" and ".attn_k." in tensor.name:
            values = _unpermute(values, n_kv)
        state[name] = torch.from_numpy(np.array(values, dtype=np.float32))  # a writable copy of the mmap
    embed = state["tok_embeddings.weight"]
    eos = reader.get("tokenizer.ggml.eos_token_id")
    eot = reader.get("tokenizer.ggml.eot_token_id")
    args = ModelArgs(
        vocab_size=embed.shape[0], dim=embed.shape[1], n_layers=int(reader.get(f"{arch}.block_count")),
        n_heads=n_heads, n_kv_heads=n_kv, hidden_dim=int(reader.get(f"{arch}.feed_forward_length")),
        norm_eps=float(reader.get(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(reader.get(f"{arch}.rope.freq_base", 10000.0)),
        max_seq_len=int(reader.get(f"{arch}.context_length")),
        tie_embeddings="output.weight" not in state,
        bos_token_id=reader.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(int(t) for t in (eos, eot) if t is not None),
    )
    return args, state


@dataclass(frozen=True)
class Footprint:
    """What a checkpoint needs once served, read from headers only."""

    num_params: int
    n_layers: int
    kv_width: int  # n_kv_heads * head_dim
    tied_head: int = 0  # the embedding's elements where it is also the vocabulary projection


def gguf_footprint(path: Path) -> Footprint:
    reader = _header(path)
    arch = reader.get("general.architecture")
    n_heads = int(reader.get(f"{arch}.attention.head_count"))
    n_kv = int(reader.get(f"{arch}.attention.head_count_kv", n_heads))
    dim = int(reader.get(f"{arch}.embedding_length"))
    sizes = {t.name: t.n_elements for t in reader.tensors}
    return Footprint(num_params=sum(sizes.values()), n_layers=int(reader.get(f"{arch}.block_count")),
                     kv_width=n_kv * (dim // n_heads),
                     tied_head=0 if "output.weight" in sizes else sizes.get("token_embd.weight", 0))


def safetensors_footprint(model_dir: Path) -> Footprint:
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    sizes: dict[str, int] = {}
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                sizes[name] = int(np.prod(f.get_slice(name).get_shape()))
    n_heads = config["num_attention_heads"]
    head_dim = config["hidden_size"] // n_heads  # as ModelArgs.head_dim
    tied = config.get("tie_word_embeddings", "lm_head.weight" not in sizes)  # as load_safetensors decides
    return Footprint(num_params=sum(sizes.values()), n_layers=config["num_hidden_layers"],
                     kv_width=config.get("num_key_value_heads", n_heads) * head_dim,
                     tied_head=sizes.get("model.embed_tokens.weight", 0) if tied else 0)


def load_safetensors(model_dir: Path) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise LoadFailed("a safetensors checkpoint needs its config.json next to it")
    config = json.loads(config_path.read_text())
    state = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            ours = _rename(name, _HF_NAMES)
            if ours is not None:
                state[ours] = tensor.float()
    if "tok_embeddings.weight" not in state:
        raise LoadFailed(f"no Llama-family weights found in {model_dir}")
    eos = config.get("eos_token_id")
    args = ModelArgs(
        vocab_size=config["vocab_size"], dim=config["hidden_size"], n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
        hidden_dim=config["intermediate_size"], norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=config.get("rope_theta", 10000.0), max_seq_len=config.get("max_position_embeddings", 2048),
        tie_embeddings=config.get("tie_word_embeddings", "output.weight" not in state),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
    )
    return args, state
