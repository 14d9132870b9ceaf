"""The daemon's HTTP fronts: the OpenAI API (/v1) and KServe v2 REST (/v2),
served in the daemon's own event loop over the same data plane as gRPC."""
