"""NovaInfer: a readable LLM inference engine for Hugging Face decoder models."""

from novainfer.engine.arg_utils import EngineArgs
from novainfer.engine.llm_engine import LLMEngine
from novainfer.entrypoints.llm import LLM
from novainfer.outputs import CompletionOutput, RequestOutput
from novainfer.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "LLMEngine", "RequestOutput", "RequestOutputKind", "SamplingParams", "__version__"]
