"""Compiled modules and refusals, in a directory only the daemon writes.

Layout: `<cache root>/<key>.vmfb`, or `<key>.refused` holding the reason
IREE could not compile it. The key is
`<sha256 of the graph and its external data>-<compiler version>-<target>`:
editing the model, upgrading iree-base-compiler or moving to a CPU with other
features compiles afresh, while a restart, a reload or the same bytes loaded
inline again under another name find the module at once.

The root is the setting iree_cache_dir, else `$XDG_CACHE_HOME/modeld/iree`
(`~/.cache/modeld/iree`): created 0700 and used only while it is the
daemon's own and no one else may write it. A module is native code the
daemon runs, so one is never read from a model's folder (an uploaded
`.iree-cache/` there is ignored) nor from a path other users share.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from modeld.backends.iree.compiler import Toolchain

_CHUNK = 1 << 20


class CacheDirUnsafe(OSError):
    """The cache root is not a directory the daemon alone can write."""


@dataclass(frozen=True)
class CacheEntry:
    key: str
    module: Path  # the compiled module, once it exists
    refusal: Path  # the reason IREE refused these bytes, once it has


def default_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "modeld" / "iree"


class ModuleCache:
    """Finds, reuses and records compiled modules; one per backend."""

    def __init__(self, root: Path | None = None) -> None:
        self._root = root  # None: the load's iree_cache_dir, else default_root()
        self._digests: dict[tuple, str] = {}
        self._refusals: dict[str, str] = {}

    def root(self, configured: str = "") -> Path:
        """The directory modules live in, made private (0700) and checked."""
        return private_dir(self._root or (Path(configured) if configured else default_root()))

    def entry(self, files: list[Path], chain: Toolchain, configured_root: str = "") -> CacheEntry:
        """files: the graph first, then its external data files, if any."""
        key = f"{self.digest(files)}-{chain.version}-{chain.target}"
        folder = self.root(configured_root)
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
        """Whether the module for these bytes was compiled already."""
        return entry.module.is_file()


def private_dir(folder: Path, what: str = "IREE cache", setting: str = "iree_cache_dir") -> Path:
    """`folder`, created 0700 if missing; raises CacheDirUnsafe unless it is
    a real directory (no symlink) that this user owns and no one else may
    write (a looser one of ours is tightened)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise CacheDirUnsafe(f"the {what} {folder.name!r} is not a directory (a symbolic link?)")
    if info.st_uid != os.getuid():
        raise CacheDirUnsafe(f"the {what} {folder.name!r} belongs to another user; set {setting} "
                             "to a directory of the daemon's own")
    if info.st_mode & 0o077:
        os.chmod(folder, 0o700)
    return folder


def _write_atomic(path: Path, data: bytes) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, path)
