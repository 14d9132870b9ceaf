"""Tar layers: an OCI layer that packs a folder (`application/vnd.oci.image.layer.v1.tar`,
`+gzip`, what `oras push DIR` makes; ModelPack's `...v1.tar`, `+gzip` and
`+zstd`) unpacked into content-addressed blobs.

Every member is checked before a byte of it is written: only regular files
(and the folders they imply) whose names stay inside the model folder; a
link, a device, an absolute name or one with '..' refuses the whole layer.
Members become blobs like any downloaded file, so they are deduplicated and
counted in the cache budget.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tarfile
import uuid
from pathlib import Path
from typing import Callable, Iterator

from modeld.backends.errors import InvalidArgument

CHUNK = 1024 * 1024


def list_members(archive: tarfile.TarFile, where: str, max_files: int,
                 check_path: Callable[[str, str], str]) -> list[tuple[tarfile.TarInfo, str]]:
    """(member, its path in the model folder) for every regular file; refuses anything else."""
    found: list[tuple[tarfile.TarInfo, str]] = []
    seen: set[str] = set()
    for member in archive:
        raw = member.name.removeprefix("./")
        if member.isdir() or raw in ("", "."):
            continue
        if not member.isfile():
            kind = "link" if member.issym() or member.islnk() else "device or special file"
            raise InvalidArgument(f"{where}: member {member.name[:80]!r} is a {kind}; a model layer may hold "
                                  "only regular files")
        path = check_path(raw, f"{where} (tar member)")
        if path in seen:
            raise InvalidArgument(f"{where}: member {path[:80]!r} appears twice")
        seen.add(path)
        found.append((member, path))
        if len(found) > max_files:
            raise InvalidArgument(f"{where} holds more than {max_files} files")
    return found


KINDS = ("tar", "tar+gzip", "tar+zstd")


@contextlib.contextmanager
def open_layer(blob: Path, kind: str, where: str, scratch: Path, limit: int) -> Iterator[tarfile.TarFile]:
    """The layer as a tar archive. A zstd layer is first decompressed into
    `scratch` (tarfile reads gzip itself but not zstd, and the members are
    all checked before any is read, which needs a seekable archive); that
    copy is removed when the archive closes."""
    if kind not in KINDS:
        raise InvalidArgument(f"{where}: a {kind!r} layer is not a tar archive modeld can unpack")
    unpacked = _unzstd(blob, scratch, where, limit) if kind == "tar+zstd" else None
    try:
        try:
            archive = tarfile.open(unpacked or blob, "r:gz" if kind == "tar+gzip" else "r:")
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise InvalidArgument(f"{where} is not a readable tar archive: {exc}") from None
        with archive:
            yield archive
    finally:
        if unpacked is not None:
            unpacked.unlink(missing_ok=True)


def _unzstd(blob: Path, scratch: Path, where: str, limit: int) -> Path:
    import zstandard

    out_path = scratch / f"zstd-{uuid.uuid4().hex}.part"
    written = 0
    try:
        with blob.open("rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as reader, \
                out_path.open("wb") as out:
            for chunk in iter(lambda: reader.read(CHUNK), b""):
                written += len(chunk)
                if written > limit:  # a small layer that unpacks past the whole cache is refused, not written
                    raise InvalidArgument(f"{where} unpacks to more than the store's cache budget "
                                          f"store_cache_budget ({limit} bytes)")
                out.write(chunk)
    except zstandard.ZstdError as exc:
        out_path.unlink(missing_ok=True)
        raise InvalidArgument(f"{where} is not readable zstd: {exc}") from None
    except BaseException:
        out_path.unlink(missing_ok=True)
        raise
    return out_path


def store_member(archive: tarfile.TarFile, member: tarfile.TarInfo, partial: Path, blob_of: Callable[[str], Path],
                 where: str) -> str:
    """Write one member to a partial file, hashing it, and move it to its blob; its digest."""
    source = archive.extractfile(member)
    if source is None:
        raise InvalidArgument(f"{where}: member {member.name[:80]!r} has no contents")
    part = partial / f"unpack-{uuid.uuid4().hex}.part"
    digest = hashlib.sha256()
    try:
        with source, part.open("wb") as out:
            for chunk in iter(lambda: source.read(CHUNK), b""):
                digest.update(chunk)
                out.write(chunk)
        name = "sha256:" + digest.hexdigest()
        os.replace(part, blob_of(name))
        return name
    except (tarfile.TarError, EOFError) as exc:
        raise InvalidArgument(f"{where}: member {member.name[:80]!r} cannot be read: {exc}") from None
    finally:
        part.unlink(missing_ok=True)
