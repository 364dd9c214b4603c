"""jaxoverlap: a JAX/XLA LLM serving engine with an overlap scheduler."""
from jaxoverlap.config import EngineConfig
from jaxoverlap.outputs import GenerationResult, RequestMetrics, RequestOutput
from jaxoverlap.sampling_params import SamplingParams
from jaxoverlap.structured import StructuredOutput

__version__ = "0.1.0"


def __getattr__(name):
    # The engine pulls in JAX and the models; import it only when asked for.
    if name == "LLM":
        from jaxoverlap.llm import LLM

        return LLM
    if name == "Engine":
        from jaxoverlap.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams", "StructuredOutput", "RequestOutput", "RequestMetrics",
           "GenerationResult"]
