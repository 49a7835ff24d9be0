"""Model families, keyed by ``config.architectures``."""

from inference.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from inference.models.llama import LlamaForCausalLM

MODEL_REGISTRY = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}


def get_model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    return MODEL_REGISTRY[config.architecture]


__all__ = ["MODEL_REGISTRY", "ModelConfig", "SUPPORTED_ARCHITECTURES", "get_model_class"]
