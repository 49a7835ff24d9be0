"""Engine settings that change while the engine runs, between two steps.

Live: ``max_num_seqs``, ``max_num_batched_tokens`` and the KV cache's size (``num_kv_blocks``;
on a GPU also ``gpu_memory_utilization``, which sizes it). A change is planned first
(``plan_change``: what it would cost, or why it cannot be made) and then applied
(``apply_change``) at a step boundary, with no step in flight:

1. a KV cache that shrinks first preempts the fewest running sequences (recompute, as
   the scheduler does when blocks run out) needed to fit, then moves every block still
   used past the new end into a free one below it (free blocks without cached content
   first); a growing one gets empty blocks at its end;
2. CUDA graphs: limits past the captured sizes need graphs for the sizes missing, and the
   graphs there are stay valid, so only those are recorded, in the background
   (``start_change``: the runner's ``capture_missing_graphs``, run on a thread of its own)
   while the engine keeps stepping under the old limits; the change takes effect at the
   first step boundary after the capture finished (``finish_change``), and a capture
   that fails refuses the change, leaving the engine as it was. Where the tensors the
   graphs read are reallocated (a KV resize, a sampled-ids buffer that must grow past 1024
   sequences) every graph is captured again, between two steps, as the engine starts
   (``capture_graphs``: the engine stalls for it);
3. the scheduler takes the new limits and ``engine.config`` says what now runs.

One change at a time: while one waits for its graphs, another is refused (409, say which
is under way; a dry run is answered). A change is answered once it is in effect, so its
``seconds`` include the capture. An engine that stops during a capture cancels it
(``LiveChange.cancel``: between graphs) and waits a bounded time for the thread.

Nothing a request sees changes: a preempted sequence keeps its tokens and recomputes its
KV, so its next tokens are the ones it would have had. Lowering ``max_num_seqs`` below the
running count admits nobody until the count is under it; nothing running is stopped.

What the runner must offer for each part is ``LiveRunner``; an executor without it (tensor
parallel workers) takes only the changes that need none of it, and refuses the rest with a
``ReconfigureError`` (409) that says so.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

from inference.block_manager import BlockManager
from inference.runner.cuda_graphs import MIXED_GRAPH_TOKENS
from inference.sequence import Sequence

logger = logging.getLogger(__name__)

LIVE_SETTINGS = ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks",
                 "gpu_memory_utilization")  # fmt: skip


class ReconfigureError(ValueError):
    """A change that is refused: ``status`` 422 for a value the engine cannot run, 409 for
    one it could run but cannot take live (a restart with the flag would)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class LiveRunner(Protocol):
    """What a model runner offers for live changes (``ModelRunner`` has all of it)."""

    def graph_limits(self) -> tuple[int, int] | None: ...
    def set_batch_limits(self, max_num_seqs: int, max_num_batched_tokens: int) -> bool: ...
    def blocks_at_memory_utilization(self, utilization: float) -> int: ...
    def resize_kv_cache(self, num_blocks: int, moves: list[tuple[int, int]]) -> None: ...
    def capture_graphs(self) -> float: ...
    def capture_missing_graphs(
        self, max_num_seqs: int, max_num_batched_tokens: int
    ) -> GraphCapture | None: ...


class GraphCapture(Protocol):
    """Graphs recorded in the background for raised limits (``ModelRunner``'s
    ``BackgroundGraphs``): ``run`` on the capture thread (raises on failure), ``cancel``
    from any thread (``run`` then stops between graphs), ``install`` on the stepping thread
    at a step boundary, after ``run`` returned."""

    num_graphs: int

    def run(self) -> None: ...
    def cancel(self) -> None: ...
    def install(self) -> None: ...


