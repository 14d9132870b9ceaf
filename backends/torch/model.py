"""A Llama-family decoder in torch, reading and writing a paged KV cache.

RMSNorm, rotary embeddings (the checkpoint's theta, halves rotated),
grouped-query attention, SwiGLU MLP, optional tied embeddings and q/k/v
biases (Qwen2). One forward pass serves a whole scheduler step: the tokens
of every sequence, flattened, with per-sequence block tables. Attention
gathers each sequence's cached keys and values into one padded batch and
runs scaled_dot_product_attention once per layer, so no Python loop walks
the sequences inside the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from modeld.backends.torch.weights import ModelArgs


@dataclass
class StepBatch:
    """Tensors describing one step (T new tokens over S sequences).

    input_ids, positions, slots: [T] (slots: flat KV-cache index per token)
    query_index: [S, Q] index into T (padding points at 0, masked)
    query_rows:  [T] index into the flattened [S * Q] query grid, in token order
    kv_index:    [S, C] flat KV-cache index per context position (padding 0)
    mask:        [S, 1, Q, C] bool, True where attention is allowed
    logit_rows:  [L] rows of T whose logits are returned
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    query_index: torch.Tensor
    query_rows: torch.Tensor
    kv_index: torch.Tensor
    mask: torch.Tensor
    logit_rows: torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


def rotary(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [T, head_dim] for the given positions."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, head_dim / 2]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; rotate the two halves of each head."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, bias: bool) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x, cos, sin, batch: StepBatch, k_cache: torch.Tensor, v_cache: torch.Tensor):
        tokens = x.shape[0]
        q = apply_rotary(self.wq(x).view(tokens, self.n_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.wk(x).view(tokens, self.n_kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(tokens, self.n_kv_heads, self.head_dim)
        # caches: [num_blocks * block_size, kv_heads, head_dim]
        k_cache.index_copy_(0, batch.slots, k)
        v_cache.index_copy_(0, batch.slots, v)
        num_seqs, max_q = batch.query_index.shape
        max_c = batch.kv_index.shape[1]
        # index_select on flat indices: several times cheaper than advanced indexing here
        queries = q.index_select(0, batch.query_index.view(-1)).view(num_seqs, max_q, self.n_heads, self.head_dim)
        keys = k_cache.index_select(0, batch.kv_index.view(-1)).view(num_seqs, max_c, self.n_kv_heads, self.head_dim)
        values = v_cache.index_select(0, batch.kv_index.view(-1)).view(num_seqs, max_c, self.n_kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=batch.mask, enable_gqa=self.n_heads != self.n_kv_heads)
        out = out.transpose(1, 2).reshape(num_seqs * max_q, self.n_heads * self.head_dim)  # [S * Q, dim]
        return self.wo(out.index_select(0, batch.query_rows))  # [T, dim], in token order


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self, args: ModelArgs, bias: bool) -> None:
        super().__init__()
        self.attention = Attention(args, bias)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, cos, sin, batch, k_cache, v_cache):
        x = x + self.attention(self.attention_norm(x), cos, sin, batch, k_cache, v_cache)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, bias: bool = False) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Layer(args, bias) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def tie(self) -> None:
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.inference_mode()
    def forward(self, batch: StepBatch, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> torch.Tensor:
        """-> logits [len(batch.logit_rows), vocab] float32."""
        x = self.tok_embeddings(batch.input_ids)  # [T, dim]
        cos, sin = rotary(batch.positions, self.args.head_dim, self.args.rope_theta, x.dtype)
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches):
            x = layer(x, cos, sin, batch, k_cache, v_cache)
        # only the rows that need logits go through the vocabulary projection
        return self.output(self.norm(x[batch.logit_rows])).float()
