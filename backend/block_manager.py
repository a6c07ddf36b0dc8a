"""Paged KV block allocation with reference counts and automatic prefix caching.

A sequence's block table maps its token positions to physical blocks. Full blocks are hashed,
chained with the hash of the block before (so a hash names the whole prefix) and salted with the
request's cache_salt (so tenants never share blocks). A freed block keeps its hash and stays
findable until the allocator reuses it; free blocks are reused least-recently-freed first, and a
sequence's blocks are freed tail first so that shared prefixes survive longest.
"""

from __future__ import annotations

from collections import OrderedDict

from backend.sequence import Sequence

NO_PARENT_HASH = 0


def hash_block(parent_hash: int, token_ids: tuple[int, ...], cache_salt: str | None) -> int:
    return hash((parent_hash, cache_salt, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # Blocks with ref count 0, in reuse order (first = reused next).
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached_blocks: dict[int, int] = {}  # block hash -> block id

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
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | None = None) -> bool:
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

    def _take_ref(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.free_queue[block_id]
        self.ref_counts[block_id] += 1

    def _allocate_fresh_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        old_hash = self.block_hash[block_id]
        if old_hash is not None:
            # Evict: the least recently freed cached block loses its identity.
            if self.cached_blocks.get(old_hash) == block_id:
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

    def reset_prefix_cache(self) -> None:
        for block_hash, block_id in list(self.cached_blocks.items()):
            self.block_hash[block_id] = None
            del self.cached_blocks[block_hash]