@dataclass
class ChangePlan:
    """What a change would do and cost, measured on the engine as it is now."""

    before: dict[str, Any]
    after: dict[str, Any]
    capture: str | None = None  # why CUDA graphs are captured first (None: no capture)
    kv_blocks: tuple[int, int] = (0, 0)  # before, after
    moved_blocks: int = 0  # used blocks copied below the new end (shrink)
    preemptions: int = 0  # running sequences recomputed to make a shrink fit
    background_graphs: int = 0  # graphs recorded while steps went on (not stalling)
    notes: list[str] = field(default_factory=list)
    victims: list[Sequence] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["victims"]
        out["capture_needed"] = self.capture is not None
        out["kv_blocks"] = {"before": self.kv_blocks[0], "after": self.kv_blocks[1]}
        return out


def live_settings(engine: Any) -> dict[str, Any]:
    """The live values of every setting that can change live."""
    config = engine.config
    return {
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "num_kv_blocks": engine.block_manager.num_blocks,
        "gpu_memory_utilization": config.gpu_memory_utilization,
    }


def plan_change(engine: Any, changes: dict[str, Any]) -> ChangePlan:
    """The plan of ``changes`` (setting -> value) on ``engine`` as it is now; changes
    nothing. ReconfigureError (422 or 409) for a change that cannot be made."""
    before = live_settings(engine)
    after = {**before, **_checked(changes)}
    runner = engine.runner
    config = engine.config
    _check_limits(after, config)
    plan = ChangePlan(before, after)
    plan.kv_blocks = (before["num_kv_blocks"], _target_blocks(runner, changes, before, plan))
    after["num_kv_blocks"] = plan.kv_blocks[1]
    resizes_kv = plan.kv_blocks[0] != plan.kv_blocks[1]
    grows_seqs = after["max_num_seqs"] > before["max_num_seqs"]
    grows_tokens = after["max_num_batched_tokens"] > before["max_num_batched_tokens"]
    if not _is_live_runner(runner) and (resizes_kv or grows_seqs or grows_tokens):
        raise ReconfigureError(409, (
            "this engine's executor (tensor parallel workers) takes only lower batch "
            "limits live; restart it with the new flags for a larger batch or KV cache"))
    _check_sized_parts(engine, after, resizes_kv)
    if resizes_kv:
        _check_capacity(plan.kv_blocks[1], config)
        _plan_shrink(engine.block_manager, engine.scheduler.running, plan)
    plan.capture = _capture_reason(runner, after, resizes_kv) if _is_live_runner(runner) else None
    return plan


def _check_sized_parts(engine: Any, after: dict[str, Any], resizes_kv: bool) -> None:
    """Refuses (409) what the parts sized at start-up beside the target cannot follow: a
    drafter's KV cache (``draft_model``, ``eagle``, ``eagle3``) mirrors the target's block
    ids and is not resized, and LoRA's per-token slot buffers and an EAGLE-3 head's target
    states hold the start-up step size."""
    spec = getattr(engine, "spec_decoder", None)
    if resizes_kv and spec is not None and spec.draft is not None:
        raise ReconfigureError(409, (
            f"the {spec.config.method} drafter's KV cache mirrors the target's blocks and "
            "is not resized live; restart the engine with the new KV cache size"))
    loras = getattr(engine.runner, "loras", None)
    needed = max(after["max_num_batched_tokens"], after["max_num_seqs"])
    if loras is not None and needed > loras.max_tokens:
        raise ReconfigureError(409, (
            f"LoRA's per-token buffers hold steps of {loras.max_tokens} tokens (sized at "
            f"start-up); steps of {needed} need a restart with the new flags"))
    model = getattr(engine.runner, "model", None)
    aux = getattr(model, "aux_states", None)
    if aux is not None and needed > aux.shape[0]:
        raise ReconfigureError(409, (
            f"the EAGLE-3 head's buffer of target states holds steps of {aux.shape[0]} tokens "
            f"(sized at start-up); steps of {needed} need a restart with the new flags"))


# How long an engine that stops waits for a capture thread to end (one graph's recording,
# where it checks for the stop, takes well under a second).
CANCEL_WAIT_S = 30.0


