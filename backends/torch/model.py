"""A Llama-family decoder in torch, reading and writing a paged KV cache.

RMSNorm, rotary embeddings (the checkpoint's theta, halves rotated),
grouped-query attention, SwiGLU MLP, optional tied embeddings and q/k/v
biases (Qwen2). One forward pass serves a whole scheduler step: the tokens
of every sequence, flattened, with per-sequence block tables. Attention
gathers each sequence's cached keys and values into one padded batch and
runs scaled_dot_product_attention once per layer, so no Python loop walks
the sequences inside the forward pass.

The q/k/v projections are one matrix and so are the gate and up
projections: fewer, wider matrix products, which is what a decode step on
a CPU spends its time in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from modeld.backends.torch.lora import LayerLora, down_delta, gate_up_delta, out_delta, qkv_delta
from modeld.backends.torch.weights import ModelArgs


@dataclass
class StepBatch:
    """Tensors describing one step (T new tokens over S sequences).

    input_ids, positions, slots: [T] (slots: flat KV-cache index per token)
    query_index: [S, Q] index into T (padding points at 0, masked); None when
                 every sequence brings exactly one token (T == S, in order)
    query_rows:  [T] index into the flattened [S * Q] query grid, in token order
                 (None with query_index None)
    kv_index:    [S, C] flat KV-cache index per context position (padding 0)
    mask:        [S, 1, Q, C] bool, True where attention is allowed; None when
                 every query may see its sequence's whole gathered context
    logit_rows:  [L] rows of T whose logits are returned
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    query_index: torch.Tensor | None
    query_rows: torch.Tensor | None
    kv_index: torch.Tensor
    mask: torch.Tensor | None
    logit_rows: torch.Tensor


