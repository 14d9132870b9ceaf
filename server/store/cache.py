"""The disk tier: a content-addressed cache of pulled models.

Layout under the cache root:

    blobs/sha256/<hex>     every file once, named by its digest
    partial/<name>.part    a download in progress (resumed from its length)
    models/<id>/           a pulled model's folder: hard links into blobs/
    models/<id>.json       that folder's index: source, files and digests

A blob is shared by every model folder that names it and counted once
against the budget. A download is hashed as it is written and renamed into
blobs/ only when its digest matches, so nothing half-written is ever served.
When a pull needs room, whole models are evicted least recently used first,
never one in use (served or being pulled); blobs no model names any more go
with them. Thread-safe: pulls run in worker threads.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import structlog

from modeld.backends.errors import InvalidArgument, ModeldError, ResourceExhausted, Unavailable
from modeld.backends.sizes import format_size

log = structlog.get_logger("modeld.store")

DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
CHUNK = 1024 * 1024
MAX_FILES = 4096  # files one model may have; a listing beyond is refused
MAX_PATH = 512
RESUME_TRIES = 4
PARTIAL_KEEP_S = 7 * 24 * 3600  # a partial download untouched this long is removed at start  # a dropped connection is resumed from where it broke this many times


class DigestMismatch(InvalidArgument):
    """A blob's bytes do not hash to the digest its manifest gives."""


class TransferBroken(Exception):
    """The connection dropped mid-file; the bytes so far are kept for a resume."""


# fetch(offset) -> (chunks, offset the source starts at): a source that
# ignores the range starts again at 0
Fetch = Callable[[int], tuple[Iterator[bytes], int]]


@dataclass(frozen=True)
class RemoteFile:
    path: str  # inside the model folder, checked by safe_path
    size: int | None
    digest: str | None  # "sha256:<hex>" when the source names it; checked before use
    fetch: Fetch
    label: str  # names the file in errors, e.g. "layer sha256:1a2b… (model.onnx)"
    # a source's own check of the finished file (S3's MD5 ETag), given its md5
    check_md5: str | None = None
    # "tar", "tar+gzip" or "tar+zstd": a layer packing a folder, unpacked into the model folder (unpack.py); `path` then
    # names only the archive, which the folder does not hold
    unpack: str = ""


@dataclass(frozen=True)
class Listing:
    """What a source says a model is, before any byte is fetched."""

    uri: str
    identity: str  # names this exact content: a manifest digest, a commit, the objects' ETags
    files: tuple[RemoteFile, ...]
    hints: dict = field(default_factory=dict)  # e.g. {"format": "gguf"} from the artifact's config


@dataclass
class Progress:
    done: int = 0
    total: int = 0
    cached: int = 0  # of `done`, the bytes the cache already held (the disk tier's share)


@dataclass
class Entry:
    id: str
    uri: str
    identity: str
    files: dict[str, str]  # path -> digest
    hints: dict
    last_used: float

    def to_json(self) -> str:
        return json.dumps({"uri": self.uri, "identity": self.identity, "files": self.files, "hints": self.hints,
                           "last_used": self.last_used})


def safe_path(raw: object, where: str) -> str:
    """A file name from a manifest, bucket or hub listing, refused if it could
    leave the model folder."""
    if not isinstance(raw, str) or not raw or len(raw) > MAX_PATH or "\x00" in raw or "\\" in raw:
        raise InvalidArgument(f"{where}: file name {str(raw)[:80]!r} is not a usable relative path")
    path = PurePosixPath(raw)
    if path.is_absolute() or any(part in ("..", "", ".") for part in raw.split("/")) or raw.startswith("~"):
        raise InvalidArgument(f"{where}: file name {raw[:80]!r} would leave the model folder; names must be "
                              "relative paths without '..'")
    return raw


PULL_NICE = 10


