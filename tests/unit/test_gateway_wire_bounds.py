"""The gateway's routing read: the model name and the KServe `timeout`
parameter in one bounded walk over a request's top-level fields."""

from __future__ import annotations

import pytest

from modeld.gen import inference_pb2 as pb
from modeld.server.gateway import wire


def _request(**parameters) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m", raw_input_contents=[b"\0" * 16])
    for name, value in parameters.items():
        if isinstance(value, str):
            request.parameters[name].string_param = value
        else:
            request.parameters[name].int64_param = value
    return request


def test_the_timeout_parameter_is_read_with_the_model_name():
    assert wire.routing_fields(_request(timeout=1, priority=3).SerializeToString(), 1, 4) == ("m", 1)
    request = _request()
    request.parameters["timeout"].uint64_param = 2_500_000
    assert wire.routing_fields(request.SerializeToString(), 1, 4) == ("m", 2_500_000)
    assert wire.routing_fields(_request(priority=1).SerializeToString(), 1, 4) == ("m", None)
    assert wire.routing_fields(_request(timeout="soon").SerializeToString(), 1, 4) == ("m", None)


def test_the_walk_stops_at_max_fields():
    request = _request()
    request.raw_input_contents.extend([b"\0"] * 99)
    data = request.SerializeToString()
    assert wire.routing_fields(data, 1, max_fields=101) == ("m", None)
    with pytest.raises(wire.TooManyFields, match="more than 100 top-level fields"):
        wire.routing_fields(data, 1, max_fields=100)


def test_group_wire_types_are_refused_not_skipped():
    # a group (wire type 3) proto3 never writes: refused, so no reader can be made to skip a model name
    with pytest.raises(wire.WireError, match="wire type 3"):
        wire.string_field(b"\x0b" + _request().SerializeToString(), 1)
