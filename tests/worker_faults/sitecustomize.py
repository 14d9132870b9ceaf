"""Loaded at start-up by every Python process whose PYTHONPATH names this
folder: the daemon a test starts and the worker processes it spawns. The
registry's "onnx" becomes FaultyOnnxBackend (faulty_onnx.py), which loads
like onnx unless the model folder asks it to fail."""

from modeld.backends.registry import BACKENDS

BACKENDS["onnx"] = "faulty_onnx:FaultyOnnxBackend"
