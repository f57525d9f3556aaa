"""``--kv-events-config``: vLLM's field names, every wrong field or value refused with what was wrong and how to fix
it (from Python and from the command line), before any model loads."""

from __future__ import annotations


import pytest

from kvkeeper.engine.config import EngineConfig
from kvkeeper.kvcache.kv_events.publisher import KVEventsConfig, parse_kv_events_config
from kvkeeper.errors import InvalidRequestError


def test_vllm_fields_and_defaults():
    c = parse_kv_events_config('{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557", '
                               '"replay_endpoint": "tcp://127.0.0.1:5558", "topic": "kv", "buffer_steps": 50}')
    assert c.active and c.publisher == "zmq" and c.hwm == 100_000 and c.buffer_steps == 50 and not c.include_token_ids
    assert not KVEventsConfig().active and KVEventsConfig().publisher == "null"
    assert not parse_kv_events_config({"enable_kv_cache_events": True, "publisher": "null"}).active
    assert EngineConfig(kv_events_config={"enable_kv_cache_events": True}).kv_events_config.active


@pytest.mark.parametrize("raw, words", [
    ("[1]", "JSON object"),
    ("{", "JSON object"),
    ('{"enable_kv_cache_event": true}', "unknown field(s) enable_kv_cache_event; known fields: enable_kv_cache_events"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be true or false"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher must be one of zmq, null"),
    ('{"enable_kv_cache_events": true, "endpoint": "127.0.0.1:5557"}', "endpoint must be a ZMQ endpoint"),
    ('{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5557"}', "replay_endpoint must differ"),
    ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps must be a whole number >= 1"),
    ('{"enable_kv_cache_events": true, "topic": 3}', "topic must be a string"),
])
def test_bad_config_is_refused_naming_the_field(raw, words):
    with pytest.raises(InvalidRequestError, match="kv-events-config") as e:
        parse_kv_events_config(raw)
    assert words in str(e.value) and e.value.param == "kv_events_config"
