"""Speculation's counters: the engine's (vLLM's spec-decode metrics) and each sequence's state (its acceptance
estimate and counts)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .ngram_proposer import NgramIndex

PAUSE_TOKENS = 16  # output tokens of the first pause (doubling each time)


@dataclass
class SpecState:
    """One sequence's speculation: its indexes, acceptance estimate and counters (tokens).

    hits / misses: decayed counts of draft tokens accepted and of first rejections (:attr:`rate`); paused_until:
    output tokens before drafting resumes; pause: the next pause's length.  drafted / accepted: draft tokens scored
    and accepted; prediction_accepted / prediction_rejected: of those, the ones taken from the request's prediction
    (OpenAI's ``accepted_prediction_tokens`` / ``rejected_prediction_tokens``).  source: where the drafts scheduled
    now came from ("prediction", "lookup" or "suffix").
    """

    hits: float = 1.0
    misses: float = 1.0
    lookup: NgramIndex | None = None
    prediction: list[int] | None = None
    pred_index: NgramIndex | None = None
    pred_ptr: int | None = 0  # prediction position aligned with the output's end (None: lost until a resync)
    pred_seen: int = 0  # output tokens the pointer has followed
    paused_until: int = 0
    pause: int = PAUSE_TOKENS
    drafted: int = 0
    accepted: int = 0
    prediction_accepted: int = 0
    prediction_rejected: int = 0
    source: str = ""

    @property
    def rate(self) -> float:
        """The estimated chance that a draft token is accepted when the one before it was (0..1)."""
        return self.hits / (self.hits + self.misses)


@dataclass
class SpecStats:
    """Engine-wide counters (vLLM's spec-decode metrics): drafts (verify rows carrying drafts), draft tokens,
    accepted tokens, and accepted tokens per draft position (index 0: the first draft token)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
