"""The torch backend: modeld's own LLM runtime.

A Llama-family model (backends/torch/model.py) over a paged KV cache whose
blocks the PagedScheduler hands out, continuous batching and speculative
decoding from the shared generation loop. CPU here; CUDA when present, with
the same code.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from pathlib import Path

import numpy as np
import structlog

from modeld.backends import openmp
from modeld.backends.artifact_paths import check_tokenizer_config
from modeld.backends.base import Backend, Capability, GenerativeModel, Verdict
from modeld.backends.compute_thread import COMPUTE_THREAD
from modeld.backends.errors import LoadFailed
from modeld.backends.generation.adapter_model import LoopAdapterModel
from modeld.backends.generation.executor import StepExecutor
from modeld.backends.generation.interface import PagedWork, StepPlan
from modeld.backends.generation.loop import GenerationLoop
from modeld.backends.generation.paged_scheduler import PagedConfig, PagedScheduler
from modeld.backends.generation.scheduler import admission_from
from modeld.backends.generation.chat_template import ChatTemplate, model_chat_template, render_chat
from modeld.backends.generation.params import ChatMessage, ToolSpec
from modeld.backends.model_config import ModelConfig, ModelFormat, TensorSpec

log = structlog.get_logger("modeld.torch")

TEXT_SIGNATURE = (TensorSpec("text_input", "BYTES", (1,)),), (TensorSpec("text_output", "BYTES", (1,)),)


class TorchBackend(Backend):
    name = "torch"
    priority = 60
    capabilities = frozenset({
        Capability.GENERATION, Capability.STREAMING, Capability.CONTINUOUS_BATCHING,
        Capability.PREFIX_CACHE, Capability.SPECULATIVE_DECODING, Capability.LOGPROBS,
        Capability.CONSTRAINED_DECODING, Capability.LORA,
    })

    def availability(self) -> Verdict:
        # find_spec, not import: importing the daemon must not load torch
        for module in ("torch", "gguf"):
            if importlib.util.find_spec(module) is None:
                return Verdict.no(f"{module} is not installed")
        return Verdict.yes()

    def can_serve(self, config: ModelConfig, model_dir: Path) -> Verdict:
        if config.format is ModelFormat.GGUF:
            if not (model_dir / config.artifact_path).exists():
                return Verdict.no(f"model file {config.artifact_path!r} is missing")
            return Verdict.yes()
        if config.format is ModelFormat.SAFETENSORS:
            if not (model_dir / "config.json").is_file():
                return Verdict.no("safetensors models need config.json")
            return Verdict.yes()
        return Verdict.no(f"torch serves GGUF or safetensors language models, not {config.format.value}")

    def estimate_bytes(self, config: ModelConfig, model_dir: Path) -> int:
        """Weights at the served dtype plus the KV block pool, and the same for
        a draft model: what load() will report, from the checkpoint headers."""
        from modeld.backends.torch.weights import gguf_footprint, safetensors_footprint

        if config.memory_estimate is not None:
            return config.memory_estimate
        openmp.apply(openmp.TORCH_SPIN_COUNT)  # before torch loads libgomp
        import torch

        from modeld.backends.torch.model import packs_weights

        options = config.backend_options.torch
        element = 4 if options.dtype == "float32" else 2
        # a tied vocabulary projection gets a packed copy beside the embedding (model.pack_weights)
        packed = packs_weights(_pick_device(options.device), getattr(torch, options.dtype))
        cells = options.num_blocks * options.block_size
        readers = [(model_dir / config.artifact_path, gguf_footprint if config.format is ModelFormat.GGUF
                    else lambda _: safetensors_footprint(model_dir))]
        if options.draft_path:
            readers.append((Path(options.draft_path), gguf_footprint))  # drafts are GGUF files
        total = 0
        for path, read in readers:
            try:
                fp = read(path)
            except Exception:  # unreadable here: load() says why; reserve the file's size meanwhile
                total += path.stat().st_size if path.is_file() else 0
                continue
            total += (fp.num_params + (fp.tied_head if packed else 0)) * element
            total += 2 * fp.n_layers * cells * fp.kv_width * element
        return total

    def load(self, config: ModelConfig, model_dir: Path) -> TorchGenerativeModel:
        openmp.apply(openmp.TORCH_SPIN_COUNT)  # before torch loads libgomp
        return COMPUTE_THREAD.submit(TorchGenerativeModel, config, model_dir).result()


def _pick_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class TorchExecutor(StepExecutor):
    """Runs paged steps: KV caches of num_blocks * block_size cells, which
    each plan item addresses through its block table."""

    def __init__(self, model, tokenizer, num_blocks: int, block_size: int, device) -> None:
        from modeld.backends.torch.model import tensor_bytes

        self.model, self.tokenizer, self.block_size, self.device = model, tokenizer, block_size, device
        args = model.args
        self.vocab_size = args.vocab_size
        self.eos = set(args.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        self.k_caches, self.v_caches = model.new_kv_caches(num_blocks * block_size)
        self.kv_bytes = tensor_bytes(self.k_caches + self.v_caches)
        self.chat_template: ChatTemplate | None = None
        self._pieces: dict[int, bytes] = {}
        self.adapters = None  # the LoRA adapters resident on this base (lora.AdapterSet), made with the first

    def run(self, plan: StepPlan[PagedWork]) -> np.ndarray:
        from modeld.backends.torch.step import build_step

        batch = build_step(plan, self.block_size, self.device)
        lora = None
        if self.adapters is not None:
            lora = self.adapters.for_step([w.adapter for w in plan.work], [len(w.token_ids) for w in plan.work])
        logits = self.model(batch, self.k_caches, self.v_caches, lora)
        return logits.cpu().numpy()

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special)["input_ids"])

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = _token_bytes(self.tokenizer, token_id)
            self._pieces[token_id] = piece
        return piece

    def is_end_of_generation(self, token_id: int) -> bool:
        return token_id in self.eos

    def special_token_bytes(self, token_id: int) -> bytes:
        if token_id in self._special_ids():
            return (self.tokenizer.convert_ids_to_tokens(token_id) or "").encode("utf-8")
        return self.token_bytes(token_id)

    def _special_ids(self) -> frozenset[int]:
        special = getattr(self, "_special", None)
        if special is None:  # the tokenizer builds this list anew on each read
            special = self._special = frozenset(self.tokenizer.all_special_ids)
        return special

    def end_of_generation_ids(self) -> np.ndarray:
        return np.array(sorted(self.eos), dtype=np.int64)

    def constraint_tokenizer(self):
        """llguidance's tokenizer over the Hugging Face one (a fast tokenizer:
        llguidance reads its Rust form), padded to the model's vocabulary."""
        import llguidance.hf

        return llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=sorted(self.eos))

    def apply_chat_template(self, messages: tuple[ChatMessage, ...], tools: tuple[ToolSpec, ...] = (),
                            template_kwargs=None) -> str:
        return render_chat(self.chat_template, messages, tools, template_kwargs)


