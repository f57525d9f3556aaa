"""kvkeeper: an LLM inference engine whose first-class object is the KV cache of a conversation."""

from .startup import paused_gc

with paused_gc():  # PyTorch's import, about a fifth faster without the collector (kvkeeper.startup)
    from .engine.config import EngineConfig
    from .engine.llm_engine import LLMEngine
    from .engine.outputs import RequestOutput, TurnResult
    from .sampling.params import SamplingParams
    from .errors import (ContextLengthError, InvalidRequestError, KVKeeperError, ModelFormatError, ModelNotFoundError,
                         UnsupportedArchitectureError)
    from .sessions import Session, SessionConfig, SessionManager

__all__ = ["LLMEngine", "EngineConfig", "RequestOutput", "TurnResult", "SamplingParams", "Session",
           "SessionConfig", "SessionManager", "KVKeeperError", "ContextLengthError", "InvalidRequestError",
           "ModelFormatError", "ModelNotFoundError", "UnsupportedArchitectureError"]
__version__ = "0.1.0"
