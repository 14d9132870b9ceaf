"""Tokenize a BYTES text input into the integer tensors a text encoder takes.

Shared by the tensor backends so a model such as all-MiniLM-L6-v2 accepts
plain sentences: [batch] BYTES in, input_ids / attention_mask /
token_type_ids ([batch, seq] int64) out to the graph.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from modeld.backends.artifact_paths import scrub_paths
from modeld.backends.errors import InvalidArgument, LoadFailed
from modeld.backends.model_config import TextSpec


class TextEncoder:
    def __init__(self, spec: TextSpec, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        path = model_dir / spec.tokenizer  # the config parser keeps it relative, without '..'
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises plain Exception
            raise LoadFailed(f"cannot read tokenizer {spec.tokenizer!r}: {scrub_paths(str(exc), (model_dir,))}") from exc
        self._tokenizer.enable_truncation(max_length=spec.max_length)
        self._tokenizer.no_padding()
        self.spec = spec

    def encode_buckets(self, texts: np.ndarray, wanted: set[str],
                       pairs: np.ndarray | None = None) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
        """texts: [batch] of bytes -> (row indices, graph inputs [rows, seq] int64) per bucket.

        With `pairs` ([batch] of bytes) each row is the pair (texts[i],
        pairs[i]) as a cross-encoder reads it: one sequence, the tokenizer's
        pair template, token_type_ids 0 then 1, truncated longest first.

        A merged batch pads every sentence to its longest one, and on a
        compute-bound CPU the padding costs more than batching saves; so
        rows are sorted by length and cut into buckets whose longest row is
        at most BUCKET_SPREAD times their shortest.
        """
        strings = [_decode(t) for t in texts.reshape(-1)]
        if pairs is not None:
            strings = list(zip(strings, [_decode(t) for t in pairs.reshape(-1)]))
        if len(strings) == 1:
            # One sentence (a lone request): encode_batch would hand it to the
            # tokenizers thread pool and wait for it, two thread hand-offs
            # (and pool threads left spinning) for nothing; same encodings.
            one = strings[0]
            encodings = [self._tokenizer.encode(*one) if pairs is not None else self._tokenizer.encode(one)]
        else:
            encodings = self._tokenizer.encode_batch(strings)
        order = sorted(range(len(encodings)), key=lambda i: len(encodings[i].ids))
        buckets, current = [], []
        for index in order:
            if current and len(encodings[index].ids) > BUCKET_SPREAD * len(encodings[current[0]].ids):
                buckets.append(current)
                current = []
            current.append(index)
        if current:
            buckets.append(current)
        return [(np.asarray(rows), _pad([encodings[i] for i in rows], wanted)) for rows in buckets]


BUCKET_SPREAD = 1.25


def _pad(encodings, wanted: set[str]) -> dict[str, np.ndarray]:
    width = max(len(e.ids) for e in encodings)
    fields = {"input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"}
    feeds = {}
    for name in wanted:
        if name in fields:
            array = np.zeros((len(encodings), width), dtype=np.int64)
            for row, e in enumerate(encodings):
                values = getattr(e, fields[name])
                array[row, :len(values)] = values
            feeds[name] = array
    return feeds


def _decode(value: object) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"text input is not valid UTF-8: {exc}") from exc


TOKENIZER_INPUTS = {"input_ids", "attention_mask", "token_type_ids"}
