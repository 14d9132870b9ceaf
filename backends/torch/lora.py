"""LoRA adapters on the torch runtime: read a PEFT adapter, and apply many
adapters in one forward pass over the shared base weights.

PEFT's LoRA adds to a projection W (out x in) the low-rank product
B @ A * scaling, with A: [r, in], B: [out, r] and scaling = lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora). Nothing is merged into W and no
copy of W is made: each step the base matmul runs once for every token, and
the adapters' products are added on top (the Punica / S-LoRA idea).

One step mixes S adapters (at most the base's max_loras_per_batch). Their
A matrices are stacked, each padded with zero rows to the step's largest
rank R, into one [S * R, in] matrix per projection, and their B matrices
into one [out, S * R]. Then for the step's tokens x: [T, in]

    xa    = x @ A_stack.T           [T, S * R]   every adapter's down-projection
    xa   *= mask                    mask[t, s*R:(s+1)*R] = scaling_s where token t
                                    runs adapter s, else 0 (the base's tokens: all 0)
    delta = xa @ B_stack.T          [T, out]     only the token's own adapter survives

Two matrix products per projection whatever the mix, instead of a Python
loop over adapters or sequences; the zeros cost S * R columns of compute,
small beside the base's `in` columns at the ranks adapters use. A token of
another adapter multiplies by exactly 0, so each sequence's output is the
one its adapter alone gives. The stacks depend only on which adapters the
step mixes, so they are built once per adapter set and reused while it
lasts (decode steps keep the same set for many steps).
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


class LayerLora(NamedTuple):
    """One layer's stacks for a step (see the module docstring); a group no
    adapter of the step targets is None and costs nothing."""

    mask: torch.Tensor  # [T, S * R]
    qkv_a: torch.Tensor | None  # [3 * S * R, dim]: q's rows, then k's, then v's
    q_b: torch.Tensor | None  # [q_width, S * R]
    k_b: torch.Tensor | None  # [kv_width, S * R]
    v_b: torch.Tensor | None
    o_a: torch.Tensor | None  # [S * R, q_width]
    o_b: torch.Tensor | None  # [dim, S * R]
    gu_a: torch.Tensor | None  # [2 * S * R, dim]: gate's rows, then up's
    g_b: torch.Tensor | None  # [hidden, S * R]
    u_b: torch.Tensor | None
    d_a: torch.Tensor | None  # [S * R, hidden]
    d_b: torch.Tensor | None  # [dim, S * R]


def qkv_delta(lora: LayerLora, x: torch.Tensor, project) -> torch.Tensor | None:
    if lora.qkv_a is None:
        return None
    tokens, width = x.shape[0], lora.mask.shape[1]
    xa = project(x, lora.qkv_a).view(tokens, 3, width) * lora.mask[:, None, :]
    return torch.cat((project(xa[:, 0], lora.q_b), project(xa[:, 1], lora.k_b), project(xa[:, 2], lora.v_b)), dim=1)


def out_delta(lora: LayerLora, x: torch.Tensor, project) -> torch.Tensor | None:
    if lora.o_a is None:
        return None
    return project(project(x, lora.o_a) * lora.mask, lora.o_b)


def gate_up_delta(lora: LayerLora, x: torch.Tensor, project) -> torch.Tensor | None:
    if lora.gu_a is None:
        return None
    tokens, width = x.shape[0], lora.mask.shape[1]
    xa = project(x, lora.gu_a).view(tokens, 2, width) * lora.mask[:, None, :]
    return torch.cat((project(xa[:, 0], lora.g_b), project(xa[:, 1], lora.u_b)), dim=1)


def down_delta(lora: LayerLora, x: torch.Tensor, project) -> torch.Tensor | None:
    if lora.d_a is None:
        return None
    return project(project(x, lora.d_a) * lora.mask, lora.d_b)


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
    """Per layer, the step's stacked matrices (LayerLora's fields but mask),
    adapter s in rows [s * R, (s + 1) * R), zero-padded to the largest rank R."""
    rank = max(a.rank for a in adapters)
    width = len(adapters) * rank
    shapes = _shapes(args)
    targeted = set().union(*(a.targets for a in adapters))

    def a_stack(layer: int, module: str) -> torch.Tensor:
        d_in, _ = shapes[module]
        out = torch.zeros(width, d_in, dtype=dtype, device=device)
        for s, adapter in enumerate(adapters):
            pair = adapter.layers[layer].get(module)
            if pair is not None:
                out[s * rank:s * rank + adapter.rank] = pair[0]
        return out

    def b_stack(layer: int, module: str) -> torch.Tensor:
        _, d_out = shapes[module]
        out = torch.zeros(d_out, width, dtype=dtype, device=device)
        for s, adapter in enumerate(adapters):
            pair = adapter.layers[layer].get(module)
            if pair is not None:
                out[:, s * rank:s * rank + adapter.rank] = pair[1]
        return out

    def group(layer: int, modules: tuple[str, ...]) -> tuple:
        if not targeted & set(modules):
            return (None,) * (len(modules) + 1)
        stacked_a = torch.cat([a_stack(layer, m) for m in modules]) if len(modules) > 1 else a_stack(layer, modules[0])
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
        stacks = self._stacks[1]
        rank = max(self.adapters[a].rank for a in mix)
        mask = torch.zeros(sum(num_tokens_of), len(mix) * rank, dtype=self.dtype)
        row = 0
        for adapter_id, n in zip(adapter_ids, num_tokens_of):
            if adapter_id:
                s = mix.index(adapter_id)
                mask[row:row + n, s * rank:(s + 1) * rank] = self.adapters[adapter_id].scaling
            row += n
        mask = mask.to(self.device)
        return [LayerLora(mask=mask, **layer) for layer in stacks]
