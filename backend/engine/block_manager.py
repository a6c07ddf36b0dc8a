"""Paged KV block allocation with reference counts and automatic prefix caching.

A sequence's block table maps its token positions to physical blocks. Full blocks are hashed,
chained with the hash of the block before (so a hash names the whole prefix) and salted with the
request's cache_salt (so tenants never share blocks). A freed block keeps its hash and stays
findable until the allocator reuses it; free blocks are reused least-recently-freed first, and a
sequence's blocks are freed tail first so that shared prefixes survive longest.

Invariants (`BlockManager.check_invariants` checks them; every public method keeps them):

1. Free queue <=> unreferenced: block b is in `free_queue` exactly when `ref_counts[b] == 0`, and
   no ref count is negative. So free + referenced = `num_blocks`, and the queue (an OrderedDict)
   cannot hold a block twice.
2. Hash index is a bijection: `block_hash[b] == h` (h not None) exactly when `cached_blocks[h] == b`.
   A cached block may be free (findable until evicted) or referenced.
3. Without prefix caching nothing is hashed: `cached_blocks` is empty, every `block_hash` is None.
4. Given the block tables of all sequences that hold blocks: `ref_counts[b]` equals the number of
   tables holding b, and no table holds a block twice (so a free block is in no table).
5. A hashed block in a table sits where its hash says: at index i of seq's table, a block's hash is
   None (private) or `seq.block_hashes[i]`, so a prefix hit can never return another prefix's KV.
6. A table covers its computed tokens (`num_computed_tokens <= len(block_table) * block_size`) and
   `num_published_blocks <= len(block_table)`.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable

from ctxgate.backend.engine.sequence import Sequence

NO_PARENT_HASH = bytes(32)


def hash_block(parent_hash: bytes, token_ids: tuple[int, ...], cache_salt: str | None) -> bytes:
    """SHA-256 over the parent block's hash, the salt and the block's token ids: one digest per full
    block. Python's hash() of a tuple is 64 bits and not collision resistant (vLLM's CVE-2025-25183:
    crafted prompts colliding with another's prefix get its cached KV); equal digests here mean
    equal prefixes. Fields are length-delimited, so no two (salt, tokens) pairs share an encoding."""
    digest = hashlib.sha256(parent_hash)
    if cache_salt is None:
        digest.update(b"\x00")
    else:
        salt = cache_salt.encode("utf-8", "surrogatepass")
        digest.update(b"\x01" + len(salt).to_bytes(4, "little") + salt)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # Blocks with ref count 0, in reuse order (first = reused next).
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}  # block hash -> block id

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_block_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """Extend seq.block_hashes to cover every full block within its first `num_tokens` tokens."""
        size = self.block_size
        for index in range(len(seq.block_hashes), num_tokens // size):
            parent = seq.block_hashes[index - 1] if index else NO_PARENT_HASH
            tokens = tuple(seq.token_ids[index * size : (index + 1) * size])
            seq.block_hashes.append(hash_block(parent, tokens, seq.cache_salt))

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest full-block prefix of seq (at least one token left to compute)."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self.update_block_hashes(seq, max_blocks * self.block_size)
        hits: list[int] = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | None = None
    ) -> bool:
        """Make seq's block table cover `num_computed_tokens (+ cached) + num_new_tokens` tokens.

        `cached_blocks` (only for a sequence with an empty table) are prefix-cache hits to adopt:
        their tokens count as computed. Returns False, changing nothing, if blocks are short.
        """
        cached_blocks = cached_blocks or []
        num_computed = seq.num_computed_tokens + len(cached_blocks) * self.block_size
        needed = self.blocks_needed(num_computed + num_new_tokens) - len(seq.block_table) - len(cached_blocks)
        # Cached hits nobody references sit in the free queue; adopting them takes them out of it.
        reclaimed = sum(1 for block_id in cached_blocks if self.ref_counts[block_id] == 0)
        if needed > self.num_free_blocks - reclaimed:
            return False
        for block_id in cached_blocks:
            self._take_ref(block_id)
        seq.block_table.extend(cached_blocks)
        seq.num_computed_tokens = num_computed
        for _ in range(max(needed, 0)):
            seq.block_table.append(self._allocate_fresh_block())
        return True

    def fork(self, parent: Sequence, child: Sequence) -> int:
        """Let `child` (same prompt, empty table) share the parent's full prompt blocks, all but the
        one holding the prompt's last token (the child computes that tail itself, so it samples its
        own first token). Returns how many blocks it shares; copies no KV."""
        assert not child.block_table and child.prompt_token_ids == parent.prompt_token_ids
        shared = min(
            (parent.num_prompt_tokens - 1) // self.block_size, parent.num_computed_tokens // self.block_size
        )
        for block_id in parent.block_table[:shared]:
            self._take_ref(block_id)
        child.block_table = list(parent.block_table[:shared])
        child.block_hashes = list(parent.block_hashes[:shared])
        child.num_computed_tokens = shared * self.block_size
        child.num_published_blocks = min(parent.num_published_blocks, shared)
        return shared

    def _take_ref(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.free_queue[block_id]
        self.ref_counts[block_id] += 1

    def _allocate_fresh_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        old_hash = self.block_hash[block_id]
        if old_hash is not None:
            # Evict: the least recently freed cached block loses its identity (invariant 2).
            del self.cached_blocks[old_hash]
            self.block_hash[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def free(self, seq: Sequence) -> None:
        """Drop seq's references; blocks reaching zero become reusable (tail blocks first)."""
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
            if self.ref_counts[block_id] == 0:
                self.free_queue[block_id] = None
        seq.block_table = []
        seq.num_published_blocks = 0

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the hashes of seq's fully computed blocks so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        self.update_block_hashes(seq, num_full * self.block_size)
        for index in range(seq.num_published_blocks, num_full):
            block_id = seq.block_table[index]
            if self.block_hash[block_id] is not None:
                continue
            block_hash = seq.block_hashes[index]
            if block_hash in self.cached_blocks:
                continue  # an identical block is already cached; this one stays private
            self.block_hash[block_id] = block_hash
            self.cached_blocks[block_hash] = block_id
        seq.num_published_blocks = max(seq.num_published_blocks, num_full)

    # ---- invariants --------------------------------------------------------------------------
    def check_invariants(self, holders: Iterable[Sequence] | None = None) -> None:
        """Raise InvariantError naming the first broken invariant (see the module docstring).

        `holders` must be every sequence whose block table is not empty (an empty list: nobody
        holds a block); with None only the pool's own bookkeeping (invariants 1-3) is checked.
        Costs O(blocks + table entries): meant for tests and debugging, not for every engine step.
        """
        self._check_free_queue()
        self._check_hash_index()
        if holders is not None:
            self._check_tables(list(holders))

    def _check_free_queue(self) -> None:
        for block_id, count in enumerate(self.ref_counts):
            require_invariant(count >= 0, f"block {block_id} has ref count {count} < 0")
            in_queue = block_id in self.free_queue
            require_invariant(
                in_queue == (count == 0),
                f"block {block_id} has ref count {count} but is {'' if in_queue else 'not '}in the free queue",
            )
        require_invariant(
            all(0 <= block_id < self.num_blocks for block_id in self.free_queue),
            f"the free queue holds block ids outside [0, {self.num_blocks})",
        )

    def _check_hash_index(self) -> None:
        if not self.enable_prefix_caching:
            require_invariant(not self.cached_blocks, "prefix caching is off but cached_blocks is not empty")
        for block_hash, block_id in self.cached_blocks.items():
            require_invariant(
                self.block_hash[block_id] == block_hash,
                f"cached_blocks[{block_hash}] = {block_id} but block_hash[{block_id}] = {self.block_hash[block_id]}",
            )
        for block_id, block_hash in enumerate(self.block_hash):
            if block_hash is not None:
                require_invariant(
                    self.cached_blocks.get(block_hash) == block_id,
                    f"block_hash[{block_id}] = {block_hash} but cached_blocks maps it to "
                    f"{self.cached_blocks.get(block_hash)}",
                )

    def _check_tables(self, holders: list[Sequence]) -> None:
        references: Counter[int] = Counter()
        for seq in holders:
            table = seq.block_table
            require_invariant(
                all(0 <= block_id < self.num_blocks for block_id in table),
                f"{seq.request_id} holds block ids outside [0, {self.num_blocks}): {table}",
            )
            require_invariant(len(set(table)) == len(table), f"{seq.request_id} holds a block twice: {table}")
            references.update(table)
            self._check_table_hashes(seq)
            require_invariant(
                seq.num_computed_tokens <= len(table) * self.block_size,
                f"{seq.request_id} has {seq.num_computed_tokens} computed tokens but {len(table)} blocks",
            )
            require_invariant(
                seq.num_published_blocks <= len(table),
                f"{seq.request_id} published {seq.num_published_blocks} blocks of a {len(table)}-block table",
            )
        for block_id, count in enumerate(self.ref_counts):
            require_invariant(
                count == references[block_id],
                f"block {block_id} has ref count {count} but {references[block_id]} tables hold it",
            )

    def _check_table_hashes(self, seq: Sequence) -> None:
        for index, block_id in enumerate(seq.block_table):
            block_hash = self.block_hash[block_id]
            if block_hash is None:
                continue
            require_invariant(
                index < len(seq.block_hashes) and seq.block_hashes[index] == block_hash,
                f"{seq.request_id} holds block {block_id} (hash {block_hash}) at index {index}, "
                "where its own prefix hashes to something else",
            )


class InvariantError(AssertionError):
    """The engine's bookkeeping contradicts itself: a bug in the allocator or in its caller."""


def require_invariant(condition: bool, message: str) -> None:
    """Raise InvariantError(message) unless `condition` holds."""
    # Not `assert`: the check must still run under `python -O`.
    if not condition:
        raise InvariantError(message)
