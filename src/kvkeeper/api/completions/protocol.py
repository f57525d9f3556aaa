"""The request body of ``POST /v1/completions`` (pydantic v2; the fields it shares with chat, the refused and unknown
fields' rules: :mod:`kvkeeper.api.common.schemas`)."""

from __future__ import annotations

from pydantic import Field

from ..common.schemas import _only, _SamplingFields


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]  # a list of strings or of token-id lists: one per prompt
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = _only(None, "")
