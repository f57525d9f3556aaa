"""JSON grammars that always end (issue 31, item 3): every JSON door compiles a schema the same way, and what a
schema leaves unbounded (numbers, strings, values of any type) is bounded, so a model looping on digits stops."""

from __future__ import annotations

import json

import pytest

from kvkeeper import SamplingParams
from kvkeeper.sampling.structured import GrammarCompiler, StructuredOutput

PLAIN = "The weather today is"


def _doors(schema: dict) -> list[StructuredOutput]:
    """The constraint each JSON door of the API makes of ``schema`` (api.common.protocol.structured_output)."""
    from kvkeeper.api.common.protocol import structured_output
    from kvkeeper.api.completions.protocol import CompletionRequest

    bodies = [{"guided_json": schema}, {"guided_json": json.dumps(schema)}, {"structured_outputs": {"json": schema}},
              {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}]
    return [structured_output(CompletionRequest(model="m", prompt="p", **b)) for b in bodies]


@pytest.mark.parametrize("schema", [{}, {"type": "number"}, {"type": "object", "properties": {"a": {}}}])
def test_every_json_door_compiles_the_same_grammar(schema):
    grammars = {GrammarCompiler.grammar(so) for so in _doors(schema)}
    assert len(grammars) == 1, grammars


def _accepts(engine, schema: dict, text: str) -> bool:
    m = engine.grammars.matcher(StructuredOutput("json_schema", schema, "guided_json"))
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    return m.validate_tokens(ids) == len(ids)


@pytest.mark.slow
def test_unbounded_json_is_bounded(engine):
    for schema in ({}, {"type": "number"}):
        assert _accepts(engine, schema, "-12.5") and _accepts(engine, schema, "123456789012345")
        assert not _accepts(engine, schema, "1" * 17)  # beyond 10^15
        assert not _accepts(engine, schema, "1.1234567")  # beyond 6 decimals
    assert _accepts(engine, {"type": "string"}, json.dumps("x" * 4096))
    assert not _accepts(engine, {"type": "string"}, json.dumps("x" * 4097))
    assert not _accepts(engine, {}, '{"a": [' + json.dumps("y" * 5000) + "]}")  # nested values of any type too
    assert _accepts(engine, {"type": "string", "maxLength": 9000}, json.dumps("x" * 5000))  # a schema's own bound
    assert _accepts(engine, {"type": "integer", "minimum": 0}, "1" * 20)  # a schema's own range is kept
    assert _accepts(engine, {"type": "number", "minimum": 0, "maximum": 1}, "0.12345678")


@pytest.mark.slow
@pytest.mark.parametrize("schema", [{}, {"type": "number"}])
def test_an_anything_schema_on_a_plain_prompt_ends(engine, schema):
    so = StructuredOutput("json_schema", schema, "guided_json")
    out = engine.generate([PLAIN], SamplingParams(max_tokens=48, temperature=0, structured=so))[0]
    assert out.finish_reason == "stop", (out.text, out.finish_reason)
    json.loads(out.text)


@pytest.mark.slow
def test_a_document_cut_by_max_tokens_finishes_with_length(engine):
    so = StructuredOutput("json_schema", {"type": "object", "properties": {"story": {"type": "string"}},
                                          "required": ["story"]}, "guided_json")
    out = engine.generate([PLAIN], SamplingParams(max_tokens=4, temperature=0, structured=so))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    with pytest.raises(ValueError):
        json.loads(out.text)
