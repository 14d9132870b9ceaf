"""The daemon-wide limits on what one caller may ask, as the data plane and
every front read them, and the exposure rule of `modeld serve`.

One frozen value built from the settings: the fronts read it through the
data plane (`plane.limits`), so gRPC and HTTP refuse the same request the
same way. Every refusal names the setting and its value.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from modeld.backends.errors import ResourceExhausted
from modeld.backends.sizes import format_size

DEFAULT_MAX_EMBEDDING_INPUTS = 2048
DEFAULT_STREAM_INFER_WINDOW = 64
DEFAULT_INLINE_DISK_QUOTA = 8 * 1024**3


@dataclass(frozen=True)
class RequestLimits:
    max_embedding_inputs: int = DEFAULT_MAX_EMBEDDING_INPUTS  # strings in one /v1/embeddings call
    stream_infer_window: int = DEFAULT_STREAM_INFER_WINDOW  # ModelStreamInfer requests in flight or unread
    inline_disk_quota: int = DEFAULT_INLINE_DISK_QUOTA  # bytes all inline (uploaded) model folders may hold; 0: none

    def check_embedding_inputs(self, count: int) -> None:
        if count > self.max_embedding_inputs:
            raise ResourceExhausted(
                f"{count} embedding inputs exceed the daemon's max_embedding_inputs limit "
                f"({self.max_embedding_inputs}); send at most {self.max_embedding_inputs} per call")

    def check_inline_upload(self, inline_root: Path, name: str, incoming: int) -> None:
        """RESOURCE_EXHAUSTED when writing `incoming` bytes for model `name`
        would take the inline folders past the quota. The model's own folder
        does not count: an upload replaces it."""
        quota = self.inline_disk_quota
        if not quota or not incoming:
            return
        held = sum(folder_bytes(p) for p in inline_root.iterdir() if p.name != name) if inline_root.is_dir() else 0
        if held + incoming > quota:
            raise ResourceExhausted(
                f"the upload of {incoming} bytes ({format_size(incoming)}) would take inline models past the "
                f"daemon's inline_disk_quota of {quota} bytes ({format_size(quota)}; {held} held); unload an inline "
                f"model, serve the model from the repository, or raise inline_disk_quota")


def folder_bytes(path: Path) -> int:
    """Bytes of the regular files under `path` (links not followed)."""
    if path.is_symlink() or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine. A name
    other than localhost may resolve anywhere, so it does not count."""
    if host.strip().lower() in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
