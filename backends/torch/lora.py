"""LoRA adapters on the torch runtime: read a PEFT adapter, and apply many
adapters in one forward pass over the shared base weights.

PEFT's LoRA adds to a projection W (out x in) the low-rank product
B @ A * scaling, with A: [r, in], B: [out, r] and scaling = lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora). Nothing is merged into W and no
copy of W is made: each step the base matmul runs once for every token, and
the adapters' products are added on top (the Punica / S-LoRA idea).

One step mixes S adapters (at most the base's max_loras_per_batch). Its
tokens are gathered by adapter into S groups of C slots each (C: the most
tokens any one adapter has in the step), and each projection's adapters
are stacked, zero-padded to the step's largest rank R, into A: [S, in, R]
and B: [S, R, out] (B already times its adapter's scaling). Then for the
step's tokens x: [T, in]

    xg    = x[gather].view(S, C, in)     slot (s, c): the c-th token of adapter s
    delta = bmm(bmm(xg, A), B)           [S, C, out]: each group times its own adapter
    delta = delta.view(S * C, out)[back] [T, out] in token order; the base's
                                         tokens are multiplied by 0

Two batched products per projection whatever the mix, instead of a Python
loop over adapters or sequences, and each token meets only its own
adapter's matrices: a stack of all S adapters against every token costs S
times the multiply-adds, which at 8 decoding streams over 4 adapters took
as long as reading the matrices. The unused slots of a group (an adapter
with fewer tokens than C) repeat a real token and are never read back. A
token's delta is the one its adapter alone gives, and the base's tokens
get exactly 0. The stacks depend only on which adapters the step mixes, so
they are built once per adapter set and reused while it lasts (decode
steps keep the same set for many steps).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from modeld.backends.errors import InvalidArgument
from modeld.backends.torch.weights import ModelArgs

# PEFT's module names on a Llama-family model -> our projection groups
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}
MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes
CONFIG_FILE = "adapter_config.json"

@dataclass(frozen=True)
class LoraWeights:
    """One adapter's matrices in the served dtype and device.

    layers[i][module] = (A [r, in], B [out, r]); a module the adapter does
    not target is absent.
    """

    adapter_id: int
    rank: int
    scaling: float
    targets: frozenset[str]
    layers: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for pair in layer.values() for t in pair)


class StepSlots(NamedTuple):
    """Where a step's tokens sit in the adapter groups (same for every layer)."""

    gather: torch.Tensor  # [S * C] token row of each slot
    back: torch.Tensor  # [T] slot of each token (slot 0 for the base's tokens, which keep zeroes)
    keep: torch.Tensor | None  # [T, 1] 1 for an adapter's token, 0 for the base's; None when all are adapters'


class LayerLora(NamedTuple):
    """One layer's stacks for a step (see the module docstring); a group no
    adapter of the step targets is None and costs nothing."""

    slots: StepSlots
    qkv_a: torch.Tensor | None  # [S, dim, 3 * R]: q's columns, then k's, then v's
    q_b: torch.Tensor | None  # [S, R, q_width], scaled
    k_b: torch.Tensor | None  # [S, R, kv_width]
    v_b: torch.Tensor | None
    o_a: torch.Tensor | None  # [S, q_width, R]
    o_b: torch.Tensor | None  # [S, R, dim]
    gu_a: torch.Tensor | None  # [S, dim, 2 * R]: gate's columns, then up's
    g_b: torch.Tensor | None  # [S, R, hidden]
    u_b: torch.Tensor | None
    d_a: torch.Tensor | None  # [S, hidden, R]
    d_b: torch.Tensor | None  # [S, R, dim]


