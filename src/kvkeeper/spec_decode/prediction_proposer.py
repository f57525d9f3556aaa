"""Predicted Outputs (OpenAI's ``prediction``): drafts from the text the client expects back, a pointer following
the output through it and re-synchronising after a divergence (see the package docstring)."""

from __future__ import annotations

from ..engine.sequence import Sequence
from .metrics import SpecState


def from_prediction(seq: Sequence, st: SpecState, room: int) -> list[int]:
    """Up to ``room`` tokens of ``st``'s prediction after ``seq``'s output's end (the pointer following the output
    through it, re-synchronised on the first later occurrence of the output's last n-gram); ``[]`` when it has none
    or the pointer is lost."""
    if st.prediction is None:
        return []
    pred, out = st.prediction, seq.output_token_ids
    for i in range(st.pred_seen, len(out)):
        if st.pred_ptr is not None and st.pred_ptr < len(pred) and pred[st.pred_ptr] == out[i]:
            st.pred_ptr += 1
        else:  # diverged (or lost): the first later occurrence of the output's last n-gram
            start = st.pred_ptr or 0
            st.pred_ptr = st.pred_index.first_from(out[: i + 1], start)
            if st.pred_ptr is None:
                st.pred_ptr = st.pred_index.latest(out[: i + 1])
    st.pred_seen = len(out)
    if st.pred_ptr is None:
        return []
    return pred[st.pred_ptr: st.pred_ptr + room]
