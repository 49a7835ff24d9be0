"""Tensor parallelism's upper half: the engine's handle on the worker processes
(``multiproc``) and the worker process itself (``worker``), which holds a ``ModelRunner``
(``inference.runner``) of its shard, so this package sits above the runner. The process
group and collectives it sets up live below, in ``inference.parallel_state``, where the
models and layers use them."""
