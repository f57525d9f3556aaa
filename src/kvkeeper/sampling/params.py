"""Per-request sampling and stopping parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import InvalidRequestError
from .structured import StructuredOutput

GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20  # top log-probabilities per token at most (OpenAI's limit)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, as OpenAI and vLLM


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature: 0 means greedy (argmax), and so does any temperature below 1e-5 (as in vLLM: dividing
    logits by it would overflow).  top_p in (0, 1], top_k (0 or -1 = off), min_p in [0, 1] (0 = off).
    seed: makes sampling reproducible for this request, whatever else is batched with it.
    max_tokens: new tokens at most (None: up to the context window).
    stop: strings that end generation; the matched string is not returned.
    stop_token_ids: extra token ids that end generation (EOS always does unless ignore_eos).
    logprobs: number of top log-probabilities to return per generated token (None: none); they are
    those of the model's raw logits (before penalties, biases or a grammar, as vLLM's default).
    prompt_logprobs: the same for every prompt token (vLLM's; None: none); such a request computes its
    whole prompt (no prefix-cache or session reuse), so the values never depend on what was cached.
    presence_penalty, frequency_penalty in [-2, 2] (OpenAI); repetition_penalty > 0 (1 = off; CTRL);
    logit_bias: {token id: bias in [-100, 100]} added to the logits (OpenAI); bad_words: strings whose
    tokens may not be generated (vLLM); structured: a grammar the output must follow (JSON schema,
    regex, choice, Lark; see :mod:`kvkeeper.sampling.structured`).  See
    :mod:`kvkeeper.sampling.processors` for each algorithm and its source.
    prediction: the text (or token ids) the output is expected to repeat (OpenAI's Predicted Outputs): the engine
    drafts from it and verifies the drafts, the output is unchanged (:mod:`kvkeeper.spec_decode`).
    speculative: False opts the request out of speculative decoding (n-gram drafts and the prediction alike).
    min_tokens: tokens generated at least before EOS or a stop token id may be (vLLM's; they are masked until then;
    0 = off); at most max_tokens.
    Raises :class:`InvalidRequestError` (with ``param``, the field) on out-of-range values.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    bad_words: list[str] = field(default_factory=list)
    structured: StructuredOutput | None = None
    prediction: str | list[int] | None = None
    speculative: bool = True
    min_tokens: int = 0

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if self.temperature is None:
            self.temperature = 0.0
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        self.bad_words = list(self.bad_words or [])
        self._check_ranges()
        self._check_lists()

    def _check_ranges(self) -> None:
        _check(self.temperature >= 0, "temperature", f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
               f"max_tokens must be >= 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0 and (self.max_tokens is None or self.min_tokens <= self.max_tokens), "min_tokens",
               f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(-2 <= v <= 2, name, f"{name} must be between -2 and 2 (0 = off), got {v}")
        r = self.repetition_penalty
        _check(r > 0 and math.isfinite(r), "repetition_penalty",
               f"repetition_penalty must be a finite number > 0 (1 = off, above 1 discourages repeats), got {r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(v is None or 0 <= v <= MAX_LOGPROBS, name, f"{name} must be between 0 and {MAX_LOGPROBS}, got {v}")
        _check(self.seed is None or SEED_MIN <= self.seed <= SEED_MAX, "seed",
               f"seed must be a 64-bit signed integer ({SEED_MIN} to {SEED_MAX}), got {self.seed}")

    def _check_lists(self) -> None:
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "stop_token_ids must be token ids (integers >= 0)")
        for tok, bias in self.logit_bias.items():
            _check(tok >= 0, "logit_bias", f"logit_bias keys must be token ids >= 0, got {tok}")
            _check(-100 <= bias <= 100, "logit_bias", f"logit_bias values must be between -100 and 100, "
                                                      f"got {bias} for token {tok}")
        _check(all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words",
               "bad_words must be non-empty strings")
        pred = self.prediction
        _check(pred is None or isinstance(pred, str) or all(type(t) is int and t >= 0 for t in pred), "prediction",
               "prediction must be a text or a list of token ids (integers >= 0)")
        _check(not (pred and not self.speculative), "prediction",
               "a prediction is used by speculative decoding, which this request turns off (speculative false): "
               "send one or the other")
        _check(not (self.structured is not None and self.ignore_eos), "ignore_eos",
               "ignore_eos cannot be combined with structured output: the grammar ends the output with EOS")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def has_processors(self) -> bool:
        """Whether the logits need changing before sampling (penalties, biases, banned words, a grammar)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.bad_words or self.min_tokens or self.structured is not None)
