"""The onnx-genai backend: language models on onnxruntime-genai's Engine.

A model is a folder as onnxruntime-genai's model builder writes it:
model.onnx (+ model.onnx.data), genai_config.json and the tokenizer files;
model.toml says `format = "onnx"` and names model.onnx as the artifact.

What the installed onnxruntime-genai (0.18, CPU) does, and so what this
backend declares: generation and streaming; requests that arrive together
run as one batched forward pass, in og's static batches of at most 4, several
batches stepped in turn (batches.py), which is DYNAMIC_BATCHING and not
CONTINUOUS_BATCHING: a sequence cannot join a batch that has started. Its
continuous-batching engine, prefix caching included, needs a PagedAttention
model, which the builder makes only for CUDA or WebGPU in fp16/bf16. No
speculation (the engine drafts only with an MTP head or a block drafter in
the model) and no logprobs (the engine returns tokens, not scores): requests
for them fail UNIMPLEMENTED.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from modeld.backends.artifact_paths import scrub_paths
from modeld.backends.base import Backend, Capability, GenerativeModel, Verdict
from modeld.backends.compute_thread import COMPUTE_THREAD
from modeld.backends.errors import LoadFailed
from modeld.backends.model_config import ModelConfig, ModelFormat, TensorSpec
from modeld.backends.onnx_genai.batches import OG_STATIC_BATCH_SIZE, BatchConfig, BatchScheduler
from modeld.backends.onnx_genai.config_check import GENAI_CONFIG, check_genai_config
from modeld.backends.tensor_model import process_rss

TEXT_SIGNATURE = (TensorSpec("text_input", "BYTES", (1,)),), (TensorSpec("text_output", "BYTES", (1,)),)


class OnnxGenaiBackend(Backend):
    name = "onnx-genai"
    priority = 50  # after llamacpp (80) and torch (60)
    capabilities = frozenset({Capability.GENERATION, Capability.STREAMING, Capability.DYNAMIC_BATCHING})

    def availability(self) -> Verdict:
        # find_spec, not import: importing the daemon must not load onnxruntime-genai
        if importlib.util.find_spec("onnxruntime_genai") is None:
            return Verdict.no("onnxruntime-genai is not installed (pip install onnxruntime-genai)")
        return Verdict.yes()

    def can_serve(self, config: ModelConfig, model_dir: Path) -> Verdict:
        verdict = self._serves_file(config, model_dir, ModelFormat.ONNX)
        if not verdict.ok:
            return verdict
        if not (model_dir / config.artifact_path).parent.joinpath(GENAI_CONFIG).is_file():
            return Verdict.no(f"no {GENAI_CONFIG} beside {config.artifact_path}: not an onnxruntime-genai model "
                              "folder (build one with onnxruntime_genai.models.builder)")
        return Verdict.yes()

    def estimate_bytes(self, config: ModelConfig, model_dir: Path) -> int:
        if config.memory_estimate is not None:
            return config.memory_estimate
        folder = (model_dir / config.artifact_path).parent
        try:
            kv = kv_reserve(read_genai_config(folder), config.backend_options.onnx_genai)
        except LoadFailed:
            kv = 0  # load() says what is wrong with the folder
        return weights_bytes(folder) + kv

    def load(self, config: ModelConfig, model_dir: Path) -> OnnxGenaiModel:
        return COMPUTE_THREAD.submit(OnnxGenaiModel, config, model_dir).result()


def read_genai_config(folder: Path) -> dict:
    try:
        return json.loads((folder / GENAI_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LoadFailed(f"cannot read {GENAI_CONFIG}: {scrub_paths(str(exc), (folder,))}") from exc


def weights_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and ".onnx" in p.name)


def kv_reserve(genai: dict, options) -> int:
    """KV bytes at most: every running sequence at the full context. og's
    static batch keeps K and V of each layer as fp32 [batch, kv_heads,
    length, head_size] (the model's I/O type on CPU), sized by its longest
    request, and frees them when the batch ends."""
    try:
        decoder = genai["model"]["decoder"]
        per_token = 2 * decoder["num_hidden_layers"] * decoder["num_key_value_heads"] * decoder["head_size"] * 4
    except (KeyError, TypeError) as exc:
        raise LoadFailed(f"{GENAI_CONFIG} lacks model.decoder.{exc}") from exc
    return per_token * options.context_length * options.max_running


def _eos_ids(genai: dict) -> list[int]:
    eos = genai.get("model", {}).get("eos_token_id", [])
    return [eos] if isinstance(eos, int) else [int(e) for e in eos]


def _overlay(options) -> dict:
    """Settings applied over genai_config.json at load; the folder is not changed."""
    overlay: dict = {"search": {"max_length": options.context_length}}
    if options.threads:
        overlay["model"] = {"decoder": {"session_options": {"intra_op_num_threads": options.threads}}}
    return overlay


class OnnxGenaiModel(GenerativeModel):
    """Runs on the compute thread (see compute_thread.py): loading, every
    step and unloading, like the other language-model backends."""

    def __init__(self, config: ModelConfig, model_dir: Path) -> None:
        import onnxruntime_genai as og

        from modeld.backends.onnx_genai.engines import EngineSet
        from modeld.backends.onnx_genai.loop import EngineLoop
        from modeld.backends.onnx_genai.vocab import Vocabulary

        options = config.backend_options.onnx_genai
        folder = (model_dir / config.artifact_path).parent
        genai = read_genai_config(folder)
        # before og.Config: og would load what the config names as it stands
        check_genai_config(config.name, folder, genai, config.policy.onnx_genai_allowed_keys)
        context_length = min(options.context_length, int(genai["model"].get("context_length", options.context_length)))
        rss_before = process_rss()
        try:
            og_config = og.Config(str(folder))
            og_config.overlay(json.dumps(_overlay(options)))
            self.og_model = og.Model(og_config)
            og_tokenizer = og.Tokenizer(self.og_model)
        except Exception as exc:
            raise LoadFailed(f"onnxruntime-genai cannot load {folder.name}/: {scrub_paths(str(exc), (folder,))}") from exc
        eos = _eos_ids(genai)
        self.vocab = Vocabulary(folder, og_tokenizer, set(eos) | set(og_tokenizer.eos_token_ids), config.name)
        self.runner = self.vocab  # tokenize / detokenize, as GenerativeModel expects of its runner
        # the weights are in memory (and prepacked by onnxruntime) after load;
        # the KV reserve is what the batches may take on top
        self.nbytes = max(weights_bytes(folder), process_rss() - rss_before) + kv_reserve(genai, options)
        self.inputs, self.outputs = TEXT_SIGNATURE
        self.scheduler = BatchScheduler(BatchConfig(
            max_running=options.max_running, context_length=context_length, max_waiting=options.max_waiting))
        self.engines = EngineSet(self.og_model, event_capacity=4 * OG_STATIC_BATCH_SIZE)
        self.loop = EngineLoop(self.engines, self.scheduler, self.vocab, COMPUTE_THREAD,
                               eos_token_id=eos[0] if len(eos) == 1 else None)

    def unload(self) -> None:
        COMPUTE_THREAD.submit(self._release).result()

    def _release(self) -> None:
        self.engines.close()
        self.og_model = None
