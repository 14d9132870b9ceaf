"""N-gram lookup proposer: draft tokens copied from earlier in the text.

If the last n tokens occurred before, propose what followed them then. No
model is needed; it pays off on copy-heavy work (editing code, quoting the
prompt). Longest n first, most recent occurrence first.
"""

from __future__ import annotations


def propose_ngram(tokens: list[int], num_tokens: int, max_n: int = 4, min_n: int = 1,
                  max_lookback: int = 4096) -> list[int]:
    history = tokens[-max_lookback:]
    length = len(history)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = history[length - n:]
        # scan backwards for the most recent earlier occurrence of `tail`
        for start in range(length - n - 1, -1, -1):
            if history[start:start + n] == tail:
                follow = history[start + n:start + n + num_tokens]
                if follow:
                    return follow
    return []
