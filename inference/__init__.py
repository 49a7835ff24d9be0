"""pagoda's inference engine: paged KV cache, continuous batching, OpenAI-compatible API."""

from inference.lora.request import LoRARequest
from inference.outputs import CompletionOutput, Logprob, RequestOutput
from inference.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


def __getattr__(name: str):
    # LLM pulls in torch and transformers; keep `import inference` light for the CLI.
    if name == "LLM":
        from inference.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = [
    "LLM", "CompletionOutput", "Logprob", "LoRARequest", "RequestOutput", "RequestOutputKind",
    "SamplingParams", "StructuredOutputsParams",
]
