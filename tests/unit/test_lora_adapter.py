"""Reading a PEFT adapter against its base (a tiny Llama shape, no
weights): what is refused, naming the adapter, the field and the reason;
and the stacked low-rank product against each adapter's own."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from modeld.backends.errors import InvalidArgument
from modeld.backends.torch.lora import AdapterSet, LayerLora, _shapes, load_adapter, qkv_delta
from modeld.backends.torch.weights import ModelArgs

ARGS = ModelArgs(vocab_size=32, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=16, norm_eps=1e-5,
                 rope_theta=10000.0, max_seq_len=64, tie_embeddings=True)


def _write(folder, rank=4, targets=("q_proj", "v_proj"), args=ARGS, seed=0, **config):
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(args.n_layers):
        for module in targets:
            d_in, d_out = _shapes(args)[module]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=generator)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets), **config}))
    return folder


def _load(folder, max_rank=8, adapter_id=1):
    return load_adapter("ad", folder, "adapter_model.safetensors", ARGS, max_rank, adapter_id, torch.float32, "cpu")


def test_a_good_adapter_loads_with_pefts_scaling(tmp_path):
    weights = _load(_write(tmp_path / "a"))
    assert weights.rank == 4 and weights.scaling == 2.0 and weights.targets == {"q_proj", "v_proj"}
    assert weights.nbytes == 2 * 4 * ((8 + 8) + (8 + 4)) * 4
    rs = _load(_write(tmp_path / "rs", use_rslora=True))
    assert rs.scaling == pytest.approx(8 / 2)  # lora_alpha / sqrt(r)


@pytest.mark.parametrize("change, field", [
    ({"r": 16}, "max_lora_rank"),
    ({"target_modules": ["q_proj", "lm_head"]}, "lm_head"),
    ({"target_modules": ".*proj"}, "regular expression"),
    ({"use_dora": True}, "use_dora"),
    ({"peft_type": "IA3"}, "peft_type"),
    ({"bias": "all"}, "bias"),
    ({"layers_to_transform": [0]}, "layers_to_transform"),
])
def test_config_fields_the_runtime_cannot_apply_are_refused(tmp_path, change, field):
    folder = _write(tmp_path / "a")
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(InvalidArgument, match=field) as info:
        _load(folder)
    assert "'ad'" in str(info.value)


def test_a_truncated_file_and_another_hidden_size_are_refused(tmp_path):
    folder = _write(tmp_path / "a")
    data = (folder / "adapter_model.safetensors").read_bytes()
    (folder / "adapter_model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(InvalidArgument, match="corrupt or truncated"):
        _load(folder)
    wider = dataclasses.replace(ARGS, dim=12, hidden_dim=24)
    with pytest.raises(InvalidArgument, match="another architecture or hidden size"):
        _load(_write(tmp_path / "b", args=wider))


def test_missing_layers_are_refused(tmp_path):
    folder = _write(tmp_path / "a", args=dataclasses.replace(ARGS, n_layers=1))
    with pytest.raises(InvalidArgument, match="lacks"):
        _load(folder)


def test_the_stacked_product_gives_each_token_its_own_adapters_delta(tmp_path):
    one, two = _load(_write(tmp_path / "a", rank=4, seed=1), adapter_id=1), _load(
        _write(tmp_path / "b", rank=2, targets=("q_proj", "k_proj", "v_proj"), seed=2), adapter_id=2)
    adapters = AdapterSet(ARGS, torch.float32, "cpu")
    adapters.add(one)
    adapters.add(two)
    # three sequences: base (2 tokens), adapter 2 (1 token), adapter 1 (3 tokens)
    lora: LayerLora = adapters.for_step([0, 2, 1], [2, 1, 3])[0]
    x = torch.randn(6, ARGS.dim)
    delta = qkv_delta(lora, x)

    def own(weights, rows):
        parts = []
        for module in ("q_proj", "k_proj", "v_proj"):
            pair = weights.layers[0].get(module)
            width = _shapes(ARGS)[module][1]
            parts.append(x[rows] @ pair[0].t() @ pair[1].t() * weights.scaling if pair else torch.zeros(len(rows), width))
        return torch.cat(parts, dim=1)
    assert torch.equal(delta[:2], torch.zeros(2, delta.shape[1]))  # the base's tokens: exactly nothing
    torch.testing.assert_close(delta[2:3], own(two, [2]))
    torch.testing.assert_close(delta[3:], own(one, [3, 4, 5]))
