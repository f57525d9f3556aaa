"""Structured outputs: a grammar the generated text must follow, applied as a token mask.

Grammars are compiled and matched by **llguidance** (Microsoft's guidance engine: a Rust
Earley parser with a derivative-based lexer, https://github.com/guidance-ai/llguidance).
A :class:`StructuredOutput` names what the request asked for; :class:`GrammarCompiler`
turns it into a matcher for the engine's tokenizer (one per request), and
:class:`GrammarMask` is the logits processor that masks every token the grammar does not
allow next (its state advances with each accepted token).  When the grammar is complete
only EOS is allowed, so a constrained output always ends with a finished document.

Kinds: ``json_schema`` (a JSON schema dict), ``json_object`` (any JSON object), ``regex``,
``choice`` (one of a list of strings), ``grammar`` (a GBNF grammar as llama.cpp writes them, or
Lark) and ``lark`` (llguidance's Lark dialect as is: ``%json``, lazy lexemes).  JSON is generated compactly with Python's separators (``", "`` and ``": "``, no
other whitespace), so ``json.dumps(json.loads(text)) == text`` for ASCII output.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidRequestError

log = logging.getLogger(__name__)

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "lark")
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match.

    kind: one of :data:`KINDS`; spec: the JSON schema (dict), regex (str), choices (list of str) or
    grammar (str); None for json_object.  param: the request field it came from (named in errors).
    """

    kind: str
    spec: Any = None
    param: str = "response_format"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidRequestError(f"unknown structured output kind {self.kind!r}; one of {', '.join(KINDS)}",
                                      param=self.param)


# Bounds of what a JSON schema leaves unbounded (bounded_schema): a model looping on digits or characters ends there.
MAX_STRING_CHARS = 4096  # a string without maxLength, enum, const or format
MAX_NUMBER = 10**15  # |x| of a number or integer without minimum / maximum (16 digits at most)
NUMBER_STEP = 1e-6  # a number without multipleOf: at most 6 decimals, no exponent
ANY_NAME = "kvkeeper_any"  # the $defs entry of a bounded "any JSON value"
_ANY_REF = f"#/$defs/{ANY_NAME}"
_CONSTRAINING = {"type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf", "not", "properties", "items", "prefixItems",
                 "additionalProperties", "patternProperties", "required", "pattern", "format", "minLength", "maxLength",
                 "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minItems", "maxItems"}
_SUB_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SUB_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions")


def _bounded_any() -> dict:
    """Any JSON value, with the bounds of :func:`bounded_schema` (arrays and objects hold bounded values)."""
    return {"anyOf": [{"type": "null"}, {"type": "boolean"}, _bound({"type": "number"}), _bound({"type": "string"}),
                      {"type": "array", "items": {"$ref": _ANY_REF}},
                      {"type": "object", "additionalProperties": {"$ref": _ANY_REF}}]}


def _bound(node):
    """One schema node bounded in place (see :func:`bounded_schema`); returns it (or its replacement)."""
    if node is True or (isinstance(node, dict) and not _CONSTRAINING & set(node)):
        return {**(node if isinstance(node, dict) else {}), "$ref": _ANY_REF}  # any value
    if not isinstance(node, dict) or "enum" in node or "const" in node:
        return node
    types = node.get("type", [])
    types = set([types] if isinstance(types, str) else types)
    if "string" in types and not {"maxLength", "format"} & set(node):
        node["maxLength"] = MAX_STRING_CHARS
    if types & {"number", "integer"} and not {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum",
                                              "multipleOf"} & set(node):  # a schema's own range is kept as it is
        node["minimum"], node["maximum"] = -MAX_NUMBER, MAX_NUMBER
        if "number" in types:
            node["multipleOf"] = NUMBER_STEP
    if "array" in types and "items" not in node and "prefixItems" not in node:
        node["items"] = True
    if "object" in types and "additionalProperties" not in node:
        node["additionalProperties"] = True
    for k in _SUB_ONE:
        if k in node:
            node[k] = _bound(node[k])
    for k in _SUB_LIST:
        if isinstance(node.get(k), list):
            node[k] = [_bound(x) for x in node[k]]
    for k in _SUB_MAP:
        if isinstance(node.get(k), dict):
            node[k] = {name: _bound(x) for name, x in node[k].items()}
    return node


def bounded_schema(schema: dict) -> dict:
    """A copy of the JSON schema ``schema`` in which nothing lets a model generate forever: a string without
    ``maxLength`` / ``enum`` / ``const`` / ``format`` gets ``maxLength`` :data:`MAX_STRING_CHARS`; a number or
    integer with none of ``minimum``, ``maximum`` (exclusive or not) and ``multipleOf`` gets ``minimum`` /
    ``maximum`` of -/+ :data:`MAX_NUMBER`, and a number :data:`NUMBER_STEP` (at most 6 decimals, no exponent:
    llguidance's number lexeme is otherwise unbounded; a schema's own range is left alone, as llguidance cannot
    intersect every range with a step); a value of any type (``{}``, ``true``, an array's missing ``items``, an object's missing
    ``additionalProperties``) is any value within those bounds (``$defs/kvkeeper_any``).  Whitespace needs no bound:
    :data:`JSON_FORMAT` allows none but the separators.  Object keys stay unbounded (llguidance has no
    ``propertyNames``)."""
    out = _bound(copy.deepcopy(schema))
    if json.dumps(out).find(_ANY_REF) >= 0:
        defs = out.setdefault("$defs", {})
        if isinstance(defs, dict):
            defs[ANY_NAME] = _bounded_any()
    return out