def lower_priority() -> None:
    """Run this thread (a pull's reader or writer) at a lower CPU priority,
    so hashing a large download never starves the models serving."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PULL_NICE)  # Linux: per thread
    except (AttributeError, OSError):
        pass  # elsewhere, or not allowed: at the daemon's own priority


def run_parallel(fn: Callable, items: list, parallel: int) -> list:
    """fn over items on up to `parallel` daemon threads at a lower priority,
    results in order; the first failure is raised once all have stopped.
    Daemon threads, not an executor's: a daemon shutting down mid-pull exits
    instead of waiting for the download (the interpreter joins executors)."""
    results: list = [None] * len(items)
    failures: list[BaseException] = []
    todo = iter(enumerate(items))
    lock = threading.Lock()

    def work() -> None:
        lower_priority()
        while True:
            with lock:
                if failures:
                    return
                try:
                    i, item = next(todo)
                except StopIteration:
                    return
            try:
                results[i] = fn(item)
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread below
                with lock:
                    failures.append(exc)
                return
    threads = [threading.Thread(target=work, name="modeld-pull", daemon=True)
               for _ in range(max(1, min(parallel, len(items))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return results


class _Digests:
    def __init__(self, md5: bool) -> None:
        self.sha256 = hashlib.sha256()
        self.md5 = hashlib.md5() if md5 else None  # only where the source checks by MD5: it costs as much again

    def update(self, chunk: bytes) -> None:
        self.sha256.update(chunk)
        if self.md5 is not None:
            self.md5.update(chunk)


class _Writer:
    """Hashes and writes a download on a thread of its own, so the network
    reads go on meanwhile (hashlib and file writes release the GIL). Chunks
    are handed over as they came, about 1 MiB of them at a time, never
    copied into one buffer: on a busy machine the copies cost as much CPU as
    a tenth of the pull."""

    _BATCH = 1024 * 1024

    def __init__(self, out, digests: _Digests) -> None:
        self.out, self.digests = out, digests
        self._queue: queue.Queue = queue.Queue(maxsize=8)
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="modeld-pull-write", daemon=True)
        self._thread.start()

    def put(self, chunk: bytes) -> None:
        if self._error is not None:
            raise self._error
        self._pending.append(chunk)
        self._pending_bytes += len(chunk)
        if self._pending_bytes >= self._BATCH:
            self._hand_over()

    def _hand_over(self) -> None:
        self._queue.put(self._pending)
        self._pending, self._pending_bytes = [], 0

    def close(self) -> None:
        if self._pending:
            self._hand_over()
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        lower_priority()
        while (chunks := self._queue.get()) is not None:
            if self._error is not None:
                continue  # drain: the caller sees the error at its next put or at close
            try:
                for chunk in chunks:
                    self.out.write(chunk)
                    self.digests.update(chunk)
            except BaseException as exc:  # noqa: BLE001 - a full disk, raised in the caller's thread
                self._error = exc


class BlobCache:
    def __init__(self, root: Path, budget: int, in_use: Callable[[], Iterable[Path]] = lambda: (),
                 parallel: int = 4) -> None:
        if budget <= 0:
            raise ValueError("the store's cache budget must be positive")
        self.root = Path(root)
        self.budget = budget
        self.in_use = in_use  # model folders the engine serves: never evicted
        self.parallel = parallel
        self._lock = threading.RLock()
        self._blob_locks: dict[str, threading.Lock] = {}
        self._reserved = 0  # bytes pulls in progress have promised to write
        self._pinned: dict[str, int] = {}  # digests a pull in progress needs
        self._pulling_ids: set[str] = set()
        for sub in ("blobs/sha256", "partial", "models"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._entries: dict[str, Entry] = {}
        self._load_index()

    # -- the index -------------------------------------------------------------

    def _load_index(self) -> None:
        for meta in (self.root / "models").glob("*.json"):
            try:
                raw = json.loads(meta.read_text(encoding="utf-8"))
                entry = Entry(meta.stem, raw["uri"], raw["identity"], dict(raw["files"]), dict(raw.get("hints", {})),
                              float(raw.get("last_used", 0)))
            except (OSError, ValueError, KeyError, TypeError):
                log.warning("store_index_unreadable", entry=meta.stem)
                continue
            if (self.root / "models" / entry.id).is_dir() and all(self._blob(d).is_file() for d in entry.files.values()):
                self._entries[entry.id] = entry
            else:  # a folder or blob lost underneath us: pull again next time
                self._remove_entry_files(entry.id)
        for tmp in (self.root / "models").glob(".tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)
        stale = time.time() - PARTIAL_KEEP_S
        for part in (self.root / "partial").glob("*.part"):
            try:
                if part.stat().st_mtime < stale:  # a pull nobody resumed: it is not coming back
                    part.unlink()
            except OSError:
                pass

    def _blob(self, digest: str) -> Path:
        return self.root / "blobs" / "sha256" / digest.removeprefix("sha256:")

    def used_bytes(self) -> int:
        with self._lock:
            return sum(p.stat().st_size for p in (self.root / "blobs" / "sha256").iterdir() if p.is_file())

    def entries(self) -> list[Entry]:
        with self._lock:
            return sorted(self._entries.values(), key=lambda e: e.last_used)

    def find(self, uri: str = "", identity: str = "") -> Entry | None:
        """The newest cached pull of `uri` (or of exactly `identity`)."""
        with self._lock:
            found = [e for e in self._entries.values() if (identity and e.identity == identity)
                     or (not identity and e.uri == uri)]
            return max(found, key=lambda e: e.last_used) if found else None

    def folder(self, entry: Entry) -> Path:
        return self.root / "models" / entry.id

    def touch(self, entry: Entry) -> Path:
        with self._lock:
            entry.last_used = time.time()
            self._write_meta(entry)
        return self.folder(entry)

    def _write_meta(self, entry: Entry) -> None:
        meta = self.root / "models" / f"{entry.id}.json"
        tmp = meta.with_name(f".tmp-{uuid.uuid4().hex}.json")
        tmp.write_text(entry.to_json(), encoding="utf-8")
        os.replace(tmp, meta)

    # -- pulling ---------------------------------------------------------------

    def pull(self, listing: Listing, progress: Progress | None = None) -> tuple[Path, Entry]:
        """The model folder for `listing`, fetching what the cache lacks."""
        progress = progress if progress is not None else Progress()
        entry_id = hashlib.sha256(listing.identity.encode()).hexdigest()[:32]
        if len(listing.files) > MAX_FILES:
            raise InvalidArgument(f"{listing.uri} has {len(listing.files)} files; a model may have at most {MAX_FILES}")
        paths = [safe_path(f.path, listing.uri) for f in listing.files]
        if len(set(paths)) != len(paths):
            raise InvalidArgument(f"{listing.uri} names a file twice")
        with self._lock:
            entry = self._entries.get(entry_id)
            if entry is not None:
                progress.done = progress.total = progress.cached = sum(self._blob(d).stat().st_size
                                                                       for d in entry.files.values())
                return self.touch(entry), entry
            missing = [f for f in listing.files if not (f.digest and self._blob(f.digest).is_file())]
            need = sum(f.size or 0 for f in missing)
            self._make_room(need, listing.uri)
            self._reserved += need
            self._pulling_ids.add(entry_id)
            for f in listing.files:
                if f.digest:
                    self._pinned[f.digest] = self._pinned.get(f.digest, 0) + 1
        progress.total = sum(f.size or 0 for f in listing.files)
        progress.done = progress.cached = progress.total - need
        digests: dict[str, str] = {}
        pins: list[str] = []  # files without a listed digest, pinned as they land in blobs/
        try:
            for f in listing.files:
                if f not in missing:
                    digests[f.path] = f.digest
            fetched = run_parallel(lambda f: self._fetch(listing, f, progress, pins), missing, self.parallel)
            for f, digest in zip(missing, fetched):
                digests[f.path] = digest
            files: dict[str, str] = {}
            for f in listing.files:
                found = self._unpack(listing, f, digests[f.path], pins) if f.unpack else {f.path: digests[f.path]}
                clash = next((p for p in found if p in files), None)
                if clash is not None:
                    raise InvalidArgument(f"{listing.uri} names the file {clash[:80]!r} twice (a tar layer's member "
                                          "and another layer)")
                files.update(found)
            entry = Entry(entry_id, listing.uri, listing.identity, files, dict(listing.hints), time.time())
            self._materialise(entry)
        finally:
            with self._lock:
                self._reserved -= need
                self._pulling_ids.discard(entry_id)
                for digest in [f.digest for f in listing.files if f.digest] + pins:
                    if digest:
                        left = self._pinned.get(digest, 1) - 1
                        if left:
                            self._pinned[digest] = left
                        else:
                            self._pinned.pop(digest, None)
        return self.folder(entry), entry

    def _unpack(self, listing: Listing, f: RemoteFile, digest: str, pins: list[str]) -> dict[str, str]:
        """A tar layer's members as blobs, checked (unpack.py): {path: digest}.
        Their bytes make room in the budget first; the archive's own blob goes
        once unpacked (a later pull of the same manifest finds the folder)."""
        from .unpack import list_members, open_layer, store_member

        where = f"{listing.uri}: {f.label}"
        with open_layer(self._blob(digest), f.unpack, where, self.root / "partial", self.budget) as archive:
            members = list_members(archive, where, MAX_FILES, safe_path)
            need = sum(m.size for m, _ in members)
            with self._lock:
                self._make_room(need, listing.uri)
                self._reserved += need
            try:
                found = {}
                for member, path in members:
                    member_digest = store_member(archive, member, self.root / "partial", self._blob, where)
                    with self._lock:  # named by no entry until the folder is made: kept from the collector
                        self._pinned[member_digest] = self._pinned.get(member_digest, 0) + 1
                        pins.append(member_digest)
                    found[path] = member_digest
            finally:
                with self._lock:
                    self._reserved -= need
        with self._lock:
            if self._pinned.get(digest, 0) <= 1 and digest not in found.values():
                self._blob(digest).unlink(missing_ok=True)
        return found

    def _materialise(self, entry: Entry) -> None:
        tmp = self.root / "models" / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            for rel, digest in entry.files.items():
                target = tmp.joinpath(*rel.split("/"))
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(self._blob(digest), target)
                except FileNotFoundError:
                    raise
                except OSError:  # a file system without hard links: the blob may still be named
                    os.symlink(self._blob(digest), target)
            with self._lock:
                final = self.folder(entry)
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
                self._write_meta(entry)
                self._entries[entry.id] = entry
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _fetch(self, listing: Listing, f: RemoteFile, progress: Progress, pins: list[str]) -> str:
        """Download one file into blobs/, checked; returns its digest."""
        if f.digest:
            with self._lock:
                lock = self._blob_locks.setdefault(f.digest, threading.Lock())
            with lock:  # two pulls naming one blob fetch it once
                if self._blob(f.digest).is_file():
                    progress.done += f.size or 0
                    return f.digest
                return self._download(listing, f, progress, f.digest.removeprefix("sha256:"), pins)
        part_name = hashlib.sha256(f"{listing.identity}\0{f.path}".encode()).hexdigest()
        with self._lock:
            lock = self._blob_locks.setdefault(part_name, threading.Lock())
        with lock:
            return self._download(listing, f, progress, part_name, pins)

    def _download(self, listing: Listing, f: RemoteFile, progress: Progress, part_name: str,
                  pins: list[str]) -> str:
        part = self.root / "partial" / f"{part_name}.part"
        digests = _Digests(f.check_md5 is not None)
        offset = 0
        if part.is_file():  # a pull that broke off earlier: hash what it kept, then go on from there
            with part.open("rb") as kept:
                for chunk in iter(lambda: kept.read(CHUNK), b""):
                    digests.update(chunk)
                    offset += len(chunk)
        progress.done += offset
        for attempt in range(RESUME_TRIES + 1):
            try:
                chunks, start = f.fetch(offset)
                if start != offset:  # the source ignored the range: start over
                    progress.done -= offset
                    digests, offset = _Digests(f.check_md5 is not None), 0
                    part.unlink(missing_ok=True)
                with part.open("ab") as out:
                    writer = _Writer(out, digests)
                    try:
                        for chunk in chunks:
                            if f.size is not None and offset + len(chunk) > f.size:
                                raise InvalidArgument(f"{listing.uri}: {f.label} is larger than the {f.size} "
                                                      "bytes its listing gives")
                            writer.put(chunk)
                            offset += len(chunk)
                            progress.done += len(chunk)
                    finally:
                        writer.close()  # what arrived is on disk and hashed, a resume's starting point
                break
            except TransferBroken as exc:
                if attempt == RESUME_TRIES:
                    raise Unavailable(f"{listing.uri}: {f.label} broke off {RESUME_TRIES + 1} times "
                                      f"({exc}); try again later") from None
                log.warning("store_transfer_resumed", uri=listing.uri, file=f.path, offset=offset, reason=str(exc))
            except ModeldError:
                part.unlink(missing_ok=True)
                raise
        actual = "sha256:" + digests.sha256.hexdigest()
        if f.size is not None and offset != f.size:
            part.unlink(missing_ok=True)
            raise Unavailable(f"{listing.uri}: {f.label} ended after {offset} of {f.size} bytes; try again")
        if (f.digest and actual != f.digest) or (f.check_md5 and digests.md5.hexdigest() != f.check_md5):
            part.unlink(missing_ok=True)
            want = f.digest or f"MD5 {f.check_md5}"
            raise DigestMismatch(f"{listing.uri}: {f.label} does not match its digest (expected {want}, got "
                                 f"{actual}); the download was discarded")
        with self._lock:
            os.replace(part, self._blob(actual))
            if not f.digest:  # named by no entry until this pull's folder is made: kept from the collector
                self._pinned[actual] = self._pinned.get(actual, 0) + 1
                pins.append(actual)
        return actual

    # -- room --------------------------------------------------------------------

    def _make_room(self, need: int, uri: str) -> None:
        """Evict unused models, least recently used first, until `need` more
        bytes fit the budget; RESOURCE_EXHAUSTED when they cannot."""
        if need > self.budget:
            raise ResourceExhausted(
                f"{uri} needs {format_size(need)} on disk, more than the model store's whole cache budget "
                f"store_cache_budget ({format_size(self.budget)}); raise store_cache_budget")
        used = self.used_bytes()
        if used + self._reserved + need <= self.budget:
            return
        self._collect_garbage()
        used = self.used_bytes()
        busy = {Path(p).resolve() for p in self.in_use()}
        for entry in sorted(self._entries.values(), key=lambda e: e.last_used):
            if used + self._reserved + need <= self.budget:
                return
            if entry.id in self._pulling_ids or self.folder(entry).resolve() in busy:
                continue
            log.info("store_evicted", uri=entry.uri, entry=entry.id)
            self._remove_entry_files(entry.id)
            self._entries.pop(entry.id, None)
            self._collect_garbage()
            used = self.used_bytes()
        if used + self._reserved + need > self.budget:
            raise ResourceExhausted(
                f"the model store's disk cache is full: {uri} needs {format_size(need)} more, and "
                f"{format_size(used + self._reserved)} of the cache budget store_cache_budget "
                f"({format_size(self.budget)}) is held by models in use or being pulled; raise store_cache_budget "
                "or unload a model")

    def _remove_entry_files(self, entry_id: str) -> None:
        shutil.rmtree(self.root / "models" / entry_id, ignore_errors=True)
        (self.root / "models" / f"{entry_id}.json").unlink(missing_ok=True)

    def _collect_garbage(self) -> None:
        named = {d.removeprefix("sha256:") for e in self._entries.values() for d in e.files.values()}
        named |= {d.removeprefix("sha256:") for d in self._pinned}
        for blob in (self.root / "blobs" / "sha256").iterdir():
            if blob.name not in named:
                blob.unlink(missing_ok=True)

    def evict(self, uri: str) -> int:
        """Forget every cached pull of `uri` not in use; the number removed."""
        with self._lock:
            busy = {Path(p).resolve() for p in self.in_use()}
            gone = [e for e in self._entries.values() if e.uri == uri and self.folder(e).resolve() not in busy
                    and e.id not in self._pulling_ids]
            for entry in gone:
                self._remove_entry_files(entry.id)
                del self._entries[entry.id]
            self._collect_garbage()
            return len(gone)