class LiveChange:
    """A change started by ``start_change``: ``done`` once it is in effect or refused;
    ``result()`` then gives (plan, seconds from its start) or raises the refusal. Until
    then its graphs are recorded on a thread of its own (``captured`` once that ended)."""

    def __init__(self, plan: ChangePlan, capture: GraphCapture | None = None) -> None:
        self.plan = plan
        self.capture = capture
        self.started = time.perf_counter()
        self.seconds = 0.0
        self.done = False
        self.refusal: ReconfigureError | None = None
        self._error: BaseException | None = None
        self._captured = threading.Event()
        self._thread: threading.Thread | None = None
        if capture is not None:
            # A daemon: a thread stuck in the driver never keeps the process from exiting.
            self._thread = threading.Thread(target=self._record, name="graph-capture",
                                            daemon=True)  # fmt: skip
            self._thread.start()

    def _record(self) -> None:
        try:
            self.capture.run()  # type: ignore[union-attr]
        except BaseException as error:  # noqa: BLE001 - reported when the change is finished
            self._error = error
        finally:
            self._captured.set()

    @property
    def captured(self) -> bool:
        return self._captured.is_set()

    def wait_captured(self, timeout: float | None = None) -> bool:
        return self._captured.wait(timeout)

    def under_way(self) -> str:
        return (f"a change is under way ({self.plan.before} -> {self.plan.after}: "
                f"{self.plan.background_graphs} CUDA graphs being captured); send another "
                "once it has been answered")  # fmt: skip

    def cancel(self, wait_s: float | None = None) -> None:
        """Stop the capture (the change is then never made) and wait up to ``wait_s`` for
        its thread."""
        if self.capture is None or self._thread is None:
            return
        self.capture.cancel()
        self._thread.join(CANCEL_WAIT_S if wait_s is None else wait_s)
        if self._thread.is_alive():
            logger.warning("the CUDA graph capture did not stop within %.0f s; leaving it",
                           CANCEL_WAIT_S if wait_s is None else wait_s)  # fmt: skip

    def result(self) -> tuple[ChangePlan, float]:
        assert self.done, "the change is still waiting for its graphs"
        if self.refusal is not None:
            raise self.refusal
        return self.plan, self.seconds


def start_change(engine: Any, plan: ChangePlan) -> LiveChange:
    """Start ``plan`` (from ``plan_change`` on this engine, with no step in flight): made
    now, unless it needs graphs the runner can record in the background, which start
    recording here; ``finish_change`` then makes it, between two steps."""
    runner = engine.runner
    resizes_kv = plan.kv_blocks[0] != plan.kv_blocks[1]
    if plan.capture is not None and not resizes_kv:
        try:  # on this thread: new buffers, and warm-up runs of sizes never run
            capture = runner.capture_missing_graphs(plan.after["max_num_seqs"],
                                                    plan.after["max_num_batched_tokens"])  # fmt: skip
        except Exception as error:  # noqa: BLE001 - the change is refused, the engine goes on
            logger.exception("live change refused: preparing the CUDA graph capture failed")
            raise ReconfigureError(409, (
                f"preparing CUDA graphs for {plan.after} failed ({type(error).__name__}: "
                f"{error}); nothing was changed")) from error
        if capture is not None:
            plan.background_graphs = capture.num_graphs
            logger.info("live change: %d CUDA graphs captured in the background (%s); steps "
                        "go on under the old limits", capture.num_graphs, plan.capture)  # fmt: skip
            return LiveChange(plan, capture)
    change = LiveChange(plan)
    change.seconds = apply_change(engine, plan)
    change.done = True
    return change


def finish_change(engine: Any, change: LiveChange) -> None:
    """Between two steps (none in flight), once ``change.captured``: switch to the new
    graphs and make the change, or refuse it if the capture failed (nothing changes: the
    graphs recorded are dropped, the old ones stay)."""
    assert change.captured and not change.done
    error = change._error
    if error is not None:
        logger.error("live change refused: the CUDA graph capture failed: %s: %s",
                     type(error).__name__, error)  # fmt: skip
        change.refusal = ReconfigureError(409, (
            f"capturing CUDA graphs for {change.plan.after} failed ({type(error).__name__}: "
            f"{error}); nothing was changed (a restart with the new flags captures them "
            "at start-up)"))
    else:
        change.capture.install()  # type: ignore[union-attr]
        apply_change(engine, change.plan, captured=True)
    change.seconds = time.perf_counter() - change.started
    change.done = True


