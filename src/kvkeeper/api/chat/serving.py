"""``POST /v1/chat/completions``: the body converted into the engine's request (:func:`chat_request`, every
rule checked once; the route and its rendering: :mod:`kvkeeper.api.chat.route`).

Extension fields (vLLM's where it has one): ``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``,
``bad_words``, ``ignore_eos``, ``cache_salt``, ``return_token_ids`` (prompt and output token ids in the
response), ``prompt_logprobs``, ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` /
``structured_outputs``, ``add_generation_prompt``, ``continue_final_message``, ``kv_compression``,
``context_policy`` / ``context_budget`` (a session's context policy, also as ``X-Context-Policy`` /
``X-Context-Budget``), ``session_compression`` / ``session_compression_ratio`` (a session's KV compressed at the
end of each turn and kept, :mod:`kvkeeper.sessions.compress`; also as ``X-Session-Compression`` /
``X-Session-Compression-Ratio``).
"""

from __future__ import annotations

from ..common.context import RequestContext
from ..common.errors import APIError
from ..common.messages import messages_of
from ..common.protocol import (check_body, generation_fields, output_constraint, prediction_text, sampling_params,
                               session_compression, structured_output)
from ..common.streams import GenerationRequest
from ..common.tools import ToolUse, tool_use_of
from .protocol import ChatCompletionRequest


def chat_request(body: ChatCompletionRequest, ctx: RequestContext, request_id: str
                 ) -> tuple[GenerationRequest, ToolUse | None]:
    """The engine's request for a chat body, and its tools (None without).  The engine checks the rest:
    the chat template's rules, ``continue_final_message`` with ``add_generation_prompt``, token ids in the
    vocabulary (an ``InvalidRequestError`` naming the field, a 400).  Raises APIError naming the field."""
    lora = check_body(body, ctx)
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if body.prompt_logprobs is not None and body.stream:
        raise APIError(400, "prompt_logprobs is not streamed on chat; send stream=false, or use /v1/completions",
                       param="prompt_logprobs")
    tools = tool_use_of(body)
    params = sampling_params(body, body.max_completion_tokens or body.max_tokens,
                             (body.top_logprobs or 0) if body.logprobs else None,
                             output_constraint(structured_output(body), tools),
                             body.prompt_logprobs, prediction_text(body))
    chat = dict(add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message,
                tools=tools.tools if tools is not None else None)
    policy = body.context_policy or ctx.context_policy  # the body wins over the headers
    budget = body.context_budget if body.context_budget is not None else ctx.context_budget
    context = None if policy is None and budget is None else (policy, budget)
    fields = generation_fields(body, ctx, lora)  # the session compression headers; the body fields win
    comp = body.session_compression or ctx.session_compression
    ratio = body.session_compression_ratio if body.session_compression_ratio is not None \
        else ctx.session_compression_ratio
    fields["session_compression"] = session_compression(comp, ratio)
    return GenerationRequest(request_id, params, messages=messages_of(body.messages), chat=chat, context=context,
                             **fields), tools
