"""llama.cpp backend: GGUF language models with continuous batching, prefix
caching and speculative decoding, on llama-cpp-python's low-level API."""

from __future__ import annotations

from pathlib import Path

from modeld.backends.compute_thread import COMPUTE_THREAD
from modeld.backends.base import Backend, Capability, GenerativeModel, Verdict
from modeld.backends.errors import LoadFailed
from modeld.backends.generation.executor import StepExecutor
from modeld.backends.generation.interface import SlotWork, StepPlan
from modeld.backends.generation.loop import GenerationLoop, GenerationObserver
from modeld.backends.generation.chat_template import ChatTemplate, model_chat_template, render_chat
from modeld.backends.generation.params import ChatMessage, ToolSpec
from modeld.backends.generation.scheduler import admission_from
from modeld.backends.generation.slot_scheduler import SlotConfig
from modeld.backends.llamacpp.lora import AdapterSlotScheduler
from modeld.backends.model_config import ModelConfig, ModelFormat, TensorSpec
from modeld.backends.options import LlamaCppOptions
from modeld.backends.tensor_model import process_rss

TEXT_SIGNATURE = (TensorSpec("text_input", "BYTES", (1,)),), (TensorSpec("text_output", "BYTES", (1,)),)


class LlamaCppBackend(Backend):
    name = "llamacpp"
    priority = 80
    capabilities = frozenset({
        Capability.GENERATION, Capability.STREAMING, Capability.CONTINUOUS_BATCHING,
        Capability.PREFIX_CACHE, Capability.SPECULATIVE_DECODING, Capability.LOGPROBS,
        Capability.CONSTRAINED_DECODING, Capability.LORA,
    })

    def availability(self) -> Verdict:
        import importlib.util

        # find_spec, not import: importing the daemon must not load llama.cpp
        if importlib.util.find_spec("llama_cpp") is None:
            return Verdict.no("llama-cpp-python is not installed (pip install llama-cpp-python)")
        return Verdict.yes()

    def can_serve(self, config: ModelConfig, model_dir: Path) -> Verdict:
        return self._serves_file(config, model_dir, ModelFormat.GGUF)

    def estimate_bytes(self, config: ModelConfig, model_dir: Path) -> int:
        if config.memory_estimate is not None:
            return config.memory_estimate
        # weights plus a rough f16 KV figure; replaced by the measured one after load
        return (model_dir / config.artifact_path).stat().st_size + config.backend_options.llamacpp.n_ctx * 32 * 1024

    def load(self, config: ModelConfig, model_dir: Path) -> LlamaGenerativeModel:
        return COMPUTE_THREAD.submit(LlamaGenerativeModel, config, model_dir).result()


class LlamaExecutor(StepExecutor):
    def __init__(self, model, context, chat_template: ChatTemplate | None = None) -> None:
        self.model, self.context, self.chat_template = model, context, chat_template
        self.vocab_size = model.vocab_size

    def run(self, plan: StepPlan[SlotWork]):
        return self.context.run(plan)

    def run_greedy(self, plan: StepPlan[SlotWork]):
        return self.context.run(plan, argmax_only=True)

    samples_natively = True

    def native_sampler(self, seq):
        from modeld.backends.llamacpp.native_sampling import NativeSampler, samples_natively

        if not samples_natively(seq.params):
            return None
        return NativeSampler(self.model, seq.params, seq.prompt_ids, seq.token_ids[seq.num_prompt:])

    def run_picking(self, plan: StepPlan[SlotWork], picks: dict):
        return self.context.run_picking(plan, picks)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.model.tokenize(text, add_special)

    def token_bytes(self, token_id: int) -> bytes:
        return self.model.token_bytes(token_id)

    def is_end_of_generation(self, token_id: int) -> bool:
        return self.model.is_end_of_generation(token_id)

    def special_token_bytes(self, token_id: int) -> bytes:
        return self.model.special_token_bytes(token_id)

    def end_of_generation_ids(self):
        return self.model.end_of_generation_ids()

    def constraint_tokenizer(self):
        return self.model.constraint_tokenizer()

    def apply_chat_template(self, messages: tuple[ChatMessage, ...], tools: tuple[ToolSpec, ...] = (),
                            template_kwargs=None) -> str:
        return render_chat(self.chat_template, messages, tools, template_kwargs)


