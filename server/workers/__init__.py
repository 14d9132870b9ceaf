"""Worker processes: a model that runs in a process of its own.

The engine side (`proxy.py`) is a LoadedModel / GenerativeModel that stands
in for the real one: the dynamic batcher stays in the daemon and ships whole
batches, generation runs in the worker's own loop and streams its events
back. The worker side (`main.py`) loads the model with the same
`Backend.load` and serves requests. Both ends speak length-prefixed pickle
frames (`frames.py`) over a Unix socketpair. `backoff.py` keeps a crashing
model from being restarted in a tight loop.
"""
