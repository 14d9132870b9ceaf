"""Triton's version policy: which numbered version folders of a model serve.

A repository entry laid out as Triton's (`1/model.onnx`, `2/model.onnx`, ...)
serves the versions its policy picks from the folders that hold the
artifact. Written in model.toml as

    version_policy = { latest = 2 }        # the two highest versions (Triton's default: latest 1)
    version_policy = "all"                 # every version folder
    version_policy = { specific = [1, 3] } # exactly these, where their folders exist

and in an inline (Triton JSON) config as Triton spells it:
`{"latest": {"num_versions": 2}}`, `{"all": {}}`, `{"specific": {"versions": [1, 3]}}`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from .digits import ascii_digits
from .errors import InvalidArgument

# one policy names at most this many versions; a folder may hold more, the
# daemon serves at most this many of one model at once
MAX_VERSIONS = 64
MAX_VERSION = 2**63 - 1  # Triton's versions are int64


class PolicyKind(enum.Enum):
    LATEST = "latest"
    ALL = "all"
    SPECIFIC = "specific"


@dataclass(frozen=True)
class VersionPolicy:
    kind: PolicyKind = PolicyKind.LATEST
    num_latest: int = 1
    versions: tuple[int, ...] = ()  # SPECIFIC: the versions named, ascending

    def select(self, available: list[int]) -> tuple[int, ...]:
        """The versions that serve, ascending, out of the folders `available`."""
        found = sorted(set(available))
        if self.kind is PolicyKind.ALL:
            return tuple(found[-MAX_VERSIONS:])
        if self.kind is PolicyKind.SPECIFIC:
            return tuple(v for v in found if v in self.versions)
        return tuple(found[-self.num_latest:])

    def describe(self) -> str:
        if self.kind is PolicyKind.ALL:
            return "all"
        if self.kind is PolicyKind.SPECIFIC:
            return "specific " + ", ".join(map(str, self.versions))
        return f"latest {self.num_latest}"


def parse_version_policy(model: str, raw: Any) -> VersionPolicy:
    """`version_policy` from model.toml or an inline config; None: latest 1."""
    if raw is None or raw == {}:  # Triton's JSON of an unset policy: its default
        return VersionPolicy()
    if raw == "all":
        return VersionPolicy(PolicyKind.ALL)
    if not isinstance(raw, dict) or len(raw) != 1:
        raise _fail(model, raw)
    (kind, value), = raw.items()
    if kind == "all" and value in ({}, True):
        return VersionPolicy(PolicyKind.ALL)
    if kind == "latest":
        value = value.get("num_versions") if isinstance(value, dict) else value
        count = _as_int(value)
        if count is None or not 1 <= count <= MAX_VERSIONS:
            raise InvalidArgument(f"model {model!r}: version_policy latest must be a whole number of versions "
                                  f"from 1 to {MAX_VERSIONS}, got {value!r}")
        return VersionPolicy(PolicyKind.LATEST, num_latest=count)
    if kind == "specific":
        value = value.get("versions") if isinstance(value, dict) else value
        return VersionPolicy(PolicyKind.SPECIFIC, versions=_specific(model, value))
    raise _fail(model, raw)


def _specific(model: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_VERSIONS:
        raise InvalidArgument(f"model {model!r}: version_policy specific must list 1 to {MAX_VERSIONS} versions, "
                              f"got {str(value)[:80]!r}")
    versions = [_as_int(v) for v in value]
    if any(v is None or not 1 <= v <= MAX_VERSION for v in versions):
        raise InvalidArgument(f"model {model!r}: version_policy specific versions must be whole numbers from 1, "
                              f"got {str(value)[:80]!r}")
    return tuple(sorted(set(versions)))


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and ascii_digits(value) and len(value) <= 19:  # protobuf JSON writes int64 as text
        return int(value)
    return None


def _fail(model: str, raw: Any) -> InvalidArgument:
    return InvalidArgument(f"model {model!r}: version_policy {str(raw)[:80]!r} is not understood; write "
                           "\"all\", { latest = N } or { specific = [1, 3] }")
