"""Unit tests of the paged block allocator and its prefix cache; the pool's invariants are checked
after every operation, here and in a random-operation property test."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ctxgate.backend.engine.api import SamplingParams
from ctxgate.backend.engine.block_manager import NO_PARENT_HASH, BlockManager, InvariantError, hash_block
from ctxgate.backend.engine.sequence import Sequence

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


def live(*sequences: Sequence) -> list[Sequence]:
    """The sequences that hold blocks, as check_invariants wants them."""
    return [seq for seq in sequences if seq.block_table]


def test_allocation_and_free_track_ref_counts():
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    seq = make_seq(list(range(10)))
    assert manager.allocate_slots(seq, 10)
    manager.check_invariants(live(seq))
    assert len(seq.block_table) == 3
    assert manager.num_free_blocks == 5
    assert all(manager.ref_counts[b] == 1 for b in seq.block_table)
    manager.free(seq)
    manager.check_invariants(live(seq))
    assert manager.num_free_blocks == 8
    assert manager.ref_counts == [0] * 8


def test_allocation_fails_without_side_effects_when_short():
    manager = BlockManager(num_blocks=2, block_size=BLOCK)
    seq = make_seq(list(range(12)))
    assert not manager.allocate_slots(seq, 12)
    manager.check_invariants(live(seq))
    assert seq.block_table == [] and manager.num_free_blocks == 2


def test_shared_prefix_blocks_are_reused_with_ref_counts():
    manager = BlockManager(num_blocks=16, block_size=BLOCK)
    first = make_seq(list(range(10)), order=0)
    compute_all(manager, first)
    manager.check_invariants(live(first))
    second = make_seq(list(range(8)) + [99, 98, 97], order=1)
    hits = manager.find_cached_prefix(second)
    assert hits == first.block_table[:2]
    assert manager.allocate_slots(second, second.num_tokens - 8, hits)
    manager.check_invariants(live(first, second))
    assert second.num_computed_tokens == 8
    assert [manager.ref_counts[b] for b in hits] == [2, 2]
    manager.free(first)
    manager.check_invariants(live(first, second))
    assert [manager.ref_counts[b] for b in hits] == [1, 1]
    manager.free(second)
    manager.check_invariants(live(first, second))
    assert manager.num_free_blocks == 16


def test_hash_is_chained_with_the_prefix():
    manager = BlockManager(num_blocks=16, block_size=BLOCK)
    first = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0])
    compute_all(manager, first)
    # Same second block, different first block: the second block must not hit.
    other = make_seq([9, 9, 9, 9, 5, 6, 7, 8, 0], order=1)
    assert manager.find_cached_prefix(other) == []
    assert other.block_hashes[1] != first.block_hashes[1]
    manager.check_invariants(live(first, other))


def test_different_token_blocks_never_share_a_cached_block():
    manager = BlockManager(num_blocks=128, block_size=BLOCK)
    # Python's hash() maps -1 and -2 to the same value, so hash() of these two blocks' tuples is equal;
    # a sha256 over the token bytes tells them apart.
    assert hash((-1, -1, -1, -1)) == hash((-2, -2, -2, -2))
    first = make_seq([-1] * 4 + [0], order=0)
    compute_all(manager, first)
    assert manager.find_cached_prefix(make_seq([-2] * 4 + [0], order=1)) == []
    # Many distinct blocks, each cached: every lookup finds its own block and no other's.
    owners = [make_seq([n, n >> 2, n * 7, 3] + [0], order=2 + n) for n in range(40)]
    for seq in owners:
        compute_all(manager, seq)
    assert len({seq.block_hashes[0] for seq in owners}) == len(owners)
    for seq in owners:
        probe = make_seq(list(seq.token_ids), order=100)
        assert manager.find_cached_prefix(probe) == seq.block_table[:1]
    # Salt and tokens are delimited: moving bytes between them changes the hash.
    assert hash_block(NO_PARENT_HASH, (1, 2), "a") != hash_block(NO_PARENT_HASH, (1, 2), "a\x01")
    assert hash_block(NO_PARENT_HASH, (1, 2), "") != hash_block(NO_PARENT_HASH, (1, 2), None)
    assert len(hash_block(NO_PARENT_HASH, (1, 2), None)) == 32  # one sha256 digest per block
    manager.check_invariants(live(first, *owners))


def test_cache_salt_isolates_tenants():
    manager = BlockManager(num_blocks=16, block_size=BLOCK)
    tokens = list(range(13))
    owner = make_seq(tokens, salt="tenant-a")
    compute_all(manager, owner)
    assert manager.find_cached_prefix(make_seq(tokens, salt="tenant-b", order=1)) == []
    assert manager.find_cached_prefix(make_seq(tokens, salt=None, order=2)) == []
    assert len(manager.find_cached_prefix(make_seq(tokens, salt="tenant-a", order=3))) == 3
    manager.check_invariants(live(owner))


def test_never_caches_the_whole_prompt():
    manager = BlockManager(num_blocks=16, block_size=BLOCK)
    owner = make_seq(list(range(8)))
    compute_all(manager, owner)
    # An identical 8-token prompt must still compute its last token to get logits.
    assert len(manager.find_cached_prefix(make_seq(list(range(8)), order=1))) == 1
    manager.check_invariants(live(owner))


def test_an_identical_block_computed_twice_stays_private():
    manager = BlockManager(num_blocks=16, block_size=BLOCK)
    # Both prefill before either publishes, so the second computes the same block again.
    first, second = make_seq([4] * 5, order=0), make_seq([4] * 5, order=1)
    assert manager.allocate_slots(first, 5) and manager.allocate_slots(second, 5)
    for seq in (first, second):
        seq.num_computed_tokens = seq.num_tokens
        manager.cache_full_blocks(seq)
        manager.check_invariants(live(first, second))
    assert manager.block_hash[first.block_table[0]] is not None
    assert manager.block_hash[second.block_table[0]] is None
    assert manager.cached_blocks == {first.block_hashes[0]: first.block_table[0]}


def test_unreferenced_cached_blocks_are_evicted_least_recently_freed_first():
    manager = BlockManager(num_blocks=4, block_size=BLOCK)
    old = make_seq([1] * 4 + [0], order=0)
    compute_all(manager, old)
    manager.free(old)
    recent = make_seq([2] * 4 + [0], order=1)
    compute_all(manager, recent)
    manager.free(recent)
    manager.check_invariants(live(old, recent))
    assert manager.num_free_blocks == 4  # cached but unreferenced blocks count as free
    # Two fresh blocks are needed: the never-hashed ones go first, then the oldest cached block.
    filler = make_seq([3] * 12, order=2)
    assert manager.allocate_slots(filler, 12)
    manager.check_invariants(live(filler))
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
    manager.check_invariants(live(again))
    assert manager.num_free_blocks == 1
    assert all(manager.ref_counts[b] == 1 for b in again.block_table)
    # Only one block is left: a 2-block request must be refused, not steal the shared ones.
    assert not manager.allocate_slots(make_seq([7] * 8, order=2), 8)
    manager.check_invariants(live(again))


def test_check_invariants_reports_broken_bookkeeping():
    """Each corruption the check must catch, on an otherwise healthy pool."""
    corruptions = {
        "free queue": lambda m, s: m.free_queue.pop(next(iter(m.free_queue))),
        "ref count": lambda m, s: m.ref_counts.__setitem__(s.block_table[0], 2),
        "cached_blocks": lambda m, s: m.cached_blocks.clear(),
        "at index": lambda m, s: s.block_table.reverse(),
        "holds a block twice": lambda m, s: s.block_table.__setitem__(1, s.block_table[0]),
        "outside": lambda m, s: s.block_table.append(m.num_blocks),
    }
    for expected, corrupt in corruptions.items():
        manager = BlockManager(num_blocks=8, block_size=BLOCK)
        seq = make_seq(list(range(9)))
        compute_all(manager, seq)
        manager.check_invariants(live(seq))
        corrupt(manager, seq)
        with pytest.raises(InvariantError, match=expected):
            manager.check_invariants(live(seq))


# Prompts are prefixes of these (plus a short random tail), so prefix hits and shared blocks are common.
SHARED_PROMPTS = [[0] * 18, [1, 2, 0] * 6, list(range(18))]


class BlockPoolMachine(RuleBasedStateMachine):
    """Random arrivals, prefix-hit admissions, chunked prefills, appends, finishes and preemptions,
    driven the way the scheduler drives the pool; the invariants must hold after every one."""

    @initialize(prefix_caching=st.booleans())
    def build_pool(self, prefix_caching: bool) -> None:
        # A small pool: allocations fail and free cached blocks get evicted.
        self.manager = BlockManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=prefix_caching)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.seen: list[Sequence] = []  # every sequence ever admitted
        self.arrivals = itertools.count()

    @rule(
        base=st.sampled_from(SHARED_PROMPTS),
        length=st.integers(1, 18),
        suffix=st.lists(st.integers(0, 2), max_size=3),
        salt=st.sampled_from([None, "t"]),
    )
    def arrive(self, base: list[int], length: int, suffix: list[int], salt: str | None) -> None:
        self.waiting.append(make_seq(base[:length] + suffix, salt, order=next(self.arrivals)))

    @precondition(lambda self: self.seen)
    @rule(data=st.data(), suffix=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def arrive_follow_up(self, data: st.DataObject, suffix: list[int]) -> None:
        """A next chat turn: an earlier request's prompt and output, plus a little more."""
        earlier = data.draw(st.sampled_from(self.seen))
        self.waiting.append(
            make_seq(earlier.token_ids + suffix, earlier.cache_salt, order=next(self.arrivals))
        )

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.waiting))
        hits = self.manager.find_cached_prefix(seq)
        remaining = seq.num_tokens - len(hits) * BLOCK
        chunk = data.draw(st.integers(1, remaining), label="chunk")
        if not self.manager.allocate_slots(seq, chunk, hits):
            assert seq.block_table == [] and seq.num_computed_tokens == 0
            return
        assert seq.num_computed_tokens == len(hits) * BLOCK
        self.waiting.remove(seq)
        self.running.append(seq)
        self.seen.append(seq)

    @precondition(lambda self: any(seq.num_uncomputed_tokens for seq in self.running))
    @rule(data=st.data())
    def allocate_more(self, data: st.DataObject) -> None:
        """The next prefill chunk or the slot for a decode token."""
        seq = data.draw(st.sampled_from([s for s in self.running if s.num_uncomputed_tokens]))
        table_before = list(seq.block_table)
        if not self.manager.allocate_slots(seq, data.draw(st.integers(1, seq.num_uncomputed_tokens))):
            assert seq.block_table == table_before

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 2))
    def compute(self, data: st.DataObject, token: int) -> None:
        """The model ran over every allocated slot; a fully computed sequence samples a token."""
        seq = data.draw(st.sampled_from(self.running))
        seq.num_computed_tokens = min(seq.num_tokens, len(seq.block_table) * BLOCK)
        self.manager.cache_full_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(token)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.running))
        self.manager.free(seq)
        self.running.remove(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.running))
        self.manager.free(seq)
        seq.num_computed_tokens = 0
        self.running.remove(seq)
        self.waiting.append(seq)

    @invariant()
    def pool_is_consistent(self) -> None:
        self.manager.check_invariants(self.running)
        assert all(not seq.block_table for seq in self.waiting)


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=60, stateful_step_count=50, deadline=None)
