"""IREE (OpenXLA): ONNX graphs compiled ahead of time for the CPU."""
