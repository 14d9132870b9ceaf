"""IncrementalText: text deltas never split a UTF-8 character, and text that
may start a stop string is held back until it is known."""

from __future__ import annotations

from modeld.backends.generation.detokenize import IncrementalText


def _feed(text: IncrementalText, pieces: list[bytes]) -> list[str]:
    return [text.push(p) for p in pieces]


def test_a_character_split_across_tokens_comes_out_whole():
    text = IncrementalText(())
    assert _feed(text, [b"caf\xc3", b"\xa9!"]) == ["caf", "\u00e9!"]
    # a four-byte character in three tokens
    emoji = "\U0001f600".encode()
    assert _feed(text, [emoji[:1], emoji[1:3], emoji[3:] + b"x"]) == ["", "", "\U0001f600x"]
    assert text.flush() == ""


def test_invalid_bytes_are_replaced_not_held():
    text = IncrementalText(())
    assert text.push(b"a\xffb") == "a\ufffdb"


def test_flush_releases_what_is_held_and_replaces_a_partial_character():
    text = IncrementalText(("STOP",))
    assert text.push(b"ab ST") == "ab "  # "ST" may begin the stop string
    assert text.push(b"\xc3") == ""
    assert text.flush() == "ST\ufffd"
    assert text.flush() == ""


def test_a_stop_string_spanning_tokens_ends_the_text_before_it():
    text = IncrementalText(("STOP",))
    assert _feed(text, [b"go S", b"T", b"OP and more"]) == ["go ", "", ""]
    assert text.stopped
    assert text.push(b"later") == "" and text.flush() == ""


def test_held_text_is_released_once_it_cannot_be_a_stop():
    text = IncrementalText(("STOP",))
    assert _feed(text, [b"a S", b"ay", b"S"]) == ["a ", "Say", ""]
    assert text.flush() == "S" and not text.stopped


def test_the_earliest_stop_wins_whichever_string_it_is():
    text = IncrementalText(("world", "o"))
    assert text.push(b"hello world") == "hell"


def test_below_min_tokens_a_stop_string_does_not_end_the_text():
    text = IncrementalText(("STOP",), min_tokens=3)
    # tokens 1 and 2 hold a whole stop string: it is text like any other
    assert _feed(text, [b"a STOP", b" b"]) == ["a STOP", " b"]
    assert not text.stopped
    assert text.push(b" STOP c") == " " and text.stopped  # the third token's stop counts


def test_a_stop_the_min_tokens_th_token_completes_counts():
    text = IncrementalText(("STOP",), min_tokens=2)
    assert _feed(text, [b"x ST", b"OP y"]) == ["x ", ""]
    assert text.stopped


def test_a_stop_that_ended_before_min_tokens_never_counts_later():
    # "xa" is held (it may begin "xab") though it holds the whole stop "a"
    text = IncrementalText(("a", "xab"), min_tokens=2)
    assert text.push(b"xa") == ""
    assert text.push(b"c") == "xac" and not text.stopped
    assert text.push(b"da") == "d" and text.stopped
