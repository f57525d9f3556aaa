"""Errors raised by kvkeeper.

Every error says what was wrong and how to fix it.  They all derive from
:class:`KVKeeperError`, so a caller (the CLI, the server) can turn any of them
into a clean message instead of a stack trace.
"""


class KVKeeperError(Exception):
    """Base class of every error kvkeeper raises on purpose."""


class ModelNotFoundError(KVKeeperError):
    """The model id is not known and is not a path to an existing file or folder."""


class ModelFormatError(KVKeeperError):
    """A model file or folder exists but is corrupt, truncated or incomplete."""


class UnsupportedArchitectureError(KVKeeperError):
    """The model's architecture is not one kvkeeper implements."""


class InvalidRequestError(KVKeeperError, ValueError):
    """A request's parameters or messages are invalid (empty conversation, bad sampling value...).

    param: the request field at fault, as a client names it (``logit_bias``, ``response_format``...),
    when one is; the HTTP server returns it as the error's ``param``.
    """

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """A prompt (plus the tokens asked for) does not fit in the model's context window."""

    def __init__(self, prompt_tokens: int, context_length: int, max_tokens: int = 0, prompt_bytes: int | None = None):
        """prompt_bytes: the prompt was measured in bytes only (UTF-8), ``prompt_tokens`` being the fewest tokens
        that many bytes can be (the vocabulary's longest token bounds the bytes per token)."""
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length
        self.max_tokens = max_tokens
        if max_tokens:
            msg = (
                f"prompt is {prompt_tokens} tokens and max_tokens is {max_tokens}, "
                f"together {prompt_tokens + max_tokens} tokens, but the model's context window is "
                f"{context_length} tokens; shorten the prompt or lower max_tokens"
            )
        elif prompt_bytes is not None:
            msg = (
                f"prompt is {prompt_bytes} bytes, at least {prompt_tokens} tokens, but the model's context window is "
                f"{context_length} tokens; shorten the prompt (or trim earlier turns)"
            )
        else:
            msg = (
                f"prompt is {prompt_tokens} tokens but the model's context window is "
                f"{context_length} tokens; shorten the prompt (or trim earlier turns)"
            )
        super().__init__(msg)


class SessionNotFoundError(KVKeeperError, KeyError):
    """No open session has this id."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "session not found"


class SessionBusyError(InvalidRequestError):
    """A session already has a turn in flight; its next turn must wait for it (HTTP 409)."""


class OverloadedError(KVKeeperError):
    """KV memory is short and new sessions are refused for now; retry after ``retry_after_s`` seconds (HTTP 503)."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QuotaExceededError(KVKeeperError):
    """A tenant is at one of its limits (open sessions, pinned KV blocks); retry after ``retry_after_s``
    seconds, or close / offload one of its sessions first (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class InsufficientMemoryError(KVKeeperError):
    """A model's estimated memory need exceeds the memory available to this process (it is refused before its
    weights are loaded, see :mod:`kvkeeper.engine.memory_fit`).  ``needed``, ``available``: bytes."""

    def __init__(self, message: str, needed: int, available: int):
        super().__init__(message)
        self.needed, self.available = needed, available
