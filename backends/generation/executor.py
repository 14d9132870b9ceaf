"""The seam between the shared generation loop and a backend's runtime."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Mapping

import numpy as np

from modeld.backends.errors import InvalidArgument, Unimplemented
from modeld.backends.generation.params import ChatMessage, ToolSpec
from modeld.backends.generation.interface import StepPlan


class StepExecutor(ABC):
    """Runs one scheduled step on a model and knows its vocabulary.

    `run` reads nothing but the plan: no scheduler, no sequences. It is
    called from the model's worker thread, one step at a time, and so are
    `token_bytes` and `is_end_of_generation` (the loop samples there);
    `tokenize` and `apply_chat_template` are called from the event loop,
    possibly while a step runs.
    """

    vocab_size: int

    @abstractmethod
    def run(self, plan: StepPlan) -> np.ndarray:
        """Apply plan.kv_ops, run every item of plan.work in one forward
        pass, and return the logits asked for: [sum of num_logits, vocab]
        float32, in plan order."""

    # whether native_sampler and run_picking are implemented
    samples_natively = False

    def native_sampler(self, seq):
        """A sampler the runtime draws this sampled sequence's tokens with
        where its logits lie, or None: the loop samples them in numpy. The
        loop asks once per sequence, on the worker thread, and closes it
        (`close()`) when the sequence finishes."""
        return None

    def run_picking(self, plan: StepPlan, picks: dict) -> tuple[np.ndarray, np.ndarray]:
        """run(plan), where each sequence in picks (seq id -> None for each
        of its rows' argmax, its native_sampler for its one row, or a
        sampling.WholeDraw whose `draw` takes its one row read in place) gets
        its tokens in the runtime and only the other rows are copied out:
        (tokens [rows] int64 in plan order, -1 for a copied row; logits
        [copied rows, vocab] float32 in plan order)."""
        raise NotImplementedError

    def run_greedy(self, plan: StepPlan) -> np.ndarray:
        """run(plan), then each logit row's argmax ([rows] int64): for a step
        whose every row is decoded greedily with nothing applied to its
        logits (the loop checks). A runtime that can take the argmax where
        its logits lie overrides this, and [rows, vocab] floats (192 KiB a
        row for a 49,152-token vocabulary) are never copied out of it."""
        return self.run(plan).argmax(axis=1)

    @abstractmethod
    def tokenize(self, text: str, add_special: bool = True) -> list[int]: ...

    @abstractmethod
    def token_bytes(self, token_id: int) -> bytes: ...

    @abstractmethod
    def is_end_of_generation(self, token_id: int) -> bool: ...

    @abstractmethod
    def apply_chat_template(self, messages: tuple[ChatMessage, ...], tools: tuple[ToolSpec, ...] = (),
                            template_kwargs: Mapping[str, object] | None = None) -> str:
        """The prompt the model's chat template makes of these messages and
        function definitions (backends/generation/chat_template.py), with
        template_kwargs (OpenAI's chat_template_kwargs) as extra template
        variables; the loop passes them only when a request has some."""

    def special_token_bytes(self, token_id: int) -> bytes:
        """A token's bytes with special tokens spelled out (`<|im_end|>`), for
        skip_special_tokens=false; token_bytes gives them no text."""
        return self.token_bytes(token_id)

    def end_of_generation_ids(self) -> np.ndarray:
        """Every id is_end_of_generation accepts (min_tokens masks them),
        found once by asking about each token."""
        ids = getattr(self, "_end_ids", None)
        if ids is None:
            ids = np.array([t for t in range(self.vocab_size) if self.is_end_of_generation(t)], dtype=np.int64)
            self._end_ids = ids
        return ids

    def constraint_tokenizer(self):
        """llguidance's LLTokenizer over this vocabulary (constraints.py)."""
        raise Unimplemented("this runtime cannot constrain its output (no grammar vocabulary)")

    def check_token_ids(self, token_ids) -> list[int]:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgument(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        return list(token_ids)

    def detokenize(self, token_ids: list[int]) -> str:
        return b"".join(self.token_bytes(t) for t in self.check_token_ids(token_ids)).decode("utf-8", errors="replace")

    def close(self) -> None:
        """Free the runtime's memory."""

