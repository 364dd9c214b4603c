"""Model families (Qwen3, Qwen2, Llama 3.x) as pure JAX functions over pytree params."""
from jaxoverlap.models.config import ModelConfig
from jaxoverlap.models.params import LayerParams, ModelParams

__all__ = ["ModelConfig", "LayerParams", "ModelParams"]