_BYTE_DECODER: dict[str, int] | None = None


def _token_bytes(tokenizer, token_id: int) -> bytes:
    """A byte-level BPE token's raw bytes (a token may hold part of a character)."""
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        # GPT-2's printable stand-ins for the 256 byte values
        visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
        codes, extra = visible[:], 0
        for b in range(256):
            if b not in visible:
                visible.append(b)
                codes.append(256 + extra)
                extra += 1
        _BYTE_DECODER = {chr(c): b for b, c in zip(visible, codes)}
    token = tokenizer.convert_ids_to_tokens(token_id)
    if token is None:
        return b""
    if token in tokenizer.all_special_tokens:
        return b""
    if all(ch in _BYTE_DECODER for ch in token):
        return bytes(_BYTE_DECODER[ch] for ch in token)
    return tokenizer.decode([token_id]).encode("utf-8")


def _build_model(fmt: ModelFormat, path: Path, model_dir: Path, device, dtype, context_length: int):
    from modeld.backends.torch.model import Transformer
    from modeld.backends.torch.weights import load_gguf, load_safetensors

    args, state = load_gguf(path) if fmt is ModelFormat.GGUF else load_safetensors(model_dir)
    model = Transformer(args, bias=any(k.endswith(".bias") for k in state),
                        max_positions=context_length)
    missing, unexpected = model.load_weights(state)
    if missing or unexpected:
        raise LoadFailed(f"checkpoint does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model = model.to(device=device, dtype=dtype).eval()
    model.pack_weights()  # fp32 on the CPU only; a no-op elsewhere
    return model


def _compile(model, k_caches, v_caches, block_size: int, device) -> bool:
    """torch.compile the model's layers and compile each step shape now, not
    during a request. Falls back to eager when inductor cannot build here
    (no C++ compiler, say): slower, never wrong."""
    from modeld.backends.torch.model import run_layer
    from modeld.backends.torch.step import warmup_steps

    started = time.monotonic()
    model.compile()
    try:
        for batch in warmup_steps(block_size, device):
            model(batch, k_caches, v_caches)
    except Exception as exc:
        log.warning("torch_compile_failed", reason=f"{type(exc).__name__}: {str(exc)[:300]}", fallback="eager")
        model.run_layer, model.compiled = run_layer, False
        return False
    # tens of seconds the first time on a machine, less once inductor's on-disk cache holds the graphs
    log.info("torch_compiled", seconds=round(time.monotonic() - started, 1))
    return True


def load_tokenizer(config: ModelConfig, model_dir: Path):
    from transformers import AutoTokenizer

    if config.format is ModelFormat.GGUF:
        from modeld.backends.torch.tokenizer_cache import load_gguf_tokenizer

        return load_gguf_tokenizer((model_dir / config.artifact_path).resolve())
    check_tokenizer_config(config.name, model_dir)  # its *_file keys name what transformers opens
    return AutoTokenizer.from_pretrained(str(model_dir))


class TorchGenerativeModel(GenerativeModel):
    def __init__(self, config: ModelConfig, model_dir: Path) -> None:
        import torch

        options = config.backend_options.torch
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[options.dtype]
        threads = options.threads
        if threads and threads != torch.get_num_threads():
            # only when asked: it changes the OpenMP team llama.cpp shares
            torch.set_num_threads(threads)
        device = _pick_device(options.device)
        context_length = options.context_length
        self.model = _build_model(config.format, model_dir / config.artifact_path, model_dir, device, dtype,
                                  context_length)
        args = self.model.args
        self.tokenizer = load_tokenizer(config, model_dir)
        # the tokenizer's template (a GGUF's metadata), rendered by the same
        # code as llama.cpp's, so both backends build the same prompt
        template = model_chat_template(config, model_dir, getattr(self.tokenizer, "chat_template", None)
                                       or "", self.tokenizer.special_tokens_map)
        block_size = options.block_size
        self.scheduler = PagedScheduler(PagedConfig(
            num_blocks=options.num_blocks, block_size=block_size,
            context_length=min(context_length, args.max_seq_len),
            max_running=options.max_running, max_step_tokens=options.max_step_tokens,
            max_waiting=options.max_waiting, admission=admission_from(options),
            max_loras_per_batch=config.lora.max_loras_per_batch,
        ))
        self.lora = config.lora
        self.dtype = dtype
        self.runner = TorchExecutor(self.model, self.tokenizer, self.scheduler.config.num_blocks, block_size, device)
        self.runner.chat_template = template
        if options.compile:
            _compile(self.model, self.runner.k_caches, self.runner.v_caches, block_size, device)
        self.nbytes = self.model.weight_bytes() + self.runner.kv_bytes
        self.inputs, self.outputs = TEXT_SIGNATURE
        self.device = device
        self.draft = None
        if options.draft_path:
            from modeld.backends.torch.draft import TorchDraft

            draft_model = _build_model(ModelFormat.GGUF, Path(options.draft_path), model_dir, device, dtype,
                                       context_length)
            if draft_model.args.vocab_size != args.vocab_size:
                raise LoadFailed("the draft model must share the target's vocabulary "
                                 f"({draft_model.args.vocab_size} vs {args.vocab_size} tokens)")
            self.draft = TorchDraft(draft_model, options.num_blocks, block_size, device)
            if options.compile:
                _compile(draft_model, self.draft.k_caches, self.draft.v_caches, block_size, device)
            self.nbytes += self.draft.nbytes
        self.loop = GenerationLoop(runner=self.runner, scheduler=self.scheduler, draft=self.draft,
                                   worker=COMPUTE_THREAD)

    def load_adapter(self, config: ModelConfig, model_dir: Path) -> TorchAdapterModel:
        """Read a PEFT adapter of this base and make it resident: its matrices
        only, the base's weights stay shared. Raises InvalidArgument naming
        the adapter, the field and the reason."""
        from modeld.backends.torch.lora import AdapterSet, adapter_identity, load_adapter

        weights = load_adapter(config.name, model_dir, config.artifact_path, self.model.args,
                               self.lora.max_lora_rank, 0, self.dtype, self.device)
        # after the checks above, which bound what the digest reads
        weights = dataclasses.replace(weights, adapter_id=adapter_identity(config.name, model_dir,
                                                                           config.artifact_path))

        def register() -> None:  # on the compute thread, between steps
            if self.runner.adapters is None:
                self.runner.adapters = AdapterSet(self.model.args, self.dtype, self.device)
            if weights.adapter_id in self.runner.adapters.adapters:
                # the engine unloads an adapter before loading it again: only a 64-bit digest collision gets here
                raise LoadFailed(f"adapter {config.name!r}: another resident adapter has the same identity digest")
            self.runner.adapters.add(weights)
        COMPUTE_THREAD.submit(register).result()
        return TorchAdapterModel(self, weights)

    def unload_adapter(self, adapter_id: int) -> None:
        def remove() -> None:
            if self.runner.adapters is not None:
                self.runner.adapters.remove(adapter_id)
        COMPUTE_THREAD.submit(remove).result()

    def unload(self) -> None:
        COMPUTE_THREAD.submit(self._release).result()

    def _release(self) -> None:
        self.draft = None
        self.loop.draft = None
        self.runner.k_caches.clear()
        self.runner.v_caches.clear()
        self.model = None
        self.runner.model = None


class TorchAdapterModel(LoopAdapterModel):
    """A LoRA adapter served as a model of its own: requests naming it run on
    its base's generation loop, in the same steps as the base's and other
    adapters' sequences, with the adapter's low-rank products on top."""

    def __init__(self, base: TorchGenerativeModel, weights) -> None:
        super().__init__(base, weights.adapter_id, weights.rank, weights.nbytes, TEXT_SIGNATURE)

    def unload(self) -> None:
        if self.base.model is not None:
            self.base.unload_adapter(self.adapter_id)
