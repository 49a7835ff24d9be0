"""What the engine drives to run the model (``interface.ModelExecutor``), and the
tensor-parallel implementation of it: the engine's handle on the worker processes
(``multiproc``) and the worker process itself (``worker``). The single-device
implementation is the ``ModelRunner`` (``inference.runner``) that each worker also holds,
so this package sits above the runner; the process group and collectives it sets up live
below, in ``inference.parallel_state``, where the models and layers use them."""
