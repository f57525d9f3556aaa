"""``--replicas N --kv-events-config``: each replica's own endpoint pair (port + 2 x rank, ipc path + rank), the
advertised address of a wildcard bind, and the configurations whose replicas could not all bind refused naming
the field (on the command line too, before Ray or a model starts)."""

from __future__ import annotations


import pytest

from kvkeeper.cluster.replica_events import advertised, check_cluster_events, replica_config
from kvkeeper.kvcache.kv_events.publisher import parse_kv_events_config
from kvkeeper.errors import InvalidRequestError


def cfg(**fields):
    return parse_kv_events_config({"enable_kv_cache_events": True, **fields})


def test_each_replica_binds_its_own_pair():
    c = cfg(endpoint="tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5558", topic="kv")
    check_cluster_events(c, 8)
    pairs = [(replica_config(c, r).endpoint, replica_config(c, r).replay_endpoint) for r in range(8)]
    ports = [int(e.rsplit(":", 1)[1]) for pair in pairs for e in pair]
    assert len(set(ports)) == 16  # no two replicas (nor a PUB and a replay socket) on one port
    assert pairs[0] == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    assert pairs[3] == ("tcp://127.0.0.1:5563", "tcp://127.0.0.1:5564")
    assert replica_config(c, 3).topic == "kv" and replica_config(c, 3).buffer_steps == c.buffer_steps
    free = cfg(endpoint="tcp://*:0")
    assert replica_config(free, 5).endpoint == "tcp://*:0"  # the system's free ports
    assert replica_config(cfg(endpoint="ipc:///tmp/kv"), 2).endpoint == "ipc:///tmp/kv-2"
    assert advertised("tcp://0.0.0.0:5559", "10.1.2.3") == "tcp://10.1.2.3:5559"
    assert advertised("tcp://127.0.0.1:5559", "10.1.2.3") == "tcp://127.0.0.1:5559"
    assert advertised(None, "10.1.2.3") is None


@pytest.mark.parametrize("fields, n, words", [
    ({"endpoint": "inproc://kv"}, 2, "endpoint must be tcp://HOST:PORT or ipc://PATH"),
    ({"endpoint": "tcp://127.0.0.1"}, 2, "endpoint must be tcp://HOST:PORT"),
    ({"endpoint": "tcp://127.0.0.1:65534"}, 2, "endpoint port 65534: replica 1 of 2 would bind port 65536"),
    ({"endpoint": "tcp://h:5557", "replay_endpoint": "tcp://h:5559"}, 2, "replay_endpoint port 5559"),
    ({"endpoint": "tcp://h:5561", "replay_endpoint": "tcp://h:5557"}, 3, "give it port 5562"),
])
def test_a_config_the_replicas_cannot_all_bind_is_refused(fields, n, words):
    with pytest.raises(InvalidRequestError) as e:
        check_cluster_events(cfg(**fields), n)
    assert words in str(e.value) and e.value.param == "kv_events_config"


def test_off_or_well_spread_configs_pass():
    check_cluster_events(parse_kv_events_config({"enable_kv_cache_events": False, "endpoint": "inproc://x"}), 4)
    check_cluster_events(cfg(endpoint="tcp://h:5557", replay_endpoint="tcp://h:5565"), 4)
    check_cluster_events(cfg(endpoint="tcp://h:5557", replay_endpoint="tcp://h:6000"), 4)  # odd distance
