"""Tokenize a BYTES text input into the integer tensors a text encoder takes.

Shared by the tensor backends so a model such as all-MiniLM-L6-v2 accepts
plain sentences: [batch] BYTES in, input_ids / attention_mask /
token_type_ids ([batch, seq] int64) out to the graph.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from modeld.backends.errors import InvalidArgument, LoadFailed
from modeld.backends.model_config import TextSpec


class TextEncoder:
    def __init__(self, spec: TextSpec, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        path = model_dir / spec.tokenizer
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises plain Exception
            raise LoadFailed(f"cannot read tokenizer {spec.tokenizer!r}: {exc}") from exc
        self._tokenizer.enable_truncation(max_length=spec.max_length)
        self._tokenizer.enable_padding()
        self.spec = spec

    def encode(self, texts: np.ndarray, wanted: set[str]) -> dict[str, np.ndarray]:
        """texts: [batch] of bytes -> the wanted graph inputs, each [batch, seq] int64."""
        strings = [_decode(t) for t in texts.reshape(-1)]
        encodings = self._tokenizer.encode_batch(strings)
        fields = {
            "input_ids": [e.ids for e in encodings],
            "attention_mask": [e.attention_mask for e in encodings],
            "token_type_ids": [e.type_ids for e in encodings],
        }
        return {name: np.asarray(fields[name], dtype=np.int64) for name in wanted if name in fields}


def _decode(value: object) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"text input is not valid UTF-8: {exc}") from exc


TOKENIZER_INPUTS = {"input_ids", "attention_mask", "token_type_ids"}
