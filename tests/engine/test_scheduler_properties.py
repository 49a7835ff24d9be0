"""Property-based: random interleavings of add / step / abort (with preemption forced by a
small cache, and with async scheduling's overlapping steps) never leak or double-free a
block, keep reference counts exact, respect the token budget and max_num_seqs, and finish
every request with exactly its tokens. No model: the step bookkeeping is the scheduler's own
(``on_step_launched`` / ``on_step_finished``), the stop rule the output processor's."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from inference.block_manager import BlockManager
from inference.output_processor import OutputProcessor, RequestState
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
    """LLMEngine's loop without a model (nor a tokenizer): every sampled token is derived
    from its position. With async scheduling a step is launched before the previous step's
    tokens are known."""

    def __init__(
        self, num_blocks: int, block_size: int, max_seqs: int, budget: int, cache: bool,
        async_scheduling: bool,
    ):  # fmt: skip
        self.bm = BlockManager(num_blocks, block_size, cache)
        self.sched = Scheduler(self.bm, max_seqs, budget)
        self.processor = OutputProcessor(None, set(), max_model_len=1000)
        self.requests: dict[str, RequestState] = {}
        self.async_scheduling = async_scheduling
        self.in_flight: tuple[list[Sequence], list[int]] | None = None
        self.live: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.next_id = 0

    def add(self, prompt_len: int, max_tokens: int, prefix_group: int) -> None:
        # Shared prefixes make the prefix cache and ref counts > 1 matter.
        prompt = [prefix_group] * 8 + [(self.next_id * 7 + i) % 50 for i in range(prompt_len)]
        seq = Sequence(
            self.next_id, str(self.next_id), 0, prompt, SamplingParams(max_tokens=max_tokens)
        )
        self.requests[seq.request_id] = self.processor.new_request(
            seq.request_id, None, prompt, seq.params, [seq], 0.0
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
        assert len(set(map(id, batch.seqs))) == len(batch.seqs)
        launched = None
        if batch:
            sampled = [batch.seqs[row] for row in batch.sample_rows]
            launched = (sampled, self.sched.on_step_launched(batch, now=0.0))
        previous, self.in_flight = self.in_flight, launched
        if previous is not None:
            self._complete(*previous)
        if launched is not None and not self.async_scheduling:
            self.in_flight = None
            self._complete(*launched)

    def _complete(self, seqs: list[Sequence], positions: list[int]) -> None:
        token_ids = [position % 50 for position in positions]
        self.sched.on_step_finished(seqs, positions, token_ids)
        for seq, token_id in zip(seqs, token_ids):
            if seq.is_finished:
                continue
            if self.processor.process_token(self.requests[seq.request_id], seq, token_id, None, 0.0):
                self._finish(seq)

    def abort(self, index: int) -> None:
        if self.live:
            seq = self.live[index % len(self.live)]
            seq.finish_reason = "abort"
            self._finish(seq)

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
        for seq in self.live:
            # At most the in-flight step's token is unknown; none without async scheduling.
            assert seq.num_pending_tokens <= (1 if self.async_scheduling else 0)
            assert all(t >= 0 for t in seq.token_ids[: seq.num_known_tokens])
        for seq in self.finished:
            assert seq.block_table == [] and seq.num_pending_tokens == 0


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(op, max_size=60),
    block_size=BLOCK_SIZE,
    max_seqs=st.integers(1, 6),
    budget=st.integers(1, 64),
    cache=st.booleans(),
    async_scheduling=st.booleans(),
)
def test_random_operations_keep_invariants(
    ops, block_size, max_seqs, budget, cache, async_scheduling
):
    # Enough blocks for the longest possible sequence (8 + 40 + 12 tokens), not for many.
    num_blocks = -(-60 // block_size) + 2
    engine = FakeEngine(num_blocks, block_size, max_seqs, budget, cache, async_scheduling)
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
        if seq.finish_reason == "length":
            # Outputs are never duplicated or lost across preemptions and placeholders,
            # and each is the token sampled at its position.
            assert seq.num_tokens == seq.num_prompt_tokens + seq.params.max_tokens
            assert seq.output_token_ids == [
                position % 50 for position in range(seq.num_prompt_tokens, seq.num_tokens)
            ]


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

    def run(batch) -> None:
        sampled = [batch.seqs[row] for row in batch.sample_rows]
        positions = sched.on_step_launched(batch, now=0.0)
        assert [s.num_pending_tokens for s in sampled] == [1] * len(sampled)
        sched.on_step_finished(sampled, positions, [9] * len(sampled))

    batch = sched.schedule()
    assert batch.seqs == [old, new] and batch.sample_rows == [0, 1] and bm.num_free_blocks == 0
    run(batch)
    # old's 4th token fits in its second block, its 5th needs a third: new gets preempted.
    batch = sched.schedule()
    assert batch.seqs == [old, new]
    run(batch)
    batch = sched.schedule()
    assert batch.preempted == [new] and batch.seqs == [old]
    assert list(sched.waiting) == [new] and new.num_computed_tokens == 0
    assert new.token_ids == [4, 5, 6, 9, 9]  # outputs kept for recompute
