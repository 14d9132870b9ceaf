"""PrefixIndex: longest prefix per node, LRU over blocks, forgetting a node."""

from __future__ import annotations

import pytest

from modeld.server.gateway.prefix import PrefixIndex, chain_hashes


def test_each_node_gets_its_longest_inserted_prefix():
    index = PrefixIndex(block_chars=4)
    index.insert("a", "sys:" + "abcd" + "efgh")
    index.insert("b", "sys:" + "abcd" + "wxyz")
    index.insert("c", "othr")
    assert index.match("sys:abcdefgh and more") == {"a": 12, "b": 8}
    assert index.match("sys:abcdwxyz") == {"a": 8, "b": 12}
    assert index.match("sys:zzzz") == {"a": 4, "b": 4}
    assert index.match("othrsys:") == {"c": 4}
    assert index.match("nothing in common") == {}


def test_matches_are_whole_blocks():
    index = PrefixIndex(block_chars=4)
    index.insert("a", "abcdefgh")
    assert index.match("abcdefg") == {"a": 4}  # the partial second block does not count
    assert index.match("abcdefgX") == {"a": 4}


def test_text_shorter_than_a_block_matches_nothing():
    index = PrefixIndex(block_chars=64)
    index.insert("a", "short")
    assert len(index) == 0
    assert index.match("short") == {}
    assert list(chain_hashes("x" * 63, 64)) == []


def test_a_block_means_its_whole_prefix():
    index = PrefixIndex(block_chars=4)
    index.insert("a", "AAAABBBB")
    assert index.match("CCCCBBBB") == {}  # the same second block after a different first


def test_blocks_are_characters_not_bytes():
    index = PrefixIndex(block_chars=2)
    index.insert("a", "日本語です")
    assert index.match("日本語で") == {"a": 4}


def test_the_lru_evicts_the_oldest_prompts_tail_first():
    index = PrefixIndex(block_chars=2, capacity=3)
    index.insert("a", "aabb")
    index.insert("a", "cc")
    assert len(index) == 3
    index.insert("a", "dd")
    assert len(index) == 3
    assert index.match("aabb") == {"a": 2}  # its tail went first, the head still matches
    index.insert("a", "ee")
    assert index.match("aabb") == {}
    assert index.match("ccddee") == {"a": 2}
    assert index.match("dd") == {"a": 2} and index.match("ee") == {"a": 2}


def test_inserting_again_refreshes_a_prompt():
    index = PrefixIndex(block_chars=2, capacity=4)
    index.insert("a", "aabb")
    index.insert("b", "ccdd")
    index.insert("a", "aabb")  # now "ccdd" is the oldest
    index.insert("c", "ee")
    assert index.match("aabb") == {"a": 4}
    assert index.match("ccdd") == {"b": 2}


def test_matching_does_not_refresh():
    index = PrefixIndex(block_chars=2, capacity=2)
    index.insert("a", "aa")
    index.insert("b", "bb")
    assert index.match("aa") == {"a": 2}
    index.insert("c", "cc")
    assert index.match("aa") == {}


def test_remove_node_forgets_only_that_node():
    index = PrefixIndex(block_chars=4)
    index.insert("a", "sys:abcdefgh")
    index.insert("b", "sys:abcd")
    assert len(index) == 3
    index.remove_node("a")
    assert index.match("sys:abcdefgh") == {"b": 8}
    assert len(index) == 2  # the block only "a" held is gone
    index.remove_node("b")
    index.remove_node("never there")
    assert len(index) == 0 and index.match("sys:abcd") == {}


def test_invalid_sizes_are_refused():
    with pytest.raises(ValueError):
        PrefixIndex(block_chars=0)
    with pytest.raises(ValueError):
        PrefixIndex(capacity=0)
