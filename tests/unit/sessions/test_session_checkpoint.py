"""Session checkpoints on a shared data directory (SessionConfig.checkpoint_every_s): two engines, as two
replicas of ``kvkeeper serve --replicas``, hand a session back and forth and continue it exactly."""

from __future__ import annotations

import pytest

from kvkeeper import SamplingParams
from kvkeeper.errors import InvalidRequestError
from kvkeeper.sessions import SessionManager
from kvkeeper.sessions.disk import MANIFEST
from tests.utils.engines import make_engine

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=6, temperature=0)
SYSTEM = "You are terse."
TURNS = ["Name three colours.", "And three animals?", "Which of them is the largest?", "Why?"]


@pytest.fixture(scope="module")
def engines():
    return make_engine(num_kv_blocks=128), make_engine(num_kv_blocks=128)


def test_a_session_moves_between_managers_through_its_checkpoint(engines, tmp_path):
    a_eng, b_eng = engines
    a = SessionManager(a_eng, data_dir=tmp_path, checkpoint_every_s=1.0)
    b = SessionManager(b_eng, data_dir=tmp_path, checkpoint_every_s=1.0)
    ref_session = a.open(session_id="ref", system=SYSTEM)
    reference = [ref_session.send(t, GREEDY) for t in TURNS]
    a.close("ref")
    assert not (tmp_path / "sessions" / "ref").exists()  # closing removes the checkpoint too

    s = a.open(session_id="x", system=SYSTEM)
    got = [s.send(t, GREEDY) for t in TURNS[:2]]
    assert a.checkpoint_idle() == 1 and a.checkpoint_idle() == 0  # written once, until the session changes
    assert s.tier == "pool" and (tmp_path / "sessions" / "x" / MANIFEST).exists()

    assert b.refresh_from_disk("x")  # b does not hold it: it takes the checkpoint
    third = b.get("x").send(TURNS[2], GREEDY)
    assert third.cached_tokens == got[-1].prompt_tokens + got[-1].completion_tokens - 1  # restored, not recomputed
    assert (tmp_path / "sessions" / "x" / MANIFEST).exists()  # the copy stays for the next replica
    assert b.checkpoint_idle() == 1

    assert a.refresh_from_disk("x")  # a's own copy is older (2 turns against 3): replaced
    assert not b.refresh_from_disk("x")  # b's is current
    fourth = a.get("x").send(TURNS[3], GREEDY)
    assert [r.text for r in got + [third, fourth]] == [r.text for r in reference]
    assert fourth.cached_tokens == third.prompt_tokens + third.completion_tokens - 1
    assert a.store.stats()["checkpoint_total"] == 1

    with pytest.raises(InvalidRequestError):
        SessionManager(a_eng, checkpoint_every_s=1.0)  # no data dir
