"""Multi-LoRA serving: many fine-tunes of one base model, mixed in one batch.

- ``request``: ``LoRARequest``, what a request names (vLLM's class shape);
- ``peft``: a PEFT adapter folder read and checked against the base model;
- ``slots``: which adapter sits in which device slot (LRU, pure Python), decided where a
  step's inputs are built, so tensor-parallel workers receive the same decisions;
- ``device``: the slots' preallocated A/B tensors, the per-token slot index a step reads,
  and the CPU cache of loaded adapters; the model's projections add their update through
  ``LayerLoRA`` (``kernels.lora``).
"""
