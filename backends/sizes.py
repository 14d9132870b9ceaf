"""Human byte sizes: '2GiB', '512MB', '1048576'."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative: {value}")
        return value
    match = _SIZE_RE.match(str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {value!r} (examples: 2GiB, 512MB, 1048576)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(nbytes: int) -> str:
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= factor:
            return f"{nbytes / factor:.1f}{unit}"
    return f"{nbytes}B"
