"""treadle: an LLM inference and serving engine."""

from treadle.config import EngineArgs
from treadle.engine.llm import LLM
from treadle.outputs import CompletionOutput, Logprob, RequestOutput
from treadle.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "EngineArgs", "RequestOutput",
           "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
