"""Conversation context budgets: dropping the oldest turns of a conversation to fit a token budget.

A *turn* is one user message and the messages that follow it up to the next user
message (the assistant's reply, tool messages).  System and developer messages at
the head are always kept, and so is the last turn (the one being answered).
Trimming never edits the caller's list: it returns a shorter copy, so it can be
undone by rendering the full list again.
"""

from __future__ import annotations

from typing import Callable

_HEAD_ROLES = ("system", "developer")


def split_turns(messages: list[dict]) -> tuple[list[dict], list[list[dict]]]:
    """(head messages, turns): the leading system/developer messages, then each turn's messages."""
    i = 0
    while i < len(messages) and messages[i].get("role") in _HEAD_ROLES:
        i += 1
    head, turns = list(messages[:i]), []
    for m in messages[i:]:
        if m.get("role") == "user" or not turns:
            turns.append([m])
        else:
            turns[-1].append(m)
    return head, turns


def trim_oldest_turns(messages: list[dict], count_tokens: Callable[[list[dict]], int],
                      budget_tokens: int) -> tuple[list[dict], int]:
    """Drop the oldest turns until ``count_tokens(messages) <= budget_tokens`` (tokens).

    Returns (the kept messages, the number of turns dropped).  Keeps the head and the
    last turn even when they alone exceed the budget (the request then runs as it is).
    ``count_tokens`` renders and counts a message list (e.g. ``len(engine.encode_chat(m))``).
    """
    if budget_tokens < 0:
        raise ValueError(f"budget_tokens must be >= 0, got {budget_tokens}")
    head, turns = split_turns(messages)
    dropped = 0
    while len(turns) > 1 and count_tokens(head + [m for t in turns for m in t]) > budget_tokens:
        turns.pop(0)
        dropped += 1
    return head + [m for t in turns for m in t], dropped
