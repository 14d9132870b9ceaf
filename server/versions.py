"""Model versions: Triton's numbered folders under one repository entry.

An entry whose artifact sits in numbered folders (`1/model.onnx`,
`2/model.onnx`, ...) has one version per folder; its `version_policy`
(backends/version_policy.py) picks those that serve. Any other entry has
exactly one version, "1", as it always had.

Inside the engine every version is a model of its own (its own load, memory
entry, batcher and statistics), named by its key: the entry's name for
version 1, `name:v` for version v. ':' is never in a model name, so a key
cannot collide with one, and a key never reaches a client: statuses and
results split it back into (name, version).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import TYPE_CHECKING, Callable

from modeld.backends.digits import ascii_digits
from modeld.backends.errors import ModeldError, NotFound

if TYPE_CHECKING:
    from modeld.server.repository import ModelSource

SEPARATOR = ":"
DEFAULT_VERSION = 1
# how long a model's version list is trusted before its folder is looked at
# again: a request asks for it several times, and each look is two stat calls
RECHECK_S = 1.0


def version_key(name: str, version: int) -> str:
    return name if version == DEFAULT_VERSION else f"{name}{SEPARATOR}{version}"


def split_key(key: str) -> tuple[str, int | None]:
    """("m", 2) for "m:2"; ("m", None) for a plain name."""
    name, sep, version = key.rpartition(SEPARATOR)
    if sep and ascii_digits(version):
        return name, int(version)
    return key, None


def model_of(key: str) -> str:
    return split_key(key)[0]


def version_of(key: str) -> str:
    """The version a key names, as the wire spells it."""
    return str(split_key(key)[1] or DEFAULT_VERSION)


def parse_version(text: str) -> int | None:
    """A request's model_version as a number; None for anything that is not
    one (a version is a positive decimal number without leading zeros)."""
    if not ascii_digits(text) or len(text) > 19 or text.startswith("0"):
        return None
    return int(text)


def select_versions(config, found: list[int]) -> tuple[int, ...]:
    """The config's version_policy applied to the version folders `found`."""
    # getattr: ModelConfig gains `version_policy` with helper C's edit of
    # model_config.py; until then every entry has Triton's default, latest 1
    policy = getattr(config, "version_policy", None)
    return policy.select(found) if policy is not None else tuple(sorted(found)[-1:])


def describe_policy(config) -> str:
    policy = getattr(config, "version_policy", None)
    return policy.describe() if policy is not None else "latest 1"


def version_folders(source: ModelSource) -> tuple[str, list[int]] | None:
    """(the artifact's file name inside each version folder, the numbered
    folders holding it), or None where the entry is not laid out by version:
    its artifact at the root, a store or remote model, no numbered folder."""
    config = source.config
    if config.source or config.is_remote:
        return None
    artifact = config.artifact_path
    head, _, rest = artifact.partition("/")
    base = rest if parse_version(head) is not None and rest else artifact
    if base == artifact and (source.model_dir / artifact).exists():
        return None
    try:
        entries = list(os.scandir(source.model_dir))
    except OSError:
        return None
    found = sorted(version for e in entries if (version := parse_version(e.name)) is not None
                   and e.is_dir() and (source.model_dir / e.name / base).exists())
    return (base, found) if found else None


def served_versions(source: ModelSource) -> tuple[int, ...]:
    """The versions that serve, ascending: the policy's pick of the version
    folders, or (1,) for an entry without them. Empty where the policy
    names no folder that exists."""
    layout = version_folders(source)
    if layout is None:
        return (DEFAULT_VERSION,)
    return select_versions(source.config, layout[1])


def at_version(source: ModelSource, version: int | None) -> ModelSource:
    """The entry as the engine loads one version of it: named by its key,
    its artifact in that version's folder. None: the entry as named by its
    own name (version 1's folder where it has one, unchecked)."""
    layout = version_folders(source)
    name = source.config.name
    if layout is None:
        if version not in (None, DEFAULT_VERSION):
            raise NotFound(f"model {name!r} has no version '{version}'; it has version {DEFAULT_VERSION}")
        return source
    base, found = layout
    if version is None:
        version = DEFAULT_VERSION
        if version not in found:
            return source
    else:
        served = select_versions(source.config, found)
        if version not in served:
            raise NotFound(no_version_message(name, str(version), served, source))
    config = dataclasses.replace(source.config, name=version_key(name, version), artifact=f"{version}/{base}")
    return dataclasses.replace(source, config=config)


def no_version_message(name: str, version: str, served: tuple[int, ...], source: ModelSource | None = None) -> str:
    if served:
        listed = ", ".join(map(str, served))
        return f"model {name!r} has no version {version!r}; it serves version{'s' if len(served) > 1 else ''} {listed}"
    policy = describe_policy(source.config) if source is not None else "its version_policy"
    return (f"model {name!r} has no version {version!r}: its version_policy ({policy}) matches none of its "
            "version folders")


class VersionIndex:
    """Each model's served versions, looked up through `resolve` (the
    repository's) and kept until its folder or model.toml changes."""

    def __init__(self, resolve: Callable[[str], ModelSource]) -> None:
        self._resolve = resolve
        # name -> (checked at, folder stamp, source, versions)
        self._known: dict[str, tuple[float, tuple, ModelSource, tuple[int, ...]]] = {}

    def of(self, name: str) -> tuple[int, ...] | None:
        """`name`'s served versions; None for a name no entry has."""
        entry = self._entry(name)
        return entry[3] if entry is not None else None

    def source(self, name: str) -> ModelSource | None:
        entry = self._entry(name)
        return entry[2] if entry is not None else None

    def forget(self, name: str) -> None:
        """Look again next time (an inline load or an unload changed it)."""
        self._known.pop(name, None)

    def _entry(self, name: str):
        now = time.monotonic()
        entry = self._known.get(name)
        if entry is not None and now - entry[0] < RECHECK_S:
            return entry
        stamp = _stamp(entry[2]) if entry is not None else None
        if entry is not None and stamp == entry[1]:
            entry = self._known[name] = (now, stamp, entry[2], entry[3])
            return entry
        try:
            source = self._resolve(name)
        except ModeldError:  # an unknown or malformed name: its own lookup says why
            self._known.pop(name, None)
            return None
        entry = self._known[name] = (now, _stamp(source), source, served_versions(source))
        if len(self._known) > 4096:  # names come from clients; bounded even if they make them up
            self._known.pop(next(iter(self._known)))
        return entry


def _stamp(source: ModelSource) -> tuple:
    """What changes when a version folder comes or goes (or its artifact
    arrives after the folder) or model.toml is rewritten."""
    stamp: list = []
    for path in (source.model_dir, source.model_dir / "model.toml"):
        try:
            st = path.stat()
            stamp.append((st.st_ino, st.st_mtime_ns))
        except OSError:
            stamp.append(None)
    try:
        stamp.extend((e.name, e.stat().st_mtime_ns) for e in os.scandir(source.model_dir)
                     if parse_version(e.name) is not None and e.is_dir())
    except OSError:
        pass
    return tuple(stamp)
