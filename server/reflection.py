"""The descriptor pool gRPC reflection serves, shared by the daemon and the
gateway (which serves the same services) without either importing the other."""

from __future__ import annotations

from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from modeld.gen import _pool


def reflection_pool() -> DescriptorPool:
    # Reflection reads one pool: ours, holding the inference service, plus
    # copies of the health and reflection files from the default pool.
    for file in (health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR):
        try:
            _pool.POOL.FindFileByName(file.name)
        except KeyError:
            _pool.POOL.AddSerializedFile(file.serialized_pb)
    return _pool.POOL
