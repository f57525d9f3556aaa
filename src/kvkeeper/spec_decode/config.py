"""``--speculative-config``: vLLM's fields for n-gram (prompt lookup) and suffix drafting, checked."""

from __future__ import annotations

from dataclasses import dataclass

from ..argtypes import parse_json_config
from ..errors import InvalidRequestError

METHODS = ("ngram", "suffix")
_HINT = ("e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
         "\"prompt_lookup_min\": 2}'")


@dataclass
class SpeculativeConfig:
    """vLLM's ``--speculative-config`` for n-gram (prompt lookup) and suffix drafting.

    method: "ngram" (prompt lookup) or "suffix" (prompt lookup, then the namespace's :class:`SuffixTable`); vLLM's
    draft-model, EAGLE and MTP methods are refused by name.
    num_speculative_tokens: draft tokens per step at most (k >= 1).  prompt_lookup_max / prompt_lookup_min: the
    longest and shortest suffix n-gram looked up (tokens, max >= min >= 1).  disable_by_batch_size: a step with
    more running sequences than this drafts nothing (None: the cost model alone decides, see the module docstring).
    suffix_decoding_max_cached_requests (suffix): finished requests whose tokens the suffix tables hold, all
    namespaces together (the oldest leave first).  suffix_decoding_min_token_prob (suffix): a table draft stops at
    the first token whose estimated probability (its count over its context's) is below this (0..1).  adaptive:
    true (default) sizes each draft from the cost model and the acceptance estimate; false drafts
    ``num_speculative_tokens`` every step (what the step's budget and max_tokens leave), so the counts depend on the
    tokens only, never on the step timings (reproducible tests and measurements).
    Raises :class:`InvalidRequestError` naming the field.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    disable_by_batch_size: int | None = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    suffix_decoding_max_cached_requests: int = 256
    suffix_decoding_min_token_prob: float = 0.1
    adaptive: bool = True

    def __post_init__(self):
        if type(self.adaptive) is not bool:
            raise InvalidRequestError(f"--speculative-config: adaptive must be true or false, got {self.adaptive!r}",
                                      param="speculative_config.adaptive")
        p = self.suffix_decoding_min_token_prob
        if type(p) not in (int, float) or not 0 <= p <= 1:
            raise InvalidRequestError(f"--speculative-config: suffix_decoding_min_token_prob must be a number in "
                                      f"[0, 1], got {p!r}", param="speculative_config.suffix_decoding_min_token_prob")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size",
                     "suffix_decoding_max_cached_requests"):
            v = getattr(self, name)
            if v is None and name == "disable_by_batch_size":
                continue
            if type(v) is not int or v < 1:
                raise InvalidRequestError(f"--speculative-config: {name} must be an integer >= 1, got {v!r}",
                                          param=f"speculative_config.{name}")
        if self.method not in METHODS:
            raise InvalidRequestError(f"--speculative-config: method {self.method!r} is not implemented; use "
                                      f"\"ngram\" (prompt lookup) or \"suffix\" (prompt lookup, then the "
                                      f"namespace's earlier requests)", param="speculative_config.method")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidRequestError(f"--speculative-config: prompt_lookup_min ({self.prompt_lookup_min}) is above "
                                      f"prompt_lookup_max ({self.prompt_lookup_max})",
                                      param="speculative_config.prompt_lookup_min")

    def describe(self) -> str:
        """One line for the load line: what runs."""
        gate = "" if self.disable_by_batch_size is None else f", off above {self.disable_by_batch_size} sequences"
        table = (f", suffix tables per namespace over the last {self.suffix_decoding_max_cached_requests} requests"
                 if self.method == "suffix" else "")
        return (f"{self.method} speculation (up to {self.num_speculative_tokens} draft tokens, "
                f"{'adaptive' if self.adaptive else 'fixed length'}, n-grams "
                f"{self.prompt_lookup_min}-{self.prompt_lookup_max}{table}{gate})")


def parse_speculative_config(raw) -> SpeculativeConfig | None:
    """A :class:`SpeculativeConfig` from JSON text, a dict or a config (None stays None).  Raises
    :class:`InvalidRequestError` naming an unknown field or a wrong value, or saying the text is not a JSON object."""
    if raw is None:
        return None
    return parse_json_config(raw, SpeculativeConfig, "--speculative-config", _HINT, "speculative_config")
