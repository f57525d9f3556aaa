"""Input processing: from a request's prompt and parameters to a checked :class:`Sequence`.

As vLLM's input processor: render a conversation with the model's chat template, tokenize a prompt, check
it once (non-empty, token ids inside the vocabulary, room left in the context window), check the sampling
parameters against the model (token ids of ``logit_bias`` / ``stop_token_ids``, KV compression for the
model's family) and build the request's logits processors (bad words, logit bias, grammar).  Every check
raises :class:`~kvkeeper.errors.InvalidRequestError` naming the field (or
:class:`~kvkeeper.errors.ContextLengthError`), which the server turns into a 400.
"""

from __future__ import annotations

import threading

from ..errors import ContextLengthError, InvalidRequestError
from ..kvcache.compression import KVCompression
from ..kvcache.namespace import Namespace
from ..model_config import ModelConfig
from ..models.registry import capabilities
from ..sampling.params import SamplingParams
from ..sampling.processors import build_processors
from ..sampling.sampler import make_generator
from ..sampling.structured import GrammarCompiler, GrammarMask
from ..text.chat_tokens import ChatEncoder, RenderedChat, longest_token_bytes, render_with_spans
from ..text.tool_format import prepare_messages, template_has_tools, template_reads_names
from .adapters import AdapterRegistry
from .sequence import Sequence


class ChatRenderer:
    """Renders conversations with a model's chat template and tokenizes them: the part of :class:`InputProcessor`
    that needs the tokenizer alone (a cluster's gateway tokenizes prompts with it to route them,
    :mod:`kvkeeper.cluster.gateway_tokens`, without loading the weights).

    tokenizer: the model's (a transformers tokenizer); control_tokens_in_content: as :class:`InputProcessor`'s.
    Thread-safe.
    """

    def __init__(self, tokenizer, control_tokens_in_content: bool = False):
        self.tokenizer = tokenizer
        self.control_tokens_in_content = control_tokens_in_content
        self._chat_encoder: ChatEncoder | None = None
        self._encoder_lock = threading.Lock()

    # ---- chat rendering ---------------------------------------------------------
    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **chat) -> list[int]:
        """Token ids of a conversation as the model's chat template renders it, control tokens only from the
        template (unless ``control_tokens_in_content``; see :meth:`encode_rendered`).  ``chat``: the other keyword
        arguments of :meth:`render_chat`."""
        if not messages:
            raise InvalidRequestError("the conversation is empty: give at least one message")
        return self.encode_rendered(self.render_prompt(messages, add_generation_prompt, **chat))

    def encode_rendered(self, rendered: RenderedChat, start: int = 0) -> list[int]:
        """Token ids of ``rendered.text[start:]``: exactly the tokenizer's for a conversation whose contents hold
        no control token's text; such text tokenized as plain text (:class:`~kvkeeper.text.chat_tokens.ChatEncoder`)
        unless ``control_tokens_in_content``.  Raises :class:`InvalidRequestError` when the template hides where
        a content holding a control token's text went."""
        enc = self.chat_encoder
        if enc is None:
            return self.tokenizer.encode(rendered.text[start:], add_special_tokens=False)
        return enc.encode(rendered, start)

    @property
    def chat_encoder(self) -> ChatEncoder | None:
        """The encoder that keeps contents' control-token text plain (None: ``control_tokens_in_content``, or a
        tokenizer without a ``tokenizers`` backend); built on first use."""
        if self.control_tokens_in_content:
            return None
        with self._encoder_lock:
            if self._chat_encoder is None:
                self._chat_encoder = ChatEncoder.of(self.tokenizer) or False
        return self._chat_encoder or None

    def render_prompt(self, messages: list[dict], add_generation_prompt: bool = True, **chat) -> RenderedChat:
        """:meth:`render_chat`'s text with the spans of the messages' contents in it (for :meth:`encode_rendered`)."""
        msgs, extra = self._template_input(messages, add_generation_prompt, **chat)
        render = lambda ms: self._apply_template(ms, add_generation_prompt, extra)  # noqa: E731
        if self.chat_encoder is None:
            return RenderedChat(render(msgs))
        return render_with_spans(render, msgs)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: list[dict] | None = None) -> str:
        """The chat template's text of ``messages`` (dicts with ``role`` and ``content``; an assistant's
        may carry OpenAI ``tool_calls``, a ``tool`` message answers them).

        continue_final_message: end the text inside the last message (no end-of-turn marker after it),
        for the model to continue it (transformers' and vLLM's option; not with add_generation_prompt).
        tools: OpenAI tool definitions, rendered as the template does or, when it has no tool syntax,
        in the documented system-prompt format (:mod:`kvkeeper.text.tool_format`).
        Raises :class:`InvalidRequestError` for a malformed message or one the template rejects.
        """
        msgs, extra = self._template_input(messages, add_generation_prompt, continue_final_message, tools)
        return self._apply_template(msgs, add_generation_prompt, extra)

    def _template_input(self, messages: list[dict], add_generation_prompt: bool, continue_final_message: bool = False,
                        tools: list[dict] | None = None) -> tuple[list[dict], dict]:
        """The checked messages and keyword arguments ``apply_chat_template`` gets (see :meth:`render_chat`)."""
        template = self.tokenizer.chat_template
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InvalidRequestError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
            if m.get("name") is not None and not template_reads_names(template):
                raise InvalidRequestError(f"messages[{i}].name: the model's chat template has no participant "
                                          "names; put the name in the content", param=f"messages.{i}.name")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message continues the last message: it needs "
                                      "add_generation_prompt=false", param="continue_final_message")
        msgs, extra = prepare_messages(messages, tools, template_has_tools(template))
        if continue_final_message:
            extra["continue_final_message"] = True
        return msgs, extra

    def _apply_template(self, msgs: list[dict], add_generation_prompt: bool, extra: dict) -> str:
        try:
            return self.tokenizer.apply_chat_template(msgs, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **extra)
        except Exception as e:  # jinja2.TemplateError: the template rejects this conversation (raise_exception)
            if type(e).__module__.startswith("jinja2"):
                raise InvalidRequestError(f"the model's chat template rejected the conversation: {e}") from e
            if extra.get("continue_final_message") and isinstance(e, ValueError):  # no final message text
                raise InvalidRequestError(f"continue_final_message: {e}", param="continue_final_message") from e
            raise


