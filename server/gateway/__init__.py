"""The gateway: one gRPC address in front of many daemons."""
