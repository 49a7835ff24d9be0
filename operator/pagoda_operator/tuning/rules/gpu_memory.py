"""The rules for gpuMemoryUtilization: the share of GPU memory an engine takes, most of it
for the KV cache."""

from __future__ import annotations

from pagoda_operator.tuning.context import Context
from pagoda_operator.tuning.model import GPU_MEMORY_UTILIZATION, Proposal


def after_oom(ctx: Context, why: str) -> list[Proposal]:
    """OOM kills in the window: a step less memory."""
    lower = round(ctx.memory - ctx.config.gpu_memory_step, 4)
    return [Proposal(GPU_MEMORY_UTILIZATION, lower, why)]


def for_full_cache(ctx: Context) -> list[Proposal]:
    """A full cache with a queue: a step more memory, only where an OOM would be seen
    (kube-state-metrics series present) and none was lately."""
    snapshot, config = ctx.snapshot, ctx.config
    last_oom = ctx.state.last_oom_time
    recent_oom = last_oom is not None and ctx.now - last_oom < config.oom_memory_cooldowns * (
        ctx.limits.cooldown_s
    )
    if recent_oom or snapshot.oom_kills is None:
        return []
    return [Proposal(
        GPU_MEMORY_UTILIZATION,
        round(ctx.memory + config.gpu_memory_step, 4),
        f"KV cache {snapshot.kv_cache_usage:.0%} full with a queue or preemptions "
        f"for {ctx.state.streaks.kv_bound} windows; no OOM kills seen",
    )]  # fmt: skip