def cpu_project(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, in] times weight [out, in] transposed, as weight @ x.T: the
    fp32 form for a plain weight (where oneDNN cannot pack it).

    Measured on this CPU (MKL, two threads) with weights streamed from
    memory: weight @ x.T runs 1.3-3x faster than F.linear's x @ weight.T for
    2 to 64 rows, and a single row is faster still when it is doubled, since
    MKL's matrix-vector path for this layout uses the cores less well than
    its two-column matrix product. Same values either way, up to fp32 rounding.
    x must be row-major: with x.T contiguous instead, MKL takes a path 2-3x
    slower, and the elementwise results of an earlier product come out in
    that transposed layout.
    """
    x = x.contiguous()
    if x.shape[0] == 1:
        return (weight @ torch.cat((x, x)).t())[:, :1].t().contiguous()
    # row-major again, or attention's inputs come out strided and SDPA drops to its slow path
    return (weight @ x.t()).t().contiguous()


# An op of our own so torch.compile calls oneDNN's linear as it is: inductor
# lowers that op only for weights frozen into the graph, and one compiled
# layer serves thirty layers' weights. Defined on a Library rather than with
# torch.library.custom_op, whose Python wrapper cost 35 us a call here (121
# calls a step); this one costs about 5.
_LIBRARY = torch.library.Library("modeld", "DEF")
_LIBRARY.define("packed_project(Tensor x, Tensor weight) -> Tensor")


def _packed_project(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, None, "none", [], "")


_LIBRARY.impl("packed_project", _packed_project, "CompositeExplicitAutograd")


@torch.library.register_fake("modeld::packed_project")
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


# x [M, in] times a weight oneDNN holds in its own blocked layout (pack_weight)
packed_project = torch.ops.modeld.packed_project


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 [out, in] matrix reordered once into oneDNN's blocked layout.

    Measured on this CPU (two threads, weights streamed from memory), the
    121 products of a decode step at SmolLM2's shapes: 22-24 ms for one row
    and 34-39 for eight packed, against 26-32 and 46-54 through MKL
    (cpu_project), the matrix laid out once in the blocks oneDNN's kernel
    reads. The packed tensor is opaque: no storage to view, index or slice.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packs_weights(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on this device in this dtype serves from packed weights."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # reduced precision: normalise in fp32 as the reference implementations do
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


def rotary_table(max_positions: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_positions, head_dim], the same angle for both halves."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; rotate the two halves of each head."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_index: torch.Tensor,
                     mask: torch.Tensor | None, n_kv_heads: int) -> torch.Tensor:
    """One query per sequence against its cached context, written as plain
    reductions for inductor. q: [S, heads, head_dim]; kv_index: [S, C];
    mask: [S, 1, 1, C] or None. Returns [S, heads * head_dim].

    Compiled, the cache reads happen inside the reduction loops, through
    kv_index: no gathered copy of each sequence's keys and values is written
    and read back, and inductor fuses the rotary, the cache writes and the
    softmax into the same kernel. Measured on this CPU, 8 sequences of up to
    128 positions: 165 us a layer against 240 for index_select followed by
    scaled_dot_product_attention in the compiled layer; eager, this form
    would materialise [S, C, heads, head_dim] products, so it is used only
    under torch.compile."""
    num_seqs, max_c = kv_index.shape
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // n_kv_heads
    keys = k_cache[kv_index]  # [S, C, kv_heads, head_dim], never materialised once compiled
    scores = (q.view(num_seqs, 1, n_kv_heads, group, head_dim) * keys[:, :, :, None, :]).sum(-1)
    scores = scores * head_dim ** -0.5  # [S, C, kv_heads, group]
    if mask is not None:
        scores = scores.masked_fill(~mask.view(num_seqs, max_c, 1, 1), float("-inf"))
    weights = torch.softmax(scores, dim=1)
    values = v_cache[kv_index]
    out = (weights[..., None] * values[:, :, :, None, :]).sum(1)  # [S, kv_heads, group, head_dim]
    return out.reshape(num_seqs, heads * head_dim)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, bias: bool) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_width = args.n_heads * args.head_dim
        self.kv_width = args.n_kv_heads * args.head_dim
        self.wqkv = nn.Parameter(torch.empty(self.q_width + 2 * self.kv_width, args.dim))
        self.bqkv = nn.Parameter(torch.zeros(self.q_width + 2 * self.kv_width)) if bias else None
        self.wo = nn.Parameter(torch.empty(args.dim, self.q_width))

    def forward(self, x, cos, sin, batch: StepBatch, k_cache: torch.Tensor, v_cache: torch.Tensor, project,
                lora: LayerLora | None = None):
        tokens = x.shape[0]
        qkv = project(x, self.wqkv)
        if self.bqkv is not None:
            qkv = qkv + self.bqkv
        delta = qkv_delta(lora, x) if lora is not None else None
        if delta is not None:
            qkv = qkv + delta
        # rotate q and k together: they are adjacent columns of qkv
        qk = qkv[:, :self.q_width + self.kv_width].reshape(tokens, self.n_heads + self.n_kv_heads, self.head_dim)
        qk = apply_rotary(qk, cos, sin)
        q, k = qk[:, :self.n_heads], qk[:, self.n_heads:]
        v = qkv[:, self.q_width + self.kv_width:].reshape(tokens, self.n_kv_heads, self.head_dim)
        # caches: [num_blocks * block_size, kv_heads, head_dim]
        k_cache.index_copy_(0, batch.slots, k)
        v_cache.index_copy_(0, batch.slots, v)
        if batch.query_index is None and q.device.type == "cpu" and torch.compiler.is_compiling():
            out = decode_attention(q, k_cache, v_cache, batch.kv_index, batch.mask, self.n_kv_heads)
        else:
            out = self._gathered_attention(q, batch, k_cache, v_cache)
        result = project(out, self.wo)
        delta = out_delta(lora, out) if lora is not None else None
        return result if delta is None else result + delta

    def _gathered_attention(self, q: torch.Tensor, batch: StepBatch, k_cache: torch.Tensor,
                            v_cache: torch.Tensor) -> torch.Tensor:
        """Each sequence's context gathered into a padded batch, then
        scaled_dot_product_attention once. q: [T, heads, head_dim] -> [T, dim]."""
        tokens = q.shape[0]
        num_seqs, max_c = batch.kv_index.shape
        if batch.query_index is None:  # one token per sequence
            max_q, queries = 1, q.reshape(num_seqs, 1, self.n_heads, self.head_dim)
        else:
            # index_select on flat indices: several times cheaper than advanced indexing here
            max_q = batch.query_index.shape[1]
            queries = q.reshape(tokens, self.n_heads, self.head_dim).index_select(0, batch.query_index.view(-1))
            queries = queries.view(num_seqs, max_q, self.n_heads, self.head_dim)
        flat = batch.kv_index.view(-1)
        keys = k_cache.index_select(0, flat).view(num_seqs, max_c, self.n_kv_heads, self.head_dim)
        values = v_cache.index_select(0, flat).view(num_seqs, max_c, self.n_kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=batch.mask, enable_gqa=self.n_heads != self.n_kv_heads)
        out = out.transpose(1, 2).reshape(num_seqs * max_q, self.q_width)  # [S * Q, dim]
        if batch.query_rows is not None:
            out = out.index_select(0, batch.query_rows)  # [T, dim], in token order
        return out


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.hidden = args.hidden_dim
        self.w13 = nn.Parameter(torch.empty(2 * args.hidden_dim, args.dim))  # gate rows, then up rows
        self.w2 = nn.Parameter(torch.empty(args.dim, args.hidden_dim))  # down

    def forward(self, x: torch.Tensor, project, lora: LayerLora | None = None) -> torch.Tensor:
        gate_up = project(x, self.w13)
        delta = gate_up_delta(lora, x) if lora is not None else None
        if delta is not None:
            gate_up = gate_up + delta
        hidden = F.silu(gate_up[:, :self.hidden]) * gate_up[:, self.hidden:]
        out = project(hidden, self.w2)
        delta = down_delta(lora, hidden) if lora is not None else None
        return out if delta is None else out + delta


class Layer(nn.Module):
    def __init__(self, args: ModelArgs, bias: bool) -> None:
        super().__init__()
        self.attention = Attention(args, bias)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, cos, sin, batch, k_cache, v_cache, project, lora: LayerLora | None = None):
        x = x + self.attention(self.attention_norm(x), cos, sin, batch, k_cache, v_cache, project, lora)
        return x + self.feed_forward(self.ffn_norm(x), project, lora)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run_layer(layer: Layer, x, cos, sin, batch: StepBatch, k_cache, v_cache, project,
              lora: LayerLora | None = None) -> torch.Tensor:
    return layer(x, cos, sin, batch, k_cache, v_cache, project, lora)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, bias: bool = False, max_positions: int | None = None) -> None:
        super().__init__()
        self.args = args
        self.run_layer = run_layer
        self.compiled = False
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Layer(args, bias) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = None if args.tie_embeddings else nn.Parameter(torch.empty(args.vocab_size, args.dim))
        # a table for the positions served, not the checkpoint's whole (possibly 128k) window
        cos, sin = rotary_table(max_positions or args.max_seq_len, args.head_dim, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.packed = False  # projections hold oneDNN-packed weights (pack_weights)
        self.packed_output: torch.Tensor | None = None  # the tied vocabulary projection, packed

    def load_weights(self, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        """Take a checkpoint in per-projection names (weights.py) and join the
        fused matrices. Returns (missing, unexpected) names."""
        state = dict(state)
        fused: dict[str, torch.Tensor] = {}
        missing: list[str] = []

        def join(target: str, parts: list[str]) -> None:
            if all(p in state for p in parts):
                fused[target] = torch.cat([state.pop(p) for p in parts])
            else:
                missing.extend(p for p in parts if p not in state)

        for i, layer in enumerate(self.layers):
            a, f = f"layers.{i}.attention.", f"layers.{i}.feed_forward."
            join(a + "wqkv", [a + "wq.weight", a + "wk.weight", a + "wv.weight"])
            if layer.attention.bqkv is not None:
                join(a + "bqkv", [a + "wq.bias", a + "wk.bias", a + "wv.bias"])
            for old, new in ((a + "wo.weight", a + "wo"), (f + "w2.weight", f + "w2")):
                if old in state:
                    fused[new] = state.pop(old)
            join(f + "w13", [f + "w1.weight", f + "w3.weight"])
        if "output.weight" in state:
            output = state.pop("output.weight")
            if self.output is not None:
                fused["output"] = output
        fused.update(state)
        result = self.load_state_dict(fused, strict=False)
        return missing + list(result.missing_keys), list(result.unexpected_keys)

    def pack_weights(self) -> bool:
        """Reorder every projection's fp32 weight into oneDNN's layout
        (pack_weight), in place of the plain one. A tied vocabulary
        projection keeps its plain matrix for the embedding lookup and gets
        a packed copy. False, nothing changed, where oneDNN is absent or the
        weights are not fp32 on the CPU."""
        weight = self.tok_embeddings.weight
        if not packs_weights(weight.device, weight.dtype):
            return False
        for layer in self.layers:
            for module, name in ((layer.attention, "wqkv"), (layer.attention, "wo"),
                                 (layer.feed_forward, "w13"), (layer.feed_forward, "w2")):
                setattr(module, name, nn.Parameter(pack_weight(getattr(module, name)), requires_grad=False))
        if self.output is not None:
            self.output = nn.Parameter(pack_weight(self.output), requires_grad=False)
        else:
            self.packed_output = pack_weight(weight)
        self.packed = True
        return True

    def weight_bytes(self) -> int:
        """Bytes the model's weights hold, a packed copy of a tied projection included."""
        extra = [] if self.packed_output is None else [self.packed_output]
        return tensor_bytes([*self.parameters(), *extra])

    def compile(self) -> None:
        """Run each layer through torch.compile (inductor).

        One layer's graph, not the whole model's: every layer runs the same
        code with other weights, so one compiled graph (per step shape:
        decode or prefill, one sequence or several) serves all of them and
        compiles in seconds; the whole model unrolled took minutes per shape
        here. It fuses the norms, rotary, SwiGLU and residual adds around the
        matrix products.
        """
        import torch._dynamo
        import torch.fx.experimental._config as fx_config

        # shape variants (decode, prefill, padded, one sequence or many) for the target and a draft
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # sizes that happen to be equal (a prompt's length and its context) must not
        # become one symbol, or the first step where they differ compiles anew mid-request
        fx_config.use_duck_shape = False
        # size_asserts off: the generated wrapper re-checks every input's sizes
        # and strides on each call (about 15 a layer, 30 layers a step), which
        # dynamo's guards have already checked before the graph runs
        self.run_layer = torch.compile(run_layer, dynamic=True, options={"size_asserts": False})
        self.compiled = True

    def new_kv_caches(self, cells: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Zeroed key and value caches, [cells, kv_heads, head_dim] per layer,
        on the model's device and in its dtype."""
        weight = self.tok_embeddings.weight
        shape = (cells, self.args.n_kv_heads, self.args.head_dim)

        def caches() -> list[torch.Tensor]:
            return [torch.zeros(shape, dtype=weight.dtype, device=weight.device) for _ in range(self.args.n_layers)]
        return caches(), caches()

    def output_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output

    def head_weight(self) -> torch.Tensor:
        """The vocabulary projection's weight as the forward pass multiplies
        it: a tied one's packed copy where there is one."""
        return self.output_weight() if self.packed_output is None else self.packed_output

    def forward(self, batch: StepBatch, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                lora: list[LayerLora] | None = None) -> torch.Tensor:
        """-> logits [len(batch.logit_rows), vocab] float32. lora: per layer,
        the step's adapter stacks (lora.py); None runs the base alone."""
        # compiled graphs refuse inference tensors; eager runs a little faster under inference_mode
        with torch.no_grad() if self.compiled else torch.inference_mode():
            return self._forward(batch, k_caches, v_caches, lora)

    def _forward(self, batch: StepBatch, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 lora: list[LayerLora] | None) -> torch.Tensor:
        x = self.tok_embeddings(batch.input_ids)  # [T, dim]
        # chosen here, not inside the compiled layer: there a packed weight's
        # fake tensor no longer says it is packed. MKL's bf16 products run a
        # row at a time here; only fp32 gains from packing or the reshaped product
        if self.packed:
            project = packed_project
        else:
            project = cpu_project if x.device.type == "cpu" and x.dtype == torch.float32 else F.linear
        cos = self.rope_cos.index_select(0, batch.positions).to(x.dtype)
        sin = self.rope_sin.index_select(0, batch.positions).to(x.dtype)
        for i, (layer, k_cache, v_cache) in enumerate(zip(self.layers, k_caches, v_caches)):
            x = self.run_layer(layer, x, cos, sin, batch, k_cache, v_cache, project,
                               None if lora is None else lora[i])
        # only the rows that need logits go through the vocabulary projection
        return project(self.norm(x[batch.logit_rows]), self.head_weight()).float()