def json_schema_grammar(schema: dict) -> str:
    """The llguidance grammar of a JSON schema, :func:`bounded <bounded_schema>`, compact with Python's separators
    (see the module doc): the one compilation path of every JSON door (``response_format``, ``guided_json``,
    ``structured_outputs.json``, ``json_object``)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(bounded_schema(schema), overrides=dict(JSON_FORMAT))


def with_json_format(schema: dict) -> dict:
    """``schema`` :func:`bounded <bounded_schema>`, with llguidance's ``x-guidance`` JSON options set to
    :data:`JSON_FORMAT` (for ``%json`` in Lark)."""
    out = bounded_schema(schema)
    out["x-guidance"] = dict(JSON_FORMAT)
    return out


_COMPILED_KEPT = 64  # compiled grammars kept for reuse (each a few KB to MB)


class GrammarCompiler:
    """Compiles :class:`StructuredOutput` specs into llguidance matchers for one tokenizer.

    tokenizer: a transformers fast tokenizer; vocab_size: the width of the model's logits (tokens);
    eos_token_id: the token that ends a finished grammar (None: the model has none, and every grammar is
    refused).  The llguidance tokenizer is built on first use (about 0.2 s for a 49k vocabulary).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._lltok = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # grammar text -> a pristine matcher (LRU)
        self._lock = threading.Lock()  # the server compiles in worker threads, the engine thread reuses

    def _lltokenizer(self):
        import llguidance

        if self._lltok is None:
            backend = copy.copy(self.tokenizer.backend_tokenizer)
            backend.no_padding()
            backend.no_truncation()
            self._lltok = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                                 eos_token=self.eos_token_id)
        return self._lltok

    @staticmethod
    def grammar(so: StructuredOutput) -> str:
        """The llguidance grammar text of a spec (not yet checked)."""
        import llguidance

        if so.kind == "json_schema":
            return json_schema_grammar(so.spec)
        if so.kind == "json_object":
            return json_schema_grammar({"type": "object"})
        if so.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(so.spec)
        if so.kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.spec))
        if so.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(so.spec)
        return llguidance.grammar_from("grammar", so.spec)

    def matcher(self, so: StructuredOutput):
        """A fresh ``llguidance.LLMatcher`` for ``so``; raises :class:`InvalidRequestError` (``param``:
        the request field) when the grammar is invalid or uses what llguidance does not implement."""
        import llguidance

        if so.kind == "choice" and (not so.spec or not all(isinstance(c, str) and c for c in so.spec)):
            raise InvalidRequestError("a choice needs a non-empty list of non-empty strings", param=so.param)
        if self.eos_token_id is None:
            raise InvalidRequestError(f"{so.param}: structured outputs need a model with an end-of-sequence token, "
                                      "which this model lacks", param=so.param)
        try:
            with self._lock:
                lltok = self._lltokenizer()
        except AttributeError:  # not a fast (Rust) tokenizer
            raise InvalidRequestError(f"{so.param}: structured outputs need a fast (tokenizers) tokenizer, which "
                                      "this model lacks", param=so.param) from None
        try:  # whatever fails while compiling a client's grammar is the client's input
            grammar = self.grammar(so)
            with self._lock:
                kept = self._compiled.get(grammar)  # the same grammar again: a request's choices, a client's schema
                if kept is not None:
                    self._compiled.move_to_end(grammar)
                    return kept.deep_copy()
            err = llguidance.LLMatcher.validate_grammar(grammar, lltok)
        except Exception as e:  # noqa: BLE001 - ValueError mostly; llguidance's converters raise others too
            raise InvalidRequestError(f"{so.param}: invalid grammar: {e}", param=so.param) from None
        if err:
            raise InvalidRequestError(f"{so.param}: the grammar cannot be used: {err.strip()}", param=so.param)
        m = llguidance.LLMatcher(lltok, grammar, log_level=0)
        if m.is_error():
            raise InvalidRequestError(f"{so.param}: the grammar cannot be used: {m.get_error()}", param=so.param)
        with self._lock:
            self._compiled[grammar] = m
            while len(self._compiled) > _COMPILED_KEPT:
                self._compiled.popitem(last=False)
            return m.deep_copy()


_BITS = torch.arange(32, dtype=torch.int32)


class GrammarMask:
    """The token mask of one request's grammar (a logits processor, see :mod:`kvkeeper.sampling.processors`).

    matcher: an ``llguidance.LLMatcher``; eos_token_id: allowed alone once the grammar has stopped (or
    failed: then a warning is logged and the output ends).  Tokens beyond the tokenizer are never allowed.
    """

    def __init__(self, matcher, eos_token_id: int):
        self.matcher = matcher
        self.eos_token_id = eos_token_id
        self.failed = False

    def accept(self, token: int) -> None:
        m = self.matcher
        if self.failed or m.is_stopped():
            return
        if not m.consume_token(token):
            self.failed = True
            log.warning("grammar refused token %d: %s; ending the output", token, m.get_error())

    def _fill(self, row: torch.Tensor) -> None:
        """Write the allowed-token bitmask (int32 words, bit j of word w = token 32 w + j) into ``row``."""
        if self.failed or self.matcher.is_stopped():
            row.zero_()
            bit = 1 << (self.eos_token_id % 32)
            row[self.eos_token_id // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 two's complement
            return
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    @classmethod
    def apply(cls, logits: torch.Tensor, procs: list["GrammarMask"]) -> None:
        """logits (k, V) float32 on the CPU, row i for ``procs[i]``: disallowed tokens set to -inf, in place."""
        k, vocab = logits.shape
        words = (vocab + 31) // 32
        mask = torch.empty((k, words), dtype=torch.int32)
        for i, p in enumerate(procs):
            p._fill(mask[i])
        allowed = ((mask.unsqueeze(-1) >> _BITS) & 1).reshape(k, words * 32)[:, :vocab].bool()
        logits.masked_fill_(~allowed, float("-inf"))
