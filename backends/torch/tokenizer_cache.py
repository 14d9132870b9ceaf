"""A GGUF checkpoint's Hugging Face tokenizer, converted once and cached.

transformers builds the tokenizer of a GGUF file by reading every metadata
field with gguf-py (SmolLM2's 49,152 tokens and 48,900 merges, one numpy
view each) and converting them: 8 s a load on the benchmark machine. Saved
with `save_pretrained` and read back it takes 0.5 s and encodes, decodes and
renders its chat template alike. The cache holds one folder per
`<digest>`: a digest of the file's bytes and of the transformers and
tokenizers versions that converted it, so a changed file or library is
converted afresh. Folders are written under a temporary name and renamed
into place, so a reader never sees half of one and two processes loading
the same file at once both succeed. As with the IREE cache, the folder is
created 0700 and used only while the daemon's user owns it: an entry's
chat template and vocabulary decide what the model is asked and says.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path

import structlog

from modeld.backends.iree.cache import CacheDirUnsafe, private_dir

log = structlog.get_logger("modeld.torch")

CACHE_ENV = "MODELD_TOKENIZER_CACHE"
_COMPLETE = ".modeld-complete"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(os.environ.get(CACHE_ENV) or Path(base) / "modeld" / "tokenizers")


def cache_key(path: Path) -> str:
    digest = hashlib.sha256()
    for package in ("transformers", "tokenizers"):
        digest.update(f"{package}=={importlib.metadata.version(package)}\0".encode())
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()[:32]


def load_gguf_tokenizer(path: Path, cache_dir: Path | None = None):
    from transformers import AutoTokenizer

    try:
        cache_dir = private_dir(cache_dir or default_cache_dir(), "tokenizer cache", CACHE_ENV)
    except OSError as exc:  # CacheDirUnsafe or an unwritable disk: convert, as without a cache
        log.warning("tokenizer_cache_unusable", reason=str(exc) if isinstance(exc, CacheDirUnsafe)
                    else type(exc).__name__)
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    entry = cache_dir / cache_key(path)
    if (entry / _COMPLETE).is_file():
        try:
            return AutoTokenizer.from_pretrained(str(entry))
        except Exception as exc:  # noqa: BLE001 - a damaged entry: convert again and replace it
            log.warning("tokenizer_cache_unreadable", entry=entry.name, reason=type(exc).__name__)
            shutil.rmtree(entry, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    _store(tokenizer, cache_dir, entry)
    return tokenizer


def _store(tokenizer, cache_dir: Path, entry: Path) -> None:
    partial = None
    try:
        partial = Path(tempfile.mkdtemp(prefix=".partial-", dir=cache_dir))
        tokenizer.save_pretrained(str(partial))
        (partial / _COMPLETE).write_text("")
        os.rename(partial, entry)  # refused if another load put the same entry there first
        partial = None
    except OSError as exc:  # a read-only or full cache costs the next load its 8 s, nothing more
        log.info("tokenizer_cache_not_written", entry=entry.name, reason=type(exc).__name__)
    finally:
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
