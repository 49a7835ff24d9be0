"""Running the model in this process: ``model_runner`` (weights, KV cache, forward,
sampling), ``step_inputs`` (a step as host arrays) and ``cuda_graphs`` (steps replayed as
recorded graphs). Below the engine and the tensor-parallel executor, above the models:
nothing here knows about requests, scheduling or other processes."""
