"""modeld's private descriptor pool (see build.py for why it is not the default)."""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
