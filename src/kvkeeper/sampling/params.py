"""Per-request sampling and stopping parameters."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import InvalidRequestError

GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature: 0 means greedy (argmax), and so does any temperature below 1e-5 (as in vLLM: dividing
    logits by it would overflow).  top_p in (0, 1], top_k (0 or -1 = off).
    seed: makes sampling reproducible for this request, whatever else is batched with it.
    max_tokens: new tokens at most (None: up to the context window).
    stop: strings that end generation; the matched string is not returned.
    stop_token_ids: extra token ids that end generation (EOS always does unless ignore_eos).
    logprobs: number of top log-probabilities to return per token (None: none).
    Raises :class:`InvalidRequestError` on out-of-range values.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if self.temperature is None:
            self.temperature = 0.0
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise InvalidRequestError(f"logprobs must be between 0 and 20, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1
