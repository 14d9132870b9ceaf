"""The model folder's vocabulary: prompt ids, each token's raw bytes, the end
of generation, and the chat template.

Token ids go to onnxruntime-genai as they are, so its own tokenizer is only
used for the chat template (a Jinja template it renders natively). Tokens are
encoded and spelled by the `tokenizers` library from the same tokenizer.json:
it is thread-safe (requests tokenize on the event loop while a step runs on
the compute thread), and a byte-level BPE token's raw bytes, part of a UTF-8
character included, are what the incremental detokenizer needs.
"""

from __future__ import annotations

import json
from pathlib import Path

from modeld.backends.artifact_paths import resolve_inside
from modeld.backends.errors import InvalidArgument, LoadFailed
from modeld.backends.generation.params import ChatMessage


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-ins for the 256 byte values, inverted."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = visible[:], 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(visible, codes)}


_BYTES = _byte_decoder()


class Vocabulary:
    def __init__(self, folder: Path, og_tokenizer, eos_token_ids: set[int], model: str = "") -> None:
        from tokenizers import Tokenizer

        path = resolve_inside(model, folder, "tokenizer.json", "tokenizer file")
        if not path.is_file():
            raise LoadFailed(f"{path.name} is missing next to the model; rebuild it with `modeld prepare`")
        self.tokenizer = Tokenizer.from_file(str(path))
        self.vocab_size = self.tokenizer.get_vocab_size()
        self._special = {int(t["id"]) for t in json.loads(path.read_text(encoding="utf-8")).get("added_tokens", [])
                         if t.get("special")}
        self._og_tokenizer = og_tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._pieces: dict[int, bytes] = {}

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special).ids)

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._spell(token_id)
            self._pieces[token_id] = piece
        return piece

    def _spell(self, token_id: int) -> bytes:
        token = self.tokenizer.id_to_token(token_id)
        if token is None or token_id in self._special:
            return b""  # control tokens (<|im_end|>, ...) have no text, as in the other backends
        if all(ch in _BYTES for ch in token):
            return bytes(_BYTES[ch] for ch in token)
        return self.tokenizer.decode([token_id]).encode("utf-8")

    def is_end_of_generation(self, token_id: int) -> bool:
        return token_id in self.eos_token_ids

    def apply_chat_template(self, messages: tuple[ChatMessage, ...]) -> str:
        payload = json.dumps([{"role": m.role, "content": m.content} for m in messages])
        try:
            return self._og_tokenizer.apply_chat_template(payload, add_generation_prompt=True)
        except Exception as exc:  # no template in the folder, or one these messages break
            raise InvalidArgument(f"the model's chat template could not be applied to these messages: {exc}") from exc

    def check_token_ids(self, token_ids) -> list[int]:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgument(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        return list(token_ids)

    def detokenize(self, token_ids: list[int]) -> str:
        return b"".join(self.token_bytes(t) for t in self.check_token_ids(token_ids)).decode("utf-8", errors="replace")
