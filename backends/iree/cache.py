"""Compiled modules and refusals, kept next to the model they came from.

Layout: `<model folder>/.iree-cache/<key>.vmfb`, or `<key>.refused` holding
the reason IREE could not compile it. The key is
`<sha256 of the graph and its external data>-<compiler version>-<target>`:
editing the model, upgrading iree-base-compiler or moving the folder to a CPU
with other features compiles afresh, while a restart or a reload finds the
module at once. A folder the daemon cannot write (a read-only volume) keeps
its cache under the system temp directory instead.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from modeld.backends.iree.compiler import Toolchain

CACHE_DIR = ".iree-cache"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class CacheEntry:
    key: str
    module: Path  # the compiled module, once it exists
    refusal: Path  # the reason IREE refused these bytes, once it has


class ModuleCache:
    """Finds, reuses and records compiled modules; one per backend."""

    def __init__(self, fallback_root: Path | None = None) -> None:
        self._fallback = fallback_root or Path(tempfile.gettempdir()) / "modeld-iree-cache"
        self._digests: dict[tuple, str] = {}
        self._refusals: dict[str, str] = {}
        # key -> a module compiled for it in some folder: the same bytes
        # loaded inline again land in a fresh folder and need not recompile
        self._compiled: dict[str, Path] = {}

    def entry(self, model_dir: Path, files: list[Path], chain: Toolchain) -> CacheEntry:
        """files: the graph first, then its external data files, if any."""
        key = f"{self.digest(files)}-{chain.version}-{chain.target}"
        folder = _writable(model_dir / CACHE_DIR) or self._fallback
        return CacheEntry(key, folder / f"{key}.vmfb", folder / f"{key}.refused")

    def digest(self, files: list[Path]) -> str:
        """sha256 of the files, remembered while their sizes and times stay."""
        stamp = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
        if stamp not in self._digests:
            sha = hashlib.sha256()
            for f in files:
                with f.open("rb") as stream:
                    while chunk := stream.read(_CHUNK):
                        sha.update(chunk)
            self._digests[stamp] = sha.hexdigest()[:20]
        return self._digests[stamp]

    def refusal(self, entry: CacheEntry) -> str | None:
        if entry.key not in self._refusals and entry.refusal.is_file():
            self._refusals[entry.key] = entry.refusal.read_text(encoding="utf-8")
        return self._refusals.get(entry.key)

    def refuse(self, entry: CacheEntry, reason: str) -> None:
        self._refusals[entry.key] = reason
        _write_atomic(entry.refusal, reason.encode())

    def find(self, entry: CacheEntry) -> bool:
        """Whether the module is there, copying one compiled elsewhere if need be."""
        if entry.module.is_file():
            return True
        earlier = self._compiled.get(entry.key)
        if earlier is None or not earlier.is_file():
            return False
        entry.module.parent.mkdir(parents=True, exist_ok=True)
        partial = entry.module.with_name(entry.module.name + ".partial")
        shutil.copyfile(earlier, partial)
        os.replace(partial, entry.module)
        return True

    def remember(self, entry: CacheEntry) -> None:
        self._compiled[entry.key] = entry.module


def _writable(folder: Path) -> Path | None:
    try:
        folder.mkdir(exist_ok=True)
    except OSError:
        return None
    return folder if os.access(folder, os.W_OK) else None


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, path)
