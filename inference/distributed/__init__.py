"""Tensor parallelism: the process group and its collectives (``parallel_state``), the
worker processes (``worker``) and the engine's handle on them (``executor``)."""
