"""IsoExec's routes on vLLM's OpenAI server, added through vLLM's `--middleware` extension
point (`isoexec engine serve` passes it): the weight push and the gate status, authenticated
with the handshake token, so a served engine needs no dev-mode endpoint.

- `POST WEIGHTS_ROUTE`: body = safetensors bytes of HF-named tensors, header
  `FINGERPRINT_HEADER` = their fingerprint. The bytes go to a private temporary file on the
  server's node and every worker loads them with `isoexec_load_weights` (vLLM runs such calls
  between engine steps): each checks its MATCH and the fingerprint before touching a weight.
  Then the prefix cache is reset (its KV came from the old weights). Replies
  `{"fingerprints": [...]}` (per worker, of the weights it then holds); 409 with the workers'
  reason when refused.
- `GET STATUS_ROUTE`: `{"workers": [isoexec_gate_status of each worker]}`.

Both answer 401 without the token, and 404 on an engine started without handshake settings.
"""

from __future__ import annotations

import hmac
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from isoexec.contract.served import (
    FINGERPRINT_HEADER,
    STATUS_ROUTE,
    WEIGHTS_ROUTE,
    ServedHandshakeError,
)
from isoexec.vllm.served_handshake import served_handshake


async def isoexec_routes(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    path = request.url.path
    if path not in (WEIGHTS_ROUTE, STATUS_ROUTE):
        return await call_next(request)
    from fastapi.responses import JSONResponse

    def error(status: int, message: str) -> Any:
        return JSONResponse({"error": message}, status_code=status)

    state = request.app.state
    try:
        settings = served_handshake(state.vllm_config)
        token = None if settings is None else settings.token()
    except ServedHandshakeError as e:
        return error(500, str(e))
    if token is None:
        return error(404, "this engine was started without handshake settings "
                          "(isoexec engine serve --handshake-address ...)")  # fmt: skip
    given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    if not hmac.compare_digest(given.encode(), token.encode()):
        await request.body()  # read what was sent, so the client gets the answer, not EPIPE
        return error(401, "missing or wrong token (Authorization: Bearer <handshake token>)")
    engine = state.engine_client
    if path == STATUS_ROUTE:
        if request.method != "GET":
            return error(405, f"{STATUS_ROUTE} takes GET")
        return JSONResponse({"workers": await engine.collective_rpc("isoexec_gate_status")})
    if request.method != "POST":
        return error(405, f"{WEIGHTS_ROUTE} takes POST")
    body = await request.body()
    fingerprint = request.headers.get(FINGERPRINT_HEADER, "").strip()
    if not fingerprint:
        return error(400, f"the {FINGERPRINT_HEADER} header (the weights' fingerprint) is missing")
    with tempfile.TemporaryDirectory(prefix="isoexec-weights-") as tmp:
        file = Path(tmp) / "weights.safetensors"
        file.write_bytes(body)
        try:
            got = await engine.collective_rpc("isoexec_load_weights", args=(str(file), fingerprint))
        except Exception as e:  # a worker refused (gate, fingerprint) or failed: nothing loaded
            lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
            return error(409, lines[-1] if lines else type(e).__name__)
    # Cached KV was computed with the old weights: a prefix hit would mix them into new
    # samples. Running requests are reset too (recomputed with the new weights).
    if not await engine.reset_prefix_cache(reset_running_requests=True):
        return error(
            500,
            "weights loaded, but the prefix cache could not be reset: samples may reuse KV of "
            "the old weights (retry when the engine is idle)",
        )
    return JSONResponse({"fingerprints": list(got)})


__all__ = ["isoexec_routes"]
