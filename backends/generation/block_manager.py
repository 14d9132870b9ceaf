"""Paged KV-cache bookkeeping: a pool of fixed-size blocks, a block table per
sequence, reference counts, and automatic prefix caching.

Full blocks are keyed by a chained hash of their tokens (the hash of a block
covers every token before it too). A hash is not proof: Python's tuple hash
is 64 bits and not collision resistant, so a hit also compares the block's
tokens and checks it was committed after the very block matched before it
(id and epoch: blocks handed out anew count up their epoch). Two prompts
thus share a block only when everything up to and including it is equal,
collision or not. Freed blocks keep their hash and sit in the free queue in
LRU order: a later prompt can revive them until their space is handed to
someone else. No torch, no numpy: tested in microseconds.

The chain hash is xxh3-64 over the block's token ids, seeded with the hash
before it, so another process (a gateway routing on this cache's published
block hashes, server/services/kv_events.py) computes the same values;
Python's own hash of a tuple holding None differs from process to process.
A sequence may carry a salt (its hash namespace: an adapter's name, say),
which seeds its first block: sequences with different salts never share a
block, and the empty salt gives the unsalted hashes.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

import xxhash


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and computed
    token_ids: tuple[int, ...] = ()  # with hash: the tokens whose KV it holds
    parent: tuple[int, int] | None = None  # with hash: (block id, epoch) of the block before it
    epoch: int = 0  # counts the times the block was handed out for new content
    salt: bytes = b""  # with hash: the namespace of the sequence that computed it


def chain_hash(previous: int, tokens: tuple[int, ...]) -> int:
    """The hash of a block after the block hashed `previous` (a sequence's
    first block: its salt's seed, `salt_seed`)."""
    return xxhash.xxh3_64_intdigest(array("i", tokens).tobytes(), seed=previous)


def salt_seed(salt: bytes) -> int:
    """The seed of a sequence's first block: 0 without a salt."""
    return xxhash.xxh3_64_intdigest(salt) if salt else 0


def prompt_hashes(token_ids: list[int], block_size: int, salt: bytes = b"") -> list[int]:
    """The chain hashes of the blocks of a prompt a cache could serve (the
    whole blocks before its last token, as match_prefix looks them up)."""
    hashes, previous = [], salt_seed(salt)
    for index in range((len(token_ids) - 1) // block_size):
        previous = chain_hash(previous, tuple(token_ids[index * block_size:(index + 1) * block_size]))
        hashes.append(previous)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free blocks, least recently used first; cached ones keep their hash
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.tables: dict[int, list[int]] = {}  # seq id -> block ids
        # seq id -> per committed full block: its chain hash, and the (id, epoch)
        # of the cached block a lookup of this exact prefix reaches there (None
        # past a collision: no lookup can get further)
        self._chain: dict[int, list[tuple[int, tuple[int, int] | None]]] = {}
        self._salts: dict[int, bytes] = {}  # seq id -> its hash namespace, where not empty

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- what a gateway reads (server/services/kv_events.py) -------------------

    kv_cache_kind = "paged"

    @property
    def kv_block_size(self) -> int:
        return self.block_size

    def kv_block_hashes(self) -> frozenset[int]:
        """The chain hashes a prompt's lookup can hit now. Called from
        another thread than the one changing the cache: copying a dict of
        ints runs without releasing the GIL, so the copy is consistent."""
        return frozenset(self.cached.copy())

    def kv_prompt_hashes(self, token_ids: list[int], salt: bytes = b"") -> list[int]:
        return prompt_hashes(token_ids, self.block_size, salt)

    # -- prefix cache ----------------------------------------------------------

    def start_sequence(self, seq_id: int, salt: bytes = b"") -> None:
        """A sequence with no cached prefix; `salt` its hash namespace."""
        self.tables[seq_id], self._chain[seq_id] = [], []
        self._set_salt(seq_id, salt)

    def match_prefix(self, seq_id: int, token_ids: list[int], salt: bytes = b"") -> int:
        """Give a new sequence the cached blocks of its longest cached prefix
        among blocks computed under the same `salt`.

        At least one prompt token is left uncomputed (its logits are needed),
        so only blocks wholly before the last token can match. Returns the
        number of tokens covered.
        """
        self._set_salt(seq_id, salt)
        table, chain, previous, parent = [], [], salt_seed(salt), None
        for index in range((len(token_ids) - 1) // self.block_size):
            chunk = tuple(token_ids[index * self.block_size:(index + 1) * self.block_size])
            key = chain_hash(previous, chunk)
            block_id = self.cached.get(key)
            if block_id is None or not self._holds(block_id, chunk, parent, salt):
                break  # not cached, or a hash collision: another prompt's KV
            self._take(block_id)
            table.append(block_id)
            parent = self._link(block_id)
            chain.append((key, parent))
            previous = key
        self.tables[seq_id] = table
        self._chain[seq_id] = chain
        return len(table) * self.block_size

    def commit(self, seq_id: int, token_ids: list[int], num_computed: int) -> None:
        """Register the hashes of blocks that became full and computed."""
        chain, table = self._chain[seq_id], self.tables[seq_id]
        salt = self._salts.get(seq_id, b"")
        for index in range(len(chain), min(num_computed // self.block_size, len(table))):
            chunk = tuple(token_ids[index * self.block_size:(index + 1) * self.block_size])
            previous, parent = chain[-1] if chain else (salt_seed(salt), None)
            key = chain_hash(previous, chunk)
            link = None
            if index == 0 or parent is not None:
                block, cached_id = self.blocks[table[index]], self.cached.get(key)
                if cached_id is not None and self._holds(cached_id, chunk, parent, salt):
                    # this prefix computed twice at once: lookups reach the first copy
                    link = self._link(cached_id)
                elif block.hash is None:
                    if cached_id is not None:
                        # a collision, or a block whose parent was handed out anew
                        # (unreachable): this one serves lookups from now on
                        self._forget_hash(cached_id)
                    block.hash, block.token_ids, block.parent, block.salt = key, chunk, parent, salt
                    self.cached[key] = block.block_id
                    link = self._link(block.block_id)
            chain.append((key, link))

    # -- allocation ------------------------------------------------------------

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        """Make the table cover num_tokens positions; False (nothing taken) if it can't."""
        table = self.tables.setdefault(seq_id, [])
        self._chain.setdefault(seq_id, [])
        extra = self.blocks_for(num_tokens) - len(table)
        if extra > self.num_free:
            return False
        for _ in range(extra):
            block_id = next(iter(self.free))
            self._take(block_id)
            self._forget_hash(block_id)
            self.blocks[block_id].epoch += 1
            table.append(block_id)
        return True

    def shrink(self, seq_id: int, num_tokens: int) -> None:
        """Drop blocks wholly past num_tokens (rejected draft tokens)."""
        table = self.tables[seq_id]
        keep = self.blocks_for(num_tokens)
        for block_id in table[keep:]:
            self._release(block_id)
        del table[keep:]
        del self._chain[seq_id][keep:]

    def free_sequence(self, seq_id: int) -> None:
        """Release a finished or preempted sequence; its hashed blocks stay cached."""
        for block_id in reversed(self.tables.pop(seq_id, [])):
            self._release(block_id)
        self._chain.pop(seq_id, None)
        self._salts.pop(seq_id, None)

    def _set_salt(self, seq_id: int, salt: bytes) -> None:
        if salt:
            self._salts[seq_id] = salt
        else:
            self._salts.pop(seq_id, None)

    def _link(self, block_id: int) -> tuple[int, int]:
        return block_id, self.blocks[block_id].epoch

    def _holds(self, block_id: int, chunk: tuple[int, ...], parent: tuple[int, int] | None,
               salt: bytes = b"") -> bool:
        """Whether a cached block holds exactly these tokens after exactly
        this parent, in this namespace (the parent's chain carries the salt
        past the first block; a collision there needs this check)."""
        block = self.blocks[block_id]
        return block.token_ids == chunk and block.parent == parent and block.salt == salt

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None  # most recently used end

    def _forget_hash(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids, block.parent, block.salt = None, (), None, b""
