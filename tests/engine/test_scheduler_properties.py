"""Property-based: random interleavings of add / step / abort (with preemption forced by a
small cache) never leak or double-free a block, keep reference counts exact, respect the
token budget and max_num_seqs, and finish every request. Pure Python: no model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from inference.block_manager import BlockManager
from inference.sampling_params import SamplingParams
from inference.scheduler import Scheduler
from inference.sequence import Sequence, SequenceStatus

BLOCK_SIZE = st.sampled_from([1, 2, 4, 16])

op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 3)),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 50)),
)


class FakeEngine:
    """The engine's bookkeeping without a model: every computed sequence 'samples' a token
    derived from its length, and finishes at its max_tokens."""

    def __init__(self, num_blocks: int, block_size: int, max_seqs: int, budget: int, cache: bool):
        self.bm = BlockManager(num_blocks, block_size, cache)
        self.sched = Scheduler(self.bm, max_seqs, budget)
        self.live: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.next_id = 0

    def add(self, prompt_len: int, max_tokens: int, prefix_group: int) -> None:
        # Shared prefixes make the prefix cache and ref counts > 1 matter.
        prompt = [prefix_group] * 8 + [(self.next_id * 7 + i) % 50 for i in range(prompt_len)]
        seq = Sequence(
            self.next_id, str(self.next_id), 0, prompt, SamplingParams(max_tokens=max_tokens)
        )
        self.next_id += 1
        self.live.append(seq)
        self.sched.add(seq)

    def step(self) -> None:
        batch = self.sched.schedule()
        assert batch.num_batched_tokens <= self.sched.max_num_batched_tokens
        assert len(self.sched.running) <= self.sched.max_num_seqs
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            assert n >= 1 and seq.num_computed_tokens + n <= seq.num_tokens
            assert len(seq.block_table) * self.bm.block_size >= seq.num_computed_tokens + n
            seq.num_computed_tokens += n
            self.bm.cache_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(seq.num_tokens % 50)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    self._finish(seq)
        assert len(set(map(id, batch.seqs))) == len(batch.seqs)

    def abort(self, index: int) -> None:
        if self.live:
            self._finish(self.live[index % len(self.live)])

    def _finish(self, seq: Sequence) -> None:
        self.sched.finish(seq)
        self.live.remove(seq)
        self.finished.append(seq)

    def check(self) -> None:
        self.bm.check_invariants(self.live)
        in_queues = list(self.sched.waiting) + self.sched.running
        assert sorted(s.seq_id for s in in_queues) == sorted(s.seq_id for s in self.live)
        for seq in self.sched.waiting:
            assert seq.status is SequenceStatus.WAITING
        for seq in self.finished:
            assert seq.block_table == []


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(op, max_size=60),
    block_size=BLOCK_SIZE,
    max_seqs=st.integers(1, 6),
    budget=st.integers(1, 64),
    cache=st.booleans(),
)
def test_random_operations_keep_invariants(ops, block_size, max_seqs, budget, cache):
    # Enough blocks for the longest possible sequence (8 + 40 + 12 tokens), not for many.
    num_blocks = -(-60 // block_size) + 2
    engine = FakeEngine(num_blocks, block_size, max_seqs, budget, cache)
    for name, *args in ops:
        getattr(engine, name)(*args)
        engine.check()
    for _ in range(10_000):  # drain: every request must finish
        if not engine.live:
            break
        engine.step()
        engine.check()
    assert not engine.live, "requests left unfinished"
    assert engine.bm.num_free_blocks == num_blocks
    for seq in engine.finished:
        if seq.finish_reason is None and seq.num_output_tokens >= seq.params.max_tokens:
            # Outputs are never duplicated or lost across preemptions.
            assert seq.num_tokens == seq.num_prompt_tokens + seq.params.max_tokens


def test_fcfs_no_overtaking():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=1000)
    big = Sequence(0, "big", 0, list(range(30)), SamplingParams())  # needs 8 blocks
    small = Sequence(1, "small", 0, [1, 2], SamplingParams())
    hog = Sequence(2, "hog", 0, list(range(5)), SamplingParams())
    sched.add(hog)
    sched.schedule()
    sched.add(big)
    sched.add(small)
    batch = sched.schedule()
    # big does not fit beside hog; small must not overtake it.
    assert [s.request_id for s in batch.seqs] == ["hog"]
    assert [s.request_id for s in sched.waiting] == ["big", "small"]


def test_preempts_newest_and_requeues_at_front():
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
    old = Sequence(0, "old", 0, [1, 2, 3], SamplingParams())
    new = Sequence(1, "new", 0, [4, 5, 6], SamplingParams())
    sched.add(old)
    sched.add(new)
    batch = sched.schedule()
    assert batch.seqs == [old, new] and bm.num_free_blocks == 0
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        seq.append_token(9)
    # old's 4th token fits in its second block, its 5th needs a third: new gets preempted.
    batch = sched.schedule()
    assert batch.seqs == [old, new]
    old.num_computed_tokens += 1
    new.num_computed_tokens += 1
    old.append_token(9)
    new.append_token(9)
    batch = sched.schedule()
    assert batch.preempted == [new] and batch.seqs == [old]
    assert list(sched.waiting) == [new] and new.num_computed_tokens == 0
    assert new.token_ids == [4, 5, 6, 9, 9]  # outputs kept for recompute
