"""Whole numbers in text a caller or an operator writes.

str.isdigit also accepts superscripts ("¹") and other scripts' digits
("٣"), which int() then refuses with a ValueError that would reach the
caller as an internal error; every check before an int() of such text
asks this instead.
"""

from __future__ import annotations


def ascii_digits(text: str) -> bool:
    """Whether text is one or more ASCII digits 0-9, and nothing else."""
    return text.isascii() and text.isdigit()