def apply_change(engine: Any, plan: ChangePlan, captured: bool = False) -> float:
    """Carry out ``plan`` (from ``plan_change`` on this engine, with no step in flight;
    ``captured``: its graphs were recorded in the background and are installed); returns
    the seconds it took, any capture included."""
    start = time.perf_counter()
    after, runner = plan.after, engine.runner
    scheduler, block_manager = engine.scheduler, engine.block_manager
    recapture = False
    if _is_live_runner(runner):
        recapture = runner.set_batch_limits(after["max_num_seqs"], after["max_num_batched_tokens"])
    old_blocks, new_blocks = plan.kv_blocks
    if new_blocks != old_blocks:
        for seq in plan.victims:
            scheduler.running.remove(seq)
            scheduler._preempt(seq)  # recompute: the scheduler's own way to give blocks back
        if new_blocks < old_blocks:
            moves = block_manager.shrink_moves(new_blocks)
            assert moves is not None, "the preemptions were planned to make it fit"
            runner.resize_kv_cache(new_blocks, moves)
            block_manager.shrink(new_blocks, moves, scheduler.running)
        else:
            runner.resize_kv_cache(new_blocks, [])
            block_manager.grow(new_blocks)
        recapture = True
    if captured:
        assert not recapture, "background captures are only started for graphs that stay"
    elif _is_live_runner(runner) and (plan.capture is not None or recapture):
        captured_s = runner.capture_graphs()
        logger.info("live change: CUDA graphs captured in %.2f s", captured_s)
    scheduler.max_num_seqs = after["max_num_seqs"]
    scheduler.max_num_batched_tokens = after["max_num_batched_tokens"]
    engine.config = replace(
        engine.config, max_num_seqs=after["max_num_seqs"],
        max_num_batched_tokens=after["max_num_batched_tokens"],
        gpu_memory_utilization=after["gpu_memory_utilization"],
        num_kv_blocks=new_blocks if new_blocks != old_blocks else engine.config.num_kv_blocks,
    )  # fmt: skip
    engine.num_total_blocks = block_manager.num_blocks
    seconds = time.perf_counter() - start
    logger.info("live change applied in %.3f s: %s -> %s (%d preempted, %d blocks moved)",
                seconds, plan.before, plan.after, plan.preemptions, plan.moved_blocks)
    return seconds


def _checked(changes: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(changes) - set(LIVE_SETTINGS))
    if unknown:
        raise ReconfigureError(422, f"not a live setting: {', '.join(unknown)} (live: "
                                    f"{', '.join(LIVE_SETTINGS)}; others need a restart)")
    out: dict[str, Any] = {}
    for name, value in changes.items():
        if name == "gpu_memory_utilization":
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
                raise ReconfigureError(422, f"gpu_memory_utilization must be in (0, 1], got "
                                            f"{value!r}")
            out[name] = float(value)
        else:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ReconfigureError(422, f"{name} must be an integer >= 1, got {value!r}")
            out[name] = value
    return out


def _check_limits(after: dict[str, Any], config: Any) -> None:
    if after["max_num_batched_tokens"] < after["max_num_seqs"]:
        raise ReconfigureError(422, (
            f"max_num_batched_tokens ({after['max_num_batched_tokens']}) must be >= "
            f"max_num_seqs ({after['max_num_seqs']}): a step schedules at least one token "
            "per running sequence"))


def _check_capacity(num_blocks: int, config: Any) -> None:
    if num_blocks * config.block_size < config.max_model_len:
        raise ReconfigureError(422, (
            f"a KV cache of {num_blocks} blocks holds {num_blocks * config.block_size} "
            f"tokens, fewer than max_model_len={config.max_model_len}: one request could "
            "never finish"))


