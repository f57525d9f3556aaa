"""What a finished request and a finished turn report: :class:`RequestOutput`, :class:`TurnResult`.

A leaf module: the engine, the sessions, the server and the CLI all read these records.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .sequence import Sequence


def _timings(seq: Sequence) -> tuple[float | None, float | None]:
    """(time to first token in seconds, decode speed in tokens/s after the first token)."""
    ttft = None if seq.t_first_token is None else seq.t_first_token - seq.t_arrival
    speed = None
    if seq.t_first_token is not None and seq.t_last_token and seq.num_output_tokens > 1:
        dt = seq.t_last_token - seq.t_first_token
        speed = (seq.num_output_tokens - 1) / dt if dt > 0 else None
    return ttft, speed


@dataclass
class RequestOutput:
    """The result of one request.

    token_ids: generated ids (incl. a final EOS or the token that completed a stop string).
    text: generated text, stop string excluded.  cached_tokens: prompt tokens whose KV was reused
    (prefix-cache hits or a session's hand-over).  Times are in seconds; decode speed in tokens/s.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    cached_tokens: int
    ttft_s: float | None
    decode_tok_per_s: float | None
    num_preemptions: int = 0
    logprobs: list = field(default_factory=list)
    error: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @classmethod
    def from_seq(cls, seq: Sequence) -> "RequestOutput":
        ttft, speed = _timings(seq)
        return cls(seq.request_id, seq.token_ids[: seq.num_prompt_tokens], list(seq.output_token_ids), seq.text,
                   seq.finish_reason, seq.num_cached_tokens or 0, ttft, speed, seq.num_preemptions,
                   list(seq.logprobs), seq.error)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class TurnResult:
    """Stats and output of one turn of a session.  Times in seconds, speed in tokens/s."""

    turn: int
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float | None
    decode_tok_per_s: float | None
    finish_reason: str | None
    context: dict | None = None  # the context policy's report (kvkeeper.sessions.context.ContextReport)
    compression: dict | None = None  # session compression at the turn's end (kvkeeper.sessions.compress)

    @classmethod
    def from_seq(cls, turn: int, seq: Sequence, context: dict | None = None,
                 compression: dict | None = None) -> "TurnResult":
        r = RequestOutput.from_seq(seq)
        return cls(turn, r.text, r.token_ids, r.prompt_token_ids, r.prompt_tokens, r.cached_tokens,
                   r.completion_tokens, r.ttft_s, r.decode_tok_per_s, r.finish_reason, context, compression)

    def to_dict(self) -> dict:
        return asdict(self)
