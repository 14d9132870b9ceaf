"""Core ML (macOS): converted models, compiled once and cached."""