def _down_up(lora: LayerLora, x: torch.Tensor, a: torch.Tensor, bs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    gather, back, keep = lora.slots
    groups, rank = a.shape[0], bs[0].shape[1]
    xg = x.index_select(0, gather).view(groups, gather.shape[0] // groups, x.shape[1])
    xa = torch.bmm(xg, a)  # [S, C, len(bs) * R]
    if len(bs) == 1:
        delta = torch.bmm(xa, bs[0])
    else:
        delta = torch.cat([torch.bmm(xa[..., i * rank:(i + 1) * rank], b) for i, b in enumerate(bs)], dim=2)
    delta = delta.view(gather.shape[0], delta.shape[-1]).index_select(0, back)
    return delta if keep is None else delta * keep


def qkv_delta(lora: LayerLora, x: torch.Tensor) -> torch.Tensor | None:
    return None if lora.qkv_a is None else _down_up(lora, x, lora.qkv_a, (lora.q_b, lora.k_b, lora.v_b))


def out_delta(lora: LayerLora, x: torch.Tensor) -> torch.Tensor | None:
    return None if lora.o_a is None else _down_up(lora, x, lora.o_a, (lora.o_b,))


def gate_up_delta(lora: LayerLora, x: torch.Tensor) -> torch.Tensor | None:
    return None if lora.gu_a is None else _down_up(lora, x, lora.gu_a, (lora.g_b, lora.u_b))


def down_delta(lora: LayerLora, x: torch.Tensor) -> torch.Tensor | None:
    return None if lora.d_a is None else _down_up(lora, x, lora.d_a, (lora.d_b,))


# -- reading a PEFT adapter ------------------------------------------------------


def _shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """(in, out) of each target module on this base."""
    q_width, kv_width = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    return {"q_proj": (args.dim, q_width), "k_proj": (args.dim, kv_width), "v_proj": (args.dim, kv_width),
            "o_proj": (q_width, args.dim), "gate_proj": (args.dim, args.hidden_dim),
            "up_proj": (args.dim, args.hidden_dim), "down_proj": (args.hidden_dim, args.dim)}


@dataclass(frozen=True)
class AdapterSpec:
    """What adapter_config.json says, checked."""

    rank: int
    scaling: float
    targets: frozenset[str]


def read_adapter_config(name: str, model_dir: Path, max_rank: int) -> AdapterSpec:
    path = model_dir / CONFIG_FILE
    if not path.is_file():
        raise InvalidArgument(f"adapter {name!r}: {CONFIG_FILE} is missing (a PEFT adapter folder holds "
                              f"{CONFIG_FILE} and adapter_model.safetensors)")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise InvalidArgument(f"adapter {name!r}: {CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgument(f"adapter {name!r}: {CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise InvalidArgument(f"adapter {name!r}: {CONFIG_FILE} must be a JSON object")

    def fail(field: str, reason: str) -> InvalidArgument:
        return InvalidArgument(f"adapter {name!r}: {CONFIG_FILE} field {field}: {reason}")

    if raw.get("peft_type", "LORA") != "LORA":
        raise fail("peft_type", f"{str(raw['peft_type'])[:40]!r} is not LORA; only LoRA adapters are served")
    rank = raw.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise fail("r", f"must be a positive integer, got {str(rank)[:40]!r}")
    if rank > max_rank:
        raise fail("r", f"rank {rank} is above the base's limit of {max_rank} (lora.max_lora_rank in the base's "
                        "model.toml)")
    alpha = raw.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise fail("lora_alpha", f"must be a number, got {str(alpha)[:40]!r}")
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        targets = [targets] if targets in TARGET_MODULES else None
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise fail("target_modules", "must list module names (a regular expression is not supported); known: "
                                     + ", ".join(TARGET_MODULES))
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise fail("target_modules", f"{', '.join(t[:40] for t in unknown[:4])} not known to the torch runtime; "
                                     f"known: {', '.join(TARGET_MODULES)}")
    _refuse_unsupported(raw, fail)
    use_rslora = raw.get("use_rslora", False) is True
    scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    return AdapterSpec(rank, float(scaling), frozenset(targets))


def _refuse_unsupported(raw: dict, fail) -> None:
    """PEFT options that change what the adapter computes and that this
    runtime does not apply: refused rather than silently ignored."""
    if raw.get("use_dora"):
        raise fail("use_dora", "DoRA adapters are not supported")
    if raw.get("fan_in_fan_out"):
        raise fail("fan_in_fan_out", "only the Linear layout (false) is supported")
    if raw.get("bias", "none") != "none":
        raise fail("bias", "adapters that train biases are not supported (use bias = \"none\")")
    for field in ("modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern"):
        if raw.get(field):
            raise fail(field, "is not supported by the torch runtime; leave it empty")


def adapter_identity(name: str, model_dir: Path, artifact: str) -> int:
    """The adapter's id on its base (never 0, the base's): a digest of its
    name and of the files that decide its KV (the config's scaling, the
    weights). Being the same wherever the same adapter loads, in this process,
    a restarted worker or another daemon, the prefix-cache salt it gives
    (paged_scheduler.adapter_salt) hashes a prompt the same on every node,
    so a gateway's PromptBlocks from one node finds the adapter's blocks on
    another; an adapter reloaded with other weights gets another id, so no
    cached block of the old weights is ever served to it."""
    digest = hashlib.blake2b(name.encode("utf-8") + b"\0", digest_size=8)
    for path in (model_dir / CONFIG_FILE, model_dir / artifact):
        digest.update(path.read_bytes() if path.is_file() else b"")
        digest.update(b"\0")
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1) or 1


def load_adapter(name: str, model_dir: Path, artifact: str, args: ModelArgs, max_rank: int, adapter_id: int,
                 dtype: torch.dtype, device) -> LoraWeights:
    """Read and check a PEFT adapter against the base it will run on."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    spec = read_adapter_config(name, model_dir, max_rank)
    path = model_dir / artifact
    if not path.is_file():
        raise InvalidArgument(f"adapter {name!r}: {artifact} is missing")
    try:
        tensors = load(path.read_bytes())
    except (SafetensorError, ValueError, OSError) as exc:
        raise InvalidArgument(f"adapter {name!r}: {artifact} is corrupt or truncated ({str(exc)[:120]})") from None
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(args.n_layers)]
    shapes = _shapes(args)
    seen = set()
    for key, tensor in tensors.items():
        layer, module, part = _parse_key(name, key, args.n_layers, spec.targets)
        seen.add((layer, module, part))
        d_in, d_out = shapes[module]
        want = (spec.rank, d_in) if part == "lora_A" else (d_out, spec.rank)
        if tuple(tensor.shape) != want:
            raise InvalidArgument(
                f"adapter {name!r}: tensor {key[:120]} has shape {list(tensor.shape)}, the base needs {list(want)} "
                f"(an adapter of another architecture or hidden size, or r does not match)")
        pair = layers[layer].get(module, (None, None))
        tensor = tensor.to(device=device, dtype=dtype)
        layers[layer][module] = (tensor, pair[1]) if part == "lora_A" else (pair[0], tensor)
    missing = [(i, m, p) for i in range(args.n_layers) for m in sorted(spec.targets) for p in ("lora_A", "lora_B")
               if (i, m, p) not in seen]
    if missing:
        i, m, p = missing[0]
        raise InvalidArgument(f"adapter {name!r}: {artifact} lacks {len(missing)} of the tensors its target_modules "
                              f"need, e.g. layer {i} {m}.{p}")
    return LoraWeights(adapter_id, spec.rank, spec.scaling, spec.targets, tuple(layers))


def _parse_key(name: str, key: str, n_layers: int, targets: frozenset[str]) -> tuple[int, str, str]:
    """'base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight' -> (3, 'q_proj', 'lora_A')."""
    parts = key.split(".")
    try:
        at = parts.index("layers")
        layer, module, part = int(parts[at + 1]), parts[at + 3], parts[at + 4]
    except (ValueError, IndexError):
        raise InvalidArgument(f"adapter {name!r}: tensor {key[:120]!r} is not a Llama-family LoRA weight "
                              "(an adapter of another architecture?)") from None
    if parts[-1] != "weight" or part not in ("lora_A", "lora_B") or module not in targets or not 0 <= layer < n_layers:
        raise InvalidArgument(f"adapter {name!r}: tensor {key[:120]!r} does not fit the base (layer out of range, "
                              "module outside target_modules, or another architecture)")
    return layer, module, part


# -- stacking a step's adapters --------------------------------------------------


def build_stacks(adapters: list[LoraWeights], args: ModelArgs, dtype, device) -> list[dict[str, torch.Tensor | None]]:
    """Per layer, the step's stacked matrices (LayerLora's fields but slots):
    adapter s at index s, zero-padded to the largest rank R, B times its
    adapter's scaling."""
    rank = max(a.rank for a in adapters)
    shapes = _shapes(args)
    targeted = set().union(*(a.targets for a in adapters))

    def a_stack(layer: int, module: str) -> torch.Tensor:
        d_in, _ = shapes[module]
        out = torch.zeros(len(adapters), d_in, rank, dtype=dtype, device=device)
        for s, adapter in enumerate(adapters):
            pair = adapter.layers[layer].get(module)
            if pair is not None:
                out[s, :, :adapter.rank] = pair[0].t()
        return out

    def b_stack(layer: int, module: str) -> torch.Tensor:
        _, d_out = shapes[module]
        out = torch.zeros(len(adapters), rank, d_out, dtype=dtype, device=device)
        for s, adapter in enumerate(adapters):
            pair = adapter.layers[layer].get(module)
            if pair is not None:
                out[s, :adapter.rank] = pair[1].t() * adapter.scaling
        return out

    def group(layer: int, modules: tuple[str, ...]) -> tuple:
        if not targeted & set(modules):
            return (None,) * (len(modules) + 1)
        stacked_a = torch.cat([a_stack(layer, m) for m in modules], dim=2)
        return (stacked_a, *(b_stack(layer, m) for m in modules))

    stacks = []
    for layer in range(args.n_layers):
        qkv = group(layer, ("q_proj", "k_proj", "v_proj"))
        o = group(layer, ("o_proj",))
        gu = group(layer, ("gate_proj", "up_proj"))
        d = group(layer, ("down_proj",))
        stacks.append(dict(zip(("qkv_a", "q_b", "k_b", "v_b"), qkv)) | dict(zip(("o_a", "o_b"), o))
                      | dict(zip(("gu_a", "g_b", "u_b"), gu)) | dict(zip(("d_a", "d_b"), d)))
    return stacks


def step_slots(mix: tuple[int, ...], adapter_ids: list[int], num_tokens_of: list[int], dtype, device) -> StepSlots:
    """The groups of a step whose i-th sequence runs adapter_ids[i] (0: the
    base) over num_tokens_of[i] tokens, adapter mix[s] in group s."""
    members: list[list[int]] = [[] for _ in mix]
    base_rows: list[int] = []
    row = 0
    for adapter_id, n in zip(adapter_ids, num_tokens_of):
        (members[mix.index(adapter_id)] if adapter_id else base_rows).extend(range(row, row + n))
        row += n
    capacity = max(len(rows) for rows in members)
    gather: list[int] = []
    back = [0] * row  # the base's tokens read slot 0, then keep zeroes it
    for s, rows in enumerate(members):
        for c, r in enumerate(rows):
            back[r] = s * capacity + c
        # unused slots repeat the group's first token (every group has one): computed, never read back
        gather.extend(rows + [rows[0]] * (capacity - len(rows)))
    keep = None
    if base_rows:
        keep = torch.ones(row, 1, dtype=dtype)
        keep[base_rows] = 0
        keep = keep.to(device)
    return StepSlots(torch.tensor(gather, dtype=torch.long, device=device),
                     torch.tensor(back, dtype=torch.long, device=device), keep)


class AdapterSet:
    """The adapters resident on one base runtime, and the stacks of the last
    adapter mix a step used. Touched only on the compute thread."""

    def __init__(self, args: ModelArgs, dtype, device) -> None:
        self.args, self.dtype, self.device = args, dtype, device
        self.adapters: dict[int, LoraWeights] = {}
        self._stacks: tuple[tuple[int, ...], list[dict]] | None = None

    def add(self, weights: LoraWeights) -> None:
        self.adapters[weights.adapter_id] = weights

    def remove(self, adapter_id: int) -> None:
        self.adapters.pop(adapter_id, None)
        if self._stacks is not None and adapter_id in self._stacks[0]:
            self._stacks = None

    def for_step(self, adapter_ids: list[int], num_tokens_of: list[int]) -> list[LayerLora] | None:
        """Per layer, the LayerLora of a step whose i-th sequence runs
        adapter_ids[i] (0: the base) over num_tokens_of[i] tokens; None when
        the step runs only the base."""
        mix = tuple(sorted({a for a in adapter_ids if a}))
        if not mix:
            return None
        missing = [a for a in mix if a not in self.adapters]
        if missing:
            raise RuntimeError(f"adapter {missing[0]} was unloaded while a sequence of it ran")
        if self._stacks is None or self._stacks[0] != mix:
            self._stacks = mix, build_stacks([self.adapters[a] for a in mix], self.args, self.dtype, self.device)
        slots = step_slots(mix, adapter_ids, num_tokens_of, self.dtype, self.device)
        return [LayerLora(slots, **layer) for layer in self._stacks[1]]
