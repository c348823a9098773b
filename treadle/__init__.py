"""treadle: an LLM inference and serving engine."""

from treadle.config import EngineArgs
from treadle.engine.async_llm import AsyncLLM
from treadle.engine.errors import EngineBusyError, EngineDeadError
from treadle.engine.llm import LLM
from treadle.outputs import CompletionOutput, Logprob, RequestOutput
from treadle.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "AsyncLLM", "EngineBusyError", "EngineDeadError", "SamplingParams", "RequestOutputKind", "EngineArgs", "RequestOutput",
           "CompletionOutput", "Logprob", "StructuredOutputsParams"]
__version__ = "0.1.0"
