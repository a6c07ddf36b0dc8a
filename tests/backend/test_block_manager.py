"""Unit tests of the paged block allocator and its prefix cache."""

from __future__ import annotations

from backend.api import SamplingParams
from backend.block_manager import BlockManager
from backend.sequence import Sequence

BLOCK = 4


def make_seq(tokens: list[int], salt: str | None = None, order: int = 0) -> Sequence:
    return Sequence(
        request_id=f"r{order}",
        prompt_token_ids=tokens,
        sampling=SamplingParams(max_tokens=4),
        max_tokens=4,
        arrival_order=order,
        cache_salt=salt,
    )


def compute_all(manager: BlockManager, seq: Sequence) -> None:
    """Allocate and mark every token computed, as the engine does after a prefill."""
    assert manager.allocate_slots(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    manager.cache_full_blocks(seq)


def test_allocation_and_free_track_ref_counts():
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    seq = make_seq(list(range(10)))
    assert manager.allocate_slots(seq, 10)
    assert len(seq.block_table) == 3
    assert manager.num_free_blocks == 5
    assert all(manager.ref_counts[b] == 1 for b in seq.block_table)
    manager.free(seq)
    assert manager.num_free_blocks == 8
    assert manager.ref_counts == [0] * 8


def test_allocation_fails_without_side_effects_when_short():
    manager = BlockManager(num_blocks=2, block_size=BLOCK)
    seq = make_seq(list(range(12)))
    assert not manager.allocate_slots(seq, 12)
    assert seq.block_table == [] and manager.num_free_blocks == 2


def test_shared_prefix_blocks_are_reused_with_ref_counts():
    manager = BlockManager(num_blocks=16, block_size=BLOCK)
    first = make_seq(list(range(10)), order=0)
    compute_all(manager, first)
    second = make_seq(list(range(8)) + [99, 98, 97], order=1)
    hits = manager.find_cached_prefix(second)
    assert hits == first.block_table[:2]
    assert manager.allocate_slots(second, second.num_tokens - 8, hits)
    assert second.num_computed_tokens == 8
    assert [manager.ref_counts[b] for b in hits] == [2, 2]
    manager.free(first)
    assert [manager.ref_counts[b] for b in hits] == [1, 1]
    manager.free(second)
    assert manager.num_free_blocks == 16


def test_hash_is_chained_with_the_prefix():
    manager = BlockManager(num_blocks=16, block_size=BLOCK)
    first = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0])
    compute_all(manager, first)
    # Same second block, different first block: the second block must not hit.
    other = make_seq([9, 9, 9, 9, 5, 6, 7, 8, 0], order=1)
    assert manager.find_cached_prefix(other) == []
    assert other.block_hashes[1] != first.block_hashes[1]


def test_cache_salt_isolates_tenants():
    manager = BlockManager(num_blocks=16, block_size=BLOCK)
    tokens = list(range(13))
    compute_all(manager, make_seq(tokens, salt="tenant-a"))
    assert manager.find_cached_prefix(make_seq(tokens, salt="tenant-b", order=1)) == []
    assert manager.find_cached_prefix(make_seq(tokens, salt=None, order=2)) == []
    assert len(manager.find_cached_prefix(make_seq(tokens, salt="tenant-a", order=3))) == 3


def test_never_caches_the_whole_prompt():
    manager = BlockManager(num_blocks=16, block_size=BLOCK)
    compute_all(manager, make_seq(list(range(8))))
    # An identical 8-token prompt must still compute its last token to get logits.
    assert len(manager.find_cached_prefix(make_seq(list(range(8)), order=1))) == 1


def test_unreferenced_cached_blocks_are_evicted_least_recently_freed_first():
    manager = BlockManager(num_blocks=4, block_size=BLOCK)
    old = make_seq([1] * 4 + [0], order=0)
    compute_all(manager, old)
    manager.free(old)
    recent = make_seq([2] * 4 + [0], order=1)
    compute_all(manager, recent)
    manager.free(recent)
    assert manager.num_free_blocks == 4  # cached but unreferenced blocks count as free
    # Two fresh blocks are needed: the never-hashed ones go first, then the oldest cached block.
    filler = make_seq([3] * 12, order=2)
    assert manager.allocate_slots(filler, 12)
    assert manager.find_cached_prefix(make_seq([1] * 4 + [0], order=3)) == []
    assert len(manager.find_cached_prefix(make_seq([2] * 4 + [0], order=4))) == 1


def test_cache_hit_on_a_free_block_takes_it_out_of_the_free_pool():
    manager = BlockManager(num_blocks=4, block_size=BLOCK)
    first = make_seq([5] * 8 + [0])
    compute_all(manager, first)
    manager.free(first)
    again = make_seq([5] * 8 + [1], order=1)
    hits = manager.find_cached_prefix(again)
    assert len(hits) == 2
    assert manager.allocate_slots(again, 1, hits)
    assert manager.num_free_blocks == 1
    assert all(manager.ref_counts[b] == 1 for b in again.block_table)
    # Only one block is left: a 2-block request must be refused, not steal the shared ones.
    assert not manager.allocate_slots(make_seq([7] * 8, order=2), 8)
