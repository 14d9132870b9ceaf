"""Read one field out of a serialized protobuf message without parsing it.

The gateway routes ModelInfer by its model name and forwards the request's
bytes untouched; decoding the whole message (and copying every tensor
payload into Python objects) only to read field 1 would cost more than the
hop itself. This walks the top-level fields, skipping the others by length.
"""

from __future__ import annotations


class WireError(ValueError):
    """The bytes are not a protobuf message."""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise WireError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireError("varint longer than 10 bytes")


def string_field(data: bytes, number: int) -> str:
    """The last value of string field `number` (protobuf's rule for repeated
    scalars on the wire); "" when absent, as proto3 reads it."""
    found: bytes | None = None
    pos, end = 0, len(data)
    while pos < end:
        key, pos = _varint(data, pos)
        field, kind = key >> 3, key & 7
        if kind == 0:
            _, pos = _varint(data, pos)
        elif kind == 1:
            pos += 8
        elif kind == 5:
            pos += 4
        elif kind == 2:
            length, pos = _varint(data, pos)
            if pos + length > end:
                raise WireError(f"field {field} runs past the end of the message")
            if field == number:
                found = data[pos:pos + length]
            pos += length
        else:
            raise WireError(f"field {field} has wire type {kind}, which proto3 never writes")
        if field == 0:
            raise WireError("field number 0")
    if pos > end:
        raise WireError("truncated fixed-width field")
    if found is None:
        return ""
    try:
        return found.decode("utf-8")
    except UnicodeDecodeError:
        raise WireError(f"field {number} is not UTF-8 text") from None
