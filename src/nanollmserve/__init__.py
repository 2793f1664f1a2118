"""nanollmserve: an OpenAI-compatible LLM inference server written from scratch in Python.

The offline API:

    from nanollmserve import LLM, SamplingParams
    llm = LLM()  # the bundled SmolLM2-135M-Instruct
    outputs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
"""

from nanollmserve.lora_request import LoRARequest
from nanollmserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from nanollmserve.sampling_params import SamplingParams
from nanollmserve.structured_outputs import StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "Logprob",
    "LoRARequest",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]


def __getattr__(name: str):
    # Lazy: `import nanollmserve` stays light (no torch) for the CLI's argument parsing.
    if name == "LLM":
        from nanollmserve.llm import LLM

        return LLM
    if name == "EngineConfig":
        from nanollmserve.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'nanollmserve' has no attribute {name!r}")
