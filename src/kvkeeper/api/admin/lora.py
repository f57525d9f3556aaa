"""LoRA adapters at run time: ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (vLLM's
endpoints and request bodies).

Loading reads a local directory the request names, so the endpoints answer 403 unless the server was
started with ``--allow-runtime-lora`` (vLLM gates them behind ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), and
with API keys they need an admin key (401 / 403 otherwise, :func:`kvkeeper.api.common.auth.admin_caller`).
The adapter is read and registered on the engine thread (between steps).  Requests then select it by
name in ``model``; see :mod:`kvkeeper.layers.lora` for the file format and the KV namespace.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from ...errors import KVKeeperError
from ..common.errors import APIError

router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body: ``lora_name``, ``lora_path`` (a PEFT adapter directory on the server), ``load_inplace``
    (replace an adapter of that name: its KV is not reused, its content hash differs)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body: ``lora_name`` (``lora_int_id`` is accepted and ignored: adapters are known by name here)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str
    lora_int_id: int | None = None


def _check_allowed(request: Request) -> None:
    if not getattr(request.app.state, "allow_runtime_lora", False):
        raise APIError(403, "loading and unloading LoRA adapters at run time is off: start the server with "
                            "--allow-runtime-lora (or give adapters at start with --lora-modules NAME=PATH)",
                       type="permission_error")


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request):
    """200 with a plain-text confirmation; 400 for a name in use (without ``load_inplace``), the base
    model's name, or an adapter that cannot be read or does not fit the model; 403 when not allowed."""
    _check_allowed(request)
    try:
        await request.app.state.engine.call(lambda eng: eng.load_lora(body.lora_name, body.lora_path,
                                                                      replace=body.load_inplace))
    except KVKeeperError as e:
        raise APIError(400, str(e), param=getattr(e, "param", None)) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request):
    """200 with a plain-text confirmation; 404 naming an adapter that is not loaded; 403 when not allowed."""
    _check_allowed(request)
    try:
        await request.app.state.engine.call(lambda eng: eng.unload_lora(body.lora_name))
    except KVKeeperError as e:
        raise APIError(404, str(e), type="not_found_error", param="lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