def _target_blocks(runner: Any, changes: dict[str, Any], before: dict[str, Any],
                   plan: ChangePlan) -> int:
    """The KV cache's new size: ``num_kv_blocks`` if given, else what a new
    ``gpu_memory_utilization`` allows (on CPU it sizes nothing: said in the notes)."""
    if "num_kv_blocks" in changes:
        return changes["num_kv_blocks"]
    utilization = changes.get("gpu_memory_utilization")
    if utilization is None or utilization == before["gpu_memory_utilization"]:
        return before["num_kv_blocks"]
    if not _is_live_runner(runner):
        raise ReconfigureError(409, "this engine's executor cannot resize its KV cache live")
    blocks = runner.blocks_at_memory_utilization(utilization)
    if blocks == before["num_kv_blocks"]:
        plan.notes.append("gpu_memory_utilization sizes no KV cache on this device")
    return blocks


def _plan_shrink(block_manager: BlockManager, running: list[Sequence], plan: ChangePlan) -> None:
    """The fewest running sequences whose preemption lets the cache fit in the new size,
    and the blocks that then move below it. Greedy: the sequence that would give back
    the most blocks first (blocks it alone holds), the newest among equals."""
    target = plan.kv_blocks[1]
    if target >= plan.kv_blocks[0]:
        return
    refs = {b.block_id: b.ref_count for b in block_manager.blocks if b.ref_count > 0}
    candidates = list(reversed(running))
    while len(refs) > target:
        if not candidates:
            raise ReconfigureError(409, f"the KV cache cannot shrink to {target} blocks: "
                                        "its live blocks do not fit")
        best = max(candidates, key=lambda s: sum(refs.get(b) == 1 for b in s.block_table))
        candidates.remove(best)
        plan.victims.append(best)
        for block_id in best.block_table:
            refs[block_id] -= 1
            if refs[block_id] == 0:
                del refs[block_id]
    plan.preemptions = len(plan.victims)
    plan.moved_blocks = sum(1 for block_id in refs if block_id >= target)


def _capture_reason(runner: LiveRunner, after: dict[str, Any], resizes_kv: bool) -> str | None:
    limits = runner.graph_limits()
    if limits is None:
        return None
    batch, tokens = limits
    if resizes_kv:
        return "the KV cache is reallocated: graphs read its tensors"
    if after["max_num_seqs"] > batch:
        return f"max_num_seqs {after['max_num_seqs']} is past the largest graph (batch {batch})"
    if min(after["max_num_batched_tokens"], MIXED_GRAPH_TOKENS[-1]) > tokens:
        return (f"max_num_batched_tokens {after['max_num_batched_tokens']} is past the largest "
                f"mixed-step graph ({tokens} tokens)")
    return None


def _is_live_runner(runner: Any) -> bool:
    return all(hasattr(runner, name) for name in
               ("graph_limits", "set_batch_limits", "resize_kv_cache"))  # fmt: skip


def change_costs(engine: Any) -> dict[str, dict[str, Any]]:
    """What changing each live setting costs from here: up to which value no CUDA graph is
    captured (None: no graphs, never), and below how many KV blocks a shrink preempts."""
    runner, config, block_manager = engine.runner, engine.config, engine.block_manager
    live = _is_live_runner(runner)
    limits = runner.graph_limits() if live else None
    used = block_manager.num_blocks - block_manager.num_free_blocks
    kv = {
        "live": live,
        "capture": limits is not None,  # graphs read the KV tensors: any resize recaptures
        "min_blocks": -(-config.max_model_len // config.block_size),
        "preempts_below_blocks": used,
    }
    return {
        "max_num_seqs": {"raise_live": live, "capture_above": limits[0] if limits else None},
        "max_num_batched_tokens": {
            "raise_live": live, "capture_above": limits[1] if limits else None},
        "num_kv_blocks": kv,
        "gpu_memory_utilization": {**kv, "sizes_kv_cache": config.device == "cuda"},
    }
