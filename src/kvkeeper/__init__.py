"""kvkeeper: an LLM inference engine whose first-class object is the KV cache of a conversation."""

from .engine.llm_engine import LLMEngine, RequestOutput
from .engine.sampling_params import SamplingParams
from .errors import (ContextLengthError, InvalidRequestError, KVKeeperError, ModelFormatError, ModelNotFoundError,
                     UnsupportedArchitectureError)

__all__ = ["LLMEngine", "RequestOutput", "SamplingParams", "KVKeeperError", "ContextLengthError",
           "InvalidRequestError", "ModelFormatError", "ModelNotFoundError", "UnsupportedArchitectureError"]
__version__ = "0.1.0"