class InputProcessor(ChatRenderer):
    """Renders, tokenizes and checks requests for one model.

    tokenizer: the model's (a transformers tokenizer); model_config: its shapes; context_length: tokens a
    sequence may hold (prompt plus output); adapters: the engine's LoRA registry; control_tokens_in_content: a
    message's text may write control tokens (``<|im_end|>`` typed by a client ends its turn, as with
    transformers' ``apply_chat_template``; default: such text is plain text, :mod:`kvkeeper.text.chat_tokens`).
    Rendering and tokenizing are thread-safe (the server runs them in worker threads).  ``eos_token_ids``: the
    model's end-of-sequence token ids (its config's and its tokenizer's); ``grammars``: the structured
    output compiler.
    """

    def __init__(self, tokenizer, model_config: ModelConfig, context_length: int, adapters: AdapterRegistry,
                 control_tokens_in_content: bool = False):
        super().__init__(tokenizer, control_tokens_in_content)
        self._max_token_bytes: int | None = None
        self.model_config = model_config
        self.context_length = context_length
        self.adapters = adapters
        self.capabilities = capabilities(model_config)
        eos, tok_eos = set(model_config.eos_token_ids), tokenizer.eos_token_id
        if tok_eos is not None:
            eos.add(int(tok_eos))
        self.eos_token_ids = eos
        eos_id = tok_eos if tok_eos is not None else min(eos, default=None)
        self.grammars = GrammarCompiler(tokenizer, model_config.vocab_size, None if eos_id is None else int(eos_id))

    # ---- prompts ----------------------------------------------------------------
    def chat_prompt_ids(self, messages: list[dict], params: SamplingParams, chat: dict | None = None) -> list[int]:
        """The checked token ids of a conversation (:meth:`encode_chat`, then :meth:`prompt_ids` with the server's
        strict ``max_tokens``); a rendering whose byte length alone proves it longer than the context window is
        refused before it is tokenized (:meth:`check_bytes`).  Thread-safe: the server calls it in worker threads.
        Raises :class:`InvalidRequestError`, :class:`ContextLengthError`."""
        if not messages:
            raise InvalidRequestError("the conversation is empty: give at least one message")
        rendered = self.render_prompt(messages, **(chat or {}))
        self.check_bytes(rendered.text)
        return self.prompt_ids(self.encode_rendered(rendered), params, strict_max_tokens=True)

    def text_prompt_ids(self, prompt: str, params: SamplingParams) -> list[int]:
        """:meth:`prompt_ids` of a text prompt with the server's strict ``max_tokens``, refused by
        :meth:`check_bytes` before tokenizing when too long.  Thread-safe, as :meth:`chat_prompt_ids`."""
        self.check_bytes(prompt)
        return self.prompt_ids(prompt, params, strict_max_tokens=True)

    def check_bytes(self, text: str) -> None:
        """Raise :class:`ContextLengthError` when ``text`` cannot fit the context window whatever its tokens: its
        UTF-8 bytes over the vocabulary's longest token (:attr:`max_token_bytes`) are the fewest tokens it can be."""
        if len(text) < self.context_length:  # a character is at least a byte: nothing to prove
            return
        n = len(text.encode("utf-8", "surrogatepass"))
        fewest = -(-n // self.max_token_bytes)
        if fewest >= self.context_length:
            raise ContextLengthError(fewest, self.context_length, prompt_bytes=n)

    @property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of text one token can stand for (the vocabulary's longest token, special tokens by
        their text; computed once).  A tokenizer whose normalizer may shorten the text (or a slow one) gets a bound
        that proves nothing (the context window in bytes per token), so :meth:`check_bytes` never refuses for it."""
        if self._max_token_bytes is None:
            self._max_token_bytes = longest_token_bytes(self.tokenizer) or 4 * self.context_length
        return self._max_token_bytes

    def prompt_ids(self, prompt: str | list[int], params: SamplingParams, strict_max_tokens: bool = False) -> list[int]:
        """The checked token ids of a text or token-id prompt.  Raises :class:`InvalidRequestError` for an
        empty prompt or a token id outside the vocabulary, :class:`ContextLengthError` when the prompt
        leaves no room for a token (or, with ``strict_max_tokens``, when ``params.max_tokens`` alone is at least the
        context window: no prompt leaves room for it; one that fits the window but not the room this prompt leaves
        is cut to that room by :meth:`sequence`, as llama.cpp's server does)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty: give at least one token of text")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt) if all(type(t) is int for t in prompt) else [int(t) for t in prompt]
        if not ids:
            raise InvalidRequestError("the prompt is empty: give at least one token", param="prompt")
        vocab = self.model_config.vocab_size
        if not 0 <= min(ids) <= max(ids) < vocab:  # (C loops: a long prompt holds the GIL for less time)
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt")
        ctx = self.context_length
        if len(ids) >= ctx:
            raise ContextLengthError(len(ids), ctx)
        if strict_max_tokens and params.max_tokens is not None and params.max_tokens >= ctx:
            raise ContextLengthError(len(ids), ctx, params.max_tokens)
        return ids

    def sequence(self, request_id: str, ids: list[int], params: SamplingParams, namespace: Namespace,
                 compression: KVCompression | None = None, lora: str | None = None,
                 max_new_tokens: int | None = None) -> Sequence:
        """A new :class:`Sequence` of checked prompt ids (:meth:`prompt_ids`) with its adapter, output cap,
        generator and logits processors.

        compression: drop prompt tokens from the KV at the end of prefill (:mod:`kvkeeper.kvcache.compression`;
        None keeps everything).  lora: a loaded adapter's name (a namespace whose ``adapter`` is a loaded
        adapter's id selects it too).  max_new_tokens: an operator's cap on generated tokens (the context
        window caps them too).  Raises :class:`InvalidRequestError` for KV compression on a family without it
        (``capabilities.kv_compression``), an adapter that is not loaded, and the errors of :meth:`processors`.
        """
        caps = self.capabilities
        if compression is not None and not caps.kv_compression:
            raise InvalidRequestError(f"KV compression is not supported for {caps.refusal('kv_compression')}; "
                                      "send the request without compression")
        namespace, adapter = self.adapters.resolve(namespace, lora)
        seq = Sequence(request_id, ids, params, namespace)
        seq.lora = adapter
        seq.compression = compression
        new = min(x for x in (self.context_length - len(ids), params.max_tokens, max_new_tokens) if x is not None)
        seq.max_total_tokens = len(ids) + new
        seq.generator = make_generator(params)
        seq.processors = self.processors(params, ids)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * len(ids)
        return seq

    def prediction_ids(self, params: SamplingParams) -> list[int] | None:
        """The token ids of a request's prediction (OpenAI's Predicted Outputs; its text tokenized without special
        tokens), at most a context window of them; None without one.  Raises :class:`InvalidRequestError` for a token
        id outside the vocabulary."""
        pred = params.prediction
        if not pred:
            return None
        ids = self.tokenizer.encode(pred, add_special_tokens=False) if isinstance(pred, str) else list(pred)
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prediction: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                                      param="prediction")
        return ids[: self.context_length]

    # ---- logits processors ------------------------------------------------------
    def processors(self, params: SamplingParams, prompt_ids: list[int]):
        """The request's logits processors (None without any); checks token ids against the vocabulary.

        Raises :class:`InvalidRequestError` naming the field for a token id outside the vocabulary and
        for a grammar that cannot be compiled.
        """
        vocab = self.model_config.vocab_size
        for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"{name}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                                          param=name)
        words = [self.word_ids(w) for w in params.bad_words]
        grammar = None
        if params.structured is not None:
            matcher = self.grammars.matcher(params.structured)  # compiled now: errors reach the caller
            grammar = lambda: GrammarMask(matcher, self.grammars.eos_token_id)  # noqa: E731
        return build_processors(params, prompt_ids, vocab, [w for ws in words for w in ws], grammar, self.eos_token_ids)

    def word_ids(self, word: str) -> list[list[int]]:
        """vLLM's spellings of a bad word: its tokens alone and after a space (when they differ)."""
        tok = self.tokenizer
        alone = tok.encode(word.strip(), add_special_tokens=False)
        spaced = tok.encode(" " + word.strip(), add_special_tokens=False)
        return [alone] if spaced == alone else [alone, spaced]
