"""The one thread that runs every language-model computation in the daemon.

llama.cpp (ggml) and torch share one OpenMP runtime in this process (torch's
libgomp is loaded first and ggml binds to it), and OpenMP keeps a thread team
per calling thread. Measured here: with torch loaded on one thread and
llama.cpp decoding on another, llama.cpp ran at a third to half of its speed;
stepping on a thread other than the one that loaded the model cost 1.5-2x too.
So loading and every step of both LLM backends run on this thread. On two
cores the steps of different models would compete for the CPU anyway.
"""

from concurrent.futures import ThreadPoolExecutor

COMPUTE_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="modeld-compute")
