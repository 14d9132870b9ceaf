"""ONNX Runtime for language models (onnxruntime-genai)."""
