"""Models from a store: OCI registries, S3-compatible stores and the Hugging
Face Hub, pulled into a bounded content-addressed disk cache (cache.py), the
tier below the memory budget's LRU.

`ModelStore.pull(uri)` gives a model folder the backends load like any
other. Concurrent pulls of one URI share one pull; a source that cannot be
reached falls back to the newest cached pull of the same URI, so a daemon
keeps serving what it has when the store is down.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from modeld.backends.errors import InvalidArgument, ModeldError, Unavailable

from .cache import BlobCache, Entry, Listing, Progress
from .oci import OciSettings, OciSource
from .s3 import S3Settings, S3Source
from .uri import SourceURI, parse_uri

__all__ = ["ModelStore", "OciSettings", "Progress", "PulledModel", "S3Settings", "StoreSettings", "parse_uri"]

log = structlog.get_logger("modeld.store")

# what a folder needs for some backend to load it
LOADABLE_SUFFIXES = (".onnx", ".gguf", ".safetensors", ".mlmodel", ".mlpackage", ".pt2")
_PULL_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


@dataclass(frozen=True)
class StoreSettings:
    cache_dir: Path = Path.home() / ".cache" / "modeld" / "store"
    cache_budget: int = 50 * 1024**3
    oci: OciSettings = OciSettings()
    s3: S3Settings = S3Settings()
    parallel: int = 4  # files of one model fetched at once


@dataclass(frozen=True)
class PulledModel:
    uri: str
    folder: Path
    identity: str
    hints: dict = field(default_factory=dict)


class StoreMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.pulls = Counter("modeld_store_pulls", "Model pulls by source scheme and outcome (pulled, cached, "
                             "failed)", ["scheme", "outcome"], registry=r)
        self.pull_bytes = Counter("modeld_store_pull_bytes", "Bytes fetched from stores", ["scheme"], registry=r)
        self.pull_seconds = Histogram("modeld_store_pull_seconds", "Time from a pull's start to its model folder",
                                      ["scheme"], buckets=_PULL_BUCKETS, registry=r)
        self.cache_bytes = Gauge("modeld_store_cache_bytes", "Bytes the store's disk cache holds", registry=r)
        self.cache_budget = Gauge("modeld_store_cache_budget_bytes", "The store's disk cache budget", registry=r)
        self.pulls_in_progress = Gauge("modeld_store_pulls_in_progress", "Pulls running now", registry=r)


class ModelStore:
    def __init__(self, settings: StoreSettings = StoreSettings(), registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.metrics = StoreMetrics(registry if registry is not None else CollectorRegistry())
        self.metrics.cache_budget.set(settings.cache_budget)
        # model folders the engine serves: never evicted from disk (set by the engine)
        self.in_use: Callable[[], Iterable[Path]] = lambda: ()
        self._cache: BlobCache | None = None
        self._oci = OciSource(settings.oci)
        self._s3 = S3Source(settings.s3)
        self._hf = None
        self._pulls: dict[str, tuple[asyncio.Future, Progress]] = {}

    def place_compile_caches(self) -> dict[str, str]:
        """torch.compile's caches under this store's cache folder, compile
        workers bounded (server/load_priority.py); the daemon calls it once
        at start, before any model loads or worker starts."""
        from modeld.server.load_priority import place_compile_caches

        return place_compile_caches(self.settings.cache_dir)

    @property
    def cache(self) -> BlobCache:
        # made on first use: a daemon that never pulls creates no folder
        if self._cache is None:
            self._cache = BlobCache(self.settings.cache_dir, self.settings.cache_budget,
                                    in_use=lambda: self.in_use(), parallel=self.settings.parallel)
            self.metrics.cache_bytes.set(self._cache.used_bytes())
        return self._cache

    def _source(self, uri: SourceURI):
        if uri.scheme == "oci":
            return self._oci
        if uri.scheme == "s3":
            return self._s3
        if self._hf is None:
            from .hf import HfSource

            self._hf = HfSource()
        return self._hf

    # -- pulling -------------------------------------------------------------

    def pull_sync(self, text: str, progress: Progress | None = None) -> PulledModel:
        """Pull in this thread (the CLI's `modeld pull --cache-dir`, and the
        daemon's worker thread)."""
        uri = parse_uri(text)
        progress = progress if progress is not None else Progress()
        started = time.monotonic()
        cache = self.cache
        if uri.is_digest:  # pinned by digest: what the cache holds is exactly it
            entry = cache.find(identity=uri.reference)
            if entry is not None:
                self.metrics.pulls.labels(uri.scheme, "cached").inc()
                return self._pulled(text, cache.touch(entry), entry)
        try:
            listing = self._source(uri).listing(uri)
        except Unavailable as exc:
            entry = cache.find(uri=text)
            if entry is None:
                self.metrics.pulls.labels(uri.scheme, "failed").inc()
                raise
            log.warning("store_offline_cached", uri=text, reason=str(exc))
            self.metrics.pulls.labels(uri.scheme, "cached").inc()
            return self._pulled(text, cache.touch(entry), entry)
        except ModeldError:
            self.metrics.pulls.labels(uri.scheme, "failed").inc()
            raise
        check_loadable(listing)
        self.metrics.pulls_in_progress.inc()
        try:
            folder, entry = cache.pull(listing, progress)
        except ModeldError:
            self.metrics.pulls.labels(uri.scheme, "failed").inc()
            raise
        finally:
            self.metrics.pulls_in_progress.dec()
            self.metrics.cache_bytes.set(cache.used_bytes())
        fetched = max(0, progress.done - progress.cached)
        self.metrics.pull_bytes.labels(uri.scheme).inc(fetched)
        # every file already on disk: the disk tier answered (the store was asked only for the listing)
        outcome = "cached" if fetched == 0 and progress.total > 0 else "pulled"
        self.metrics.pulls.labels(uri.scheme, outcome).inc()
        self.metrics.pull_seconds.labels(uri.scheme).observe(time.monotonic() - started)
        log.info("store_pulled", uri=text, identity=entry.identity, folder_id=entry.id, total_bytes=progress.total,
                 fetched_bytes=fetched, outcome=outcome, seconds=round(time.monotonic() - started, 3))
        return self._pulled(text, folder, entry)

    def _pulled(self, text: str, folder: Path, entry: Entry) -> PulledModel:
        return PulledModel(text, folder, entry.identity, dict(entry.hints))

    def start_pull(self, text: str) -> tuple[asyncio.Future, Progress]:
        """Start pulling `text` on the event loop's thread pool, or join the
        pull of it already running: (its future, its shared progress)."""
        parse_uri(text)  # a bad URI fails here, before a pull is shared
        running = self._pulls.get(text)
        if running is not None:
            return running
        progress = Progress()
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def settle(outcome: object, failed: bool) -> None:
            if not future.done():
                future.set_exception(outcome) if failed else future.set_result(outcome)

        def run() -> None:
            try:
                outcome, failed = self.pull_sync(text, progress), False
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting loop
                outcome, failed = exc, True
            try:
                loop.call_soon_threadsafe(settle, outcome, failed)
            except RuntimeError:
                pass  # the loop has closed: the daemon is gone, nobody waits

        # a daemon thread (not the loop's thread pool, which exit waits for):
        # a daemon stopped mid-pull exits, the partial file kept for a resume
        threading.Thread(target=run, name="modeld-pull-model", daemon=True).start()
        self._pulls[text] = (future, progress)

        def finished(done: asyncio.Future) -> None:
            if self._pulls.get(text, (None,))[0] is done:
                del self._pulls[text]
            if not done.cancelled():
                done.exception()  # retrieved, even when every waiter left
        future.add_done_callback(finished)
        return future, progress

    async def pull(self, text: str) -> PulledModel:
        future, _ = self.start_pull(text)
        return await asyncio.shield(future)

    def pulling(self) -> dict[str, Progress]:
        return {uri: progress for uri, (_, progress) in self._pulls.items()}

    # -- pushing -------------------------------------------------------------

    def push(self, folder: Path, text: str, model_format: str = "", packing: str = "raw") -> str:
        """Write `folder` to an oci:// URI as a ModelPack artifact, each file a
        raw layer or a tar layer (`packing`); its manifest digest."""
        uri = parse_uri(text)
        if uri.scheme != "oci":
            raise InvalidArgument(f"modeld pushes to oci:// registries, not {uri.scheme}://")
        return self._oci.push(folder, uri, model_format, packing)

    def close(self) -> None:
        self._oci.close()


def check_loadable(listing: Listing) -> None:
    """An artifact with nothing a backend loads is refused before any byte is fetched."""
    names = [f.path for f in listing.files]
    if any(f.unpack for f in listing.files):  # what a tar layer holds is known once it is unpacked
        return
    if any(n.rsplit("/", 1)[-1] == "model.toml" for n in names):
        return
    if any(n.lower().endswith(LOADABLE_SUFFIXES) or ".mlpackage/" in n for n in names):
        return
    shown = ", ".join(names[:8]) or "no named files"
    raise InvalidArgument(f"{listing.uri} has no file a backend can load (ONNX, GGUF, safetensors or a "
                          f"model.toml); it holds: {shown}")