class LlamaGenerativeModel(GenerativeModel):
    def __init__(self, config: ModelConfig, model_dir: Path, observer: GenerationObserver | None = None) -> None:
        from modeld.backends.llamacpp.context import LlamaContext, LlamaModel

        options = config.backend_options.llamacpp
        n_ctx, n_slots, threads, step = options.n_ctx, options.n_slots, options.n_threads, options.max_step_tokens
        path = model_dir / config.artifact_path
        rss_before = process_rss()
        self.llama_model = LlamaModel(path)
        try:
            # the model's own Jinja template (GGUF metadata), run as transformers
            # runs it, rather than llama.cpp's built-in matcher, which knows no tools
            template = model_chat_template(config, model_dir, self.llama_model.chat_template_source(),
                                           self.llama_model.special_tokens())
        except BaseException:
            self.llama_model.close()
            raise
        self.context = LlamaContext(self.llama_model, n_ctx, n_slots, step, threads)
        kv_bytes = n_ctx * self.llama_model.kv_bytes_per_token()
        # mmap'd weights count once touched; the KV cache is allocated at once
        self.nbytes = max(path.stat().st_size + kv_bytes, process_rss() - rss_before)
        self.inputs, self.outputs = TEXT_SIGNATURE
        context_length = min(options.context_length, self.llama_model.n_ctx_train, n_ctx // n_slots)
        self.scheduler = AdapterSlotScheduler(SlotConfig(
            num_slots=n_slots, kv_capacity=n_ctx, context_length=context_length,
            max_step_tokens=step, max_prefill_tokens=options.max_prefill_tokens, max_waiting=options.max_waiting,
            admission=admission_from(options),
        ), config.lora)
        self.adapters = None  # the LoRA adapters resident on this base (lora.AdapterSet), made with the first
        self.runner = LlamaExecutor(self.llama_model, self.context, template)
        self.draft = self._load_draft(options, n_ctx, n_slots, step, threads)
        if self.draft is not None:
            self.nbytes += self.draft.nbytes
        self.loop = GenerationLoop(runner=self.runner, scheduler=self.scheduler, observer=observer, draft=self.draft,
                                   worker=COMPUTE_THREAD)

    def _load_draft(self, options: LlamaCppOptions, n_ctx: int, n_slots: int, step: int, threads: int):
        """The draft model named by draft_model (the engine resolves its path)."""
        from modeld.backends.llamacpp.context import LlamaContext, LlamaModel
        from modeld.backends.llamacpp.draft import LlamaDraft

        path = options.draft_path
        if not path:
            return None
        rss_before = process_rss()
        model = LlamaModel(Path(path))
        if model.vocab_size != self.llama_model.vocab_size:
            model.close()
            raise LoadFailed(f"draft model {options.draft_model!r} has {model.vocab_size} tokens, "
                             f"the target {self.llama_model.vocab_size}: they must share a vocabulary")
        draft = LlamaDraft(model, LlamaContext(model, n_ctx, n_slots, step, threads))
        draft.nbytes = max(Path(path).stat().st_size + n_ctx * model.kv_bytes_per_token(), process_rss() - rss_before)
        return draft

    def load_adapter(self, config: ModelConfig, model_dir: Path):
        """Check a GGUF LoRA of this base and make it resident (backends/llamacpp/lora.py)."""
        from modeld.backends.llamacpp.lora import load_adapter

        return load_adapter(self, config, model_dir)

    def unload(self) -> None:
        COMPUTE_THREAD.submit(self._release).result()

    def _release(self) -> None:
        from modeld.backends.llamacpp.lora import release_adapters

        release_adapters(self)  # before the model: llama.cpp frees what is left of them with it
        if self.draft is not None:
            self.draft.close()
        self.context.close()
        self.llama_model.close()
