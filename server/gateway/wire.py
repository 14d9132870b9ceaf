"""Read one field out of a serialized protobuf message without parsing it.

The gateway routes ModelInfer by its model name and forwards the request's
bytes untouched; decoding the whole message (and copying every tensor
payload into Python objects) only to read field 1 would cost more than the
hop itself. This walks the top-level fields, skipping the others by length.
"""

from __future__ import annotations


class WireError(ValueError):
    """The bytes are not a protobuf message."""


class TooManyFields(WireError):
    """More top-level fields than the gateway walks (RESOURCE_EXHAUSTED):
    the walk is Python, one step per field, and must stay bounded."""


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


def string_field(data: bytes, number: int, max_fields: int | None = None) -> str:
    """The last value of string field `number` (protobuf's rule for repeated
    scalars on the wire); "" when absent, as proto3 reads it."""
    return routing_fields(data, number, max_fields=max_fields)[0]


def routing_fields(data: bytes, number: int, parameters: int = 0,
                   max_fields: int | None = None) -> tuple[str, int | None]:
    """String field `number`, and when `parameters` names a KServe
    `map<string, InferParameter>` field, its `timeout` entry (microseconds;
    None when absent), in one walk over the top-level fields. `max_fields`
    bounds the walk."""
    found: bytes | None = None
    timeout: int | None = None
    pos, end, count = 0, len(data), 0
    while pos < end:
        count += 1
        if max_fields is not None and count > max_fields:
            raise TooManyFields(f"the request has more than {max_fields} top-level fields, the gateway's "
                                "max_request_fields; send fewer inputs per request")
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
            elif parameters and field == parameters:
                entry = _timeout_entry(data[pos:pos + length])
                if entry is not None:
                    timeout = entry
            pos += length
        else:
            raise WireError(f"field {field} has wire type {kind}, which proto3 never writes")
        if field == 0:
            raise WireError("field number 0")
    if pos > end:
        raise WireError("truncated fixed-width field")
    if found is None:
        return "", timeout
    try:
        return found.decode("utf-8"), timeout
    except UnicodeDecodeError:
        raise WireError(f"field {number} is not UTF-8 text") from None


def _timeout_entry(entry: bytes) -> int | None:
    """A map entry's value when its key is "timeout" and the value an
    integer parameter (int64_param 2 or uint64_param 5); else None."""
    key = value = None
    pos, end = 0, len(entry)
    while pos < end:
        tag, pos = _varint(entry, pos)
        field, kind = tag >> 3, tag & 7
        if kind != 2:
            raise WireError("a parameters entry holds a field that is not length-delimited")
        length, pos = _varint(entry, pos)
        if pos + length > end:
            raise WireError("a parameters entry runs past its end")
        if field == 1:
            key = entry[pos:pos + length]
        elif field == 2:
            value = entry[pos:pos + length]
        pos += length
    if key != b"timeout" or value is None:
        return None
    pos, found = 0, None
    while pos < len(value):
        tag, pos = _varint(value, pos)
        field, kind = tag >> 3, tag & 7
        if kind == 0:
            number, pos = _varint(value, pos)
            if field in (2, 5):
                found = number if field == 5 or number < 2**63 else number - 2**64
        elif kind == 1:
            pos += 8
        elif kind == 2:
            length, pos = _varint(value, pos)
            pos += length
        else:
            pos += 4
    return found


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits, value = value & 0x7F, value >> 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def with_string_field(data: bytes, number: int, value: str) -> bytes:
    """`data` with string field `number` set to `value`, without parsing it:
    for a singular field a parser keeps the last value on the wire, so
    appending one overrides what the client sent (a 2 GiB request is
    retargeted by one copy, never decoded)."""
    encoded = value.encode()
    return data + _encode_varint(number << 3 | 2) + _encode_varint(len(encoded)) + encoded
