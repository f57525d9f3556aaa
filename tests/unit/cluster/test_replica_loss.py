"""Losing a replica remaps only its sessions: the consistent-hash ring of the session rule, in the text-hash policy
and in the token-exact router alike."""

from __future__ import annotations

from kvkeeper.cluster.exact_router import ExactRouter
from kvkeeper.cluster.kv_index import KVIndex
from kvkeeper.cluster.router import Candidate, Policy


def test_only_the_lost_replicas_sessions_move():
    names = [f"r{i}" for i in range(16)]
    sessions = [f"conv-{i}" for i in range(2000)]
    policy, exact = Policy(), ExactRouter(KVIndex(), "0" * 16, 16)
    for route in (lambda ids, s: policy.choose([Candidate(n) for n in ids], session_id=s).ranks[0][0],
                  lambda ids, s: exact.choose(ids, {}, session_id=s).ranks[0][0]):
        before = {s: route(names, s) for s in sessions}
        lost = "r7"
        after = {s: route([n for n in names if n != lost], s) for s in sessions}
        moved = {s for s in sessions if before[s] != after[s]}
        assert moved == {s for s in sessions if before[s] == lost}
        assert len(moved) > 0 and lost not in after.values()
