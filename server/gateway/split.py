"""Weighted traffic splits: a model name the clients call, served by several
models (two versions, or a canary beside the stable one) in proportion.

    [gateway.splits.chat]        # calls to "chat"
    chat-v1 = 95                 # go to chat-v1 95% of the time
    chat-v2 = 5                  # and to chat-v2 5% (a canary)

    [gateway.splits.scorer]      # calls to "scorer", between its versions
    "scorer:1" = 90              # version 1 of the model "scorer" 90% of the time
    "scorer:2" = 10              # version 2 (a numbered folder) 10%

A call with a session id (the `x-session-id` metadata or header) always
goes to the same target while the weights stay the same, so one
conversation never changes model midway; a call without one is drawn at
random. The hook for the gateway's forwarding: `choose(model, session)`
names the target, and `retarget` rewrites the request on the wire: its
model field, and for a `name:version` target on a KServe call its
model_version field, unless the client named a version itself. Calls that
carry no version (Generate, OpenAI's routes) go to a version target's model
at the version its node serves by default.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import xxhash

from modeld.backends.digits import ascii_digits
from modeld.backends.model_config import MODEL_NAME_RE
from modeld.server.gateway import wire

SESSION_HEADER = "x-session-id"
MAX_SPLITS = 256
MAX_TARGETS = 16
MAX_SESSION = 256  # longer session ids are cut: they only feed the hash
VERSION_SEPARATOR = ":"  # never in a model name, so "name:version" cannot be one


class SplitConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Split:
    model: str
    targets: tuple[str, ...]
    cumulative: tuple[float, ...]  # upper bounds in [0, 1), one per target

    def choose(self, point: float) -> str:
        for target, bound in zip(self.targets, self.cumulative):
            if point < bound:
                return target
        return self.targets[-1]


class TrafficSplit:
    def __init__(self, splits: dict[str, Split] | None = None, rng: random.Random | None = None) -> None:
        self.splits = splits or {}
        self._rng = rng or random.Random()

    def __bool__(self) -> bool:
        return bool(self.splits)

    def choose(self, model: str, session: str = "") -> str:
        """The model to forward a call for `model` to (itself when unsplit)."""
        split = self.splits.get(model)
        if split is None:
            return model
        if session:
            point = xxhash.xxh64_intdigest(f"{model}\0{session[:MAX_SESSION]}".encode()) / 2**64
        else:
            point = self._rng.random()
        return split.choose(point)


def target_parts(target: str) -> tuple[str, str]:
    """("scorer", "2") for "scorer:2"; (target, "") for a plain model name."""
    name, sep, version = target.partition(VERSION_SEPARATOR)
    return (name, version) if sep else (target, "")


def target_model(target: str) -> str:
    """The model a target names: what the call is placed by."""
    return target_parts(target)[0]


def retarget(data: bytes, name_field: int, target: str, version_field: int = 0) -> bytes:
    """A request's wire bytes sent to `target`: its model field (`name_field`)
    set to the target's model and, where the message has a version field
    (`version_field`: KServe's) and the client left it empty, that set to the
    target's version. Fields are appended, never parsed out: a parser keeps
    the last value of a singular field (wire.with_string_field)."""
    name, version = target_parts(target)
    data = wire.with_string_field(data, name_field, name)
    if version and version_field and not wire.string_field(data, version_field):
        data = wire.with_string_field(data, version_field, version)
    return data


def _valid_target(target: object) -> bool:
    if not isinstance(target, str):
        return False
    name, version = target_parts(target)
    if not MODEL_NAME_RE.fullmatch(name):
        return False
    if VERSION_SEPARATOR not in target:
        return True
    # a version as Triton numbers its folders: a positive decimal without leading zeros
    return ascii_digits(version) and not version.startswith("0") and len(version) <= 19


def parse_splits(raw: Any) -> TrafficSplit:
    """`[gateway.splits]` as TOML gives it: {model: {target: weight}}."""
    if raw in (None, {}):
        return TrafficSplit()
    if not isinstance(raw, dict) or len(raw) > MAX_SPLITS:
        raise SplitConfigError(f"gateway splits must be a table of at most {MAX_SPLITS} models, each a table of "
                               "target model = weight")
    splits = {}
    for model, targets in raw.items():
        if not isinstance(model, str) or not MODEL_NAME_RE.fullmatch(model):
            raise SplitConfigError(f"gateway split {str(model)[:80]!r} is not a model name")
        if not isinstance(targets, dict) or not 1 <= len(targets) <= MAX_TARGETS:
            raise SplitConfigError(f"gateway split {model!r} must name 1 to {MAX_TARGETS} targets with weights, "
                                   'e.g. {"chat-v1" = 95, "chat-v2" = 5}')
        for target, weight in targets.items():
            if not _valid_target(target):
                raise SplitConfigError(f"gateway split {model!r}: target {str(target)[:80]!r} is not a model name "
                                       "or a model name and version (\"name:2\")")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
                raise SplitConfigError(f"gateway split {model!r}: weight of {target!r} must be a number >= 0, "
                                       f"got {weight!r}")
        total = float(sum(targets.values()))
        if total <= 0:
            raise SplitConfigError(f"gateway split {model!r}: the weights add up to 0")
        names = tuple(targets)
        running, bounds = 0.0, []
        for name in names:
            running += targets[name] / total
            bounds.append(running)
        splits[model] = Split(model, names, tuple(bounds))
    return TrafficSplit(splits)

