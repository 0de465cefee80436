"""IsoExec's routes on vLLM's OpenAI server, added through vLLM's `--middleware` extension
point (`isoexec engine serve` passes it): the weight push and the gate status, authenticated
with the handshake token, so a served engine needs no dev-mode endpoint.

- `POST WEIGHTS_ROUTE`: body = safetensors bytes of HF-named tensors, header
  `FINGERPRINT_HEADER` = their fingerprint, optionally `VERSION_HEADER` = the version the push
  creates (409 unless newer than the engine's). A body larger than the model's tensor set
  (plus its header) is refused with 413 before it is kept. The bytes go to a private
  temporary file on the server's node and every worker loads them with
  `isoexec_load_weights`: each checks its MATCH, the tensor set and the fingerprint before
  touching a weight. No sequence straddles two versions (`weight_versions`): new requests
  are refused (503) while the requests already admitted finish under the old weights, then
  vLLM's `pause_generation(mode="wait")`, the load, a prefix-cache reset, resume. Replies
  `{"fingerprints": [...], "weights_version": k}` (per worker, of the weights it then holds;
  k = the stated version, else the next); 409 with the workers' reason when refused, 503
  when the admitted requests did not finish within the drain timeout (nothing loaded).
- `GET STATUS_ROUTE`: `{"workers": [isoexec_gate_status of each worker], "sampling": the
  sampling gate}`.
- `POST CANARY_ROUTE`, body `{"weights_version": k, "adapter": name or null}`: the engine
  scores the run's canary probe in a batch with other requests (the probe under the adapter,
  if named) and offers it (`isoexec.vllm.canary`); replies its verdict.
- `POST ADAPTER_ROUTE`: body = safetensors bytes of a PEFT adapter's tensors, headers
  `ADAPTER_NAME_HEADER`, `ADAPTER_CONFIG_HEADER` (its adapter_config.json) and
  `FINGERPRINT_HEADER` (the trainer's fingerprint). Every worker announces it (needs MATCH),
  then vLLM's own adapter loading loads it under that name (the adapter gate checks the
  tensors against the fingerprint). The files stay in a private directory for the server's
  life (vLLM reads an evicted adapter again). Like a weight push, it bumps the weights version:
  sampling waits for a canary under it. 409 with the reason when refused; a name already
  served is refused (push each synced adapter under a new name).

- `POST OFFER_ROUTE`: every worker offers its contract again to the service the engine was
  started with (after the service restarted and forgot the run); replies `{"verdicts":
  [...]}`. Without MATCH on every worker the sampling gate shuts, naming the verdict.

All answer 401 without the token, and 404 on an engine started without handshake settings.
With handshake settings, vLLM's development routes that write weights or hold the scheduler
(`VLLM_SERVER_DEV_MODE`: `/collective_rpc`, `/update_weights`, `/pause`, `/sleep`, ...) answer
403: a load through them would bypass the drain and the weights version, so samples would
straddle versions or carry a record naming weights they were not sampled under.
Every completion response (`SAMPLED`) carries the `SamplingRecord` it was sampled with in
`SAMPLING_HEADER`, with or without handshake settings.

**The sampling gate.** An engine with handshake settings serves samples only while a canary of
the weights it holds has MATCHed: not before the first one, not after a push until the next
one (weights version +1), not after a MISMATCH. Every other path answers 503 naming why,
except the few that compute no sample (`UNGATED`): an allow-list, so a route vLLM adds later
is gated too.
"""

from __future__ import annotations

import hmac
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from isoexec.handshake.served import (
    ADAPTER_CONFIG_HEADER,
    ADAPTER_NAME_HEADER,
    ADAPTER_ROUTE,
    CANARY_ROUTE,
    FINGERPRINT_HEADER,
    OFFER_ROUTE,
    STATUS_ROUTE,
    VERSION_HEADER,
    WEIGHTS_ROUTE,
    ServedHandshake,
    ServedHandshakeError,
)
from isoexec.vllm.served_handshake import served_handshake
from isoexec.vllm.served_sampling import serving_models, with_sampling_record
from isoexec.vllm.weight_versions import (
    PrefixCacheResetError,
    WeightPushBusyError,
    WeightPushFailedError,
    WeightVersions,
)

ROUTES = (WEIGHTS_ROUTE, STATUS_ROUTE, CANARY_ROUTE, ADAPTER_ROUTE, OFFER_ROUTE)
# The OpenAI routes whose responses carry the `SamplingRecord` header.
SAMPLED = ("/v1/completions", "/v1/chat/completions")
# Paths that compute no sample: served before the canary passes.
UNGATED = ("/health", "/ping", "/version", "/metrics", "/v1/models", "/tokenize", "/detokenize")


class SamplingGate:
    """This server's sampling gate (one per API-server process; the launcher allows one)."""

    def __init__(self) -> None:
        self.versions = WeightVersions()
        self.cleared = False
        self.reason = "no canary has MATCHed yet for the weights loaded at start (version 0)"

    @property
    def weights_version(self) -> int:
        return self.versions.version

    def as_dict(self) -> dict[str, Any]:
        return {"weights_version": self.weights_version, "cleared": self.cleared,
                "reason": "" if self.cleared else self.reason}  # fmt: skip


GATE = SamplingGate()


_SETTINGS: dict[int, tuple[ServedHandshake | None, str | None]] = {}


def _settings(vllm_config: Any) -> tuple[ServedHandshake | None, str | None]:
    """The handshake settings and token, read once per server (every request asks)."""
    key = id(vllm_config)
    if key not in _SETTINGS:
        settings = served_handshake(vllm_config)
        _SETTINGS[key] = (settings, None if settings is None else settings.token())
    return _SETTINGS[key]


def _json_error(status: int, message: str) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": message}, status_code=status)


async def isoexec_routes(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    path = request.url.path
    state = request.app.state
    error = _json_error
    try:
        settings, token = _settings(state.vllm_config)
    except ServedHandshakeError as e:
        return error(500, str(e))
    if token is not None and path in _bypassing_routes(request.app):
        await request.body()
        return error(403, f"IsoExec: {path} is a vLLM development route that writes weights or "
                          "holds the scheduler outside IsoExec's weight versions; push weights "
                          f"with POST {WEIGHTS_ROUTE}")  # fmt: skip
    if path not in ROUTES:
        if token is not None and GATE.cleared and path not in UNGATED:
            return await _admitted(request, call_next)
        if token is None or path in UNGATED:
            if path in SAMPLED and request.method == "POST":
                versions = GATE.versions
                return await with_sampling_record(
                    request, call_next, versions.version, versions.fingerprint
                )
            return await call_next(request)
        await request.body()
        from fastapi.responses import JSONResponse

        message = (f"IsoExec: this engine is not cleared to sample: {GATE.reason} (the trainer "
                   f"runs the canary: POST {CANARY_ROUTE})")  # fmt: skip
        # In the OpenAI error shape vLLM answers with, so OpenAI clients show the message.
        body = {"error": {"message": message, "type": "ServiceUnavailable", "code": 503}}
        return JSONResponse(body, status_code=503)
    from fastapi.responses import JSONResponse

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
        workers = await engine.collective_rpc("isoexec_gate_status")
        return JSONResponse({"workers": workers, "sampling": GATE.as_dict()})
    if path == CANARY_ROUTE:
        assert settings is not None
        return await _canary(request, engine, settings, token)
    if path == ADAPTER_ROUTE:
        return await _adapter(request, engine)
    if path == OFFER_ROUTE:
        assert settings is not None
        return await _reoffer(request, engine, settings, token)
    if request.method != "POST":
        return error(405, f"{WEIGHTS_ROUTE} takes POST")
    from starlette.requests import ClientDisconnect

    limit = await _body_limit(engine)
    try:
        body = await _read_at_most(request, limit)
    except ClientDisconnect:  # a push cut off mid-body: nothing was kept
        return error(400, "the body ended early (the client went away); nothing loaded")
    if body is None:
        return error(413, f"the body is larger than this model's weights allow ({limit} bytes: "
                          "the whole tensor set and its header); nothing loaded")  # fmt: skip
    fingerprint = request.headers.get(FINGERPRINT_HEADER, "").strip()
    if not fingerprint:
        return error(400, f"the {FINGERPRINT_HEADER} header (the weights' fingerprint) is missing")
    stated = request.headers.get(VERSION_HEADER)
    try:
        pushed = None if stated is None else int(stated)
    except ValueError:
        return error(400, f"{VERSION_HEADER} {stated!r} is not an integer")
    try:  # before the gate shuts: a stale push changes nothing (checked again under the lock)
        GATE.versions.check_newer(pushed)
    except WeightPushFailedError as e:
        return error(409, str(e))
    # No sequence straddles two weight versions (`weight_versions`): new requests are refused
    # from here on (503), the ones admitted finish under the weights they started with (their
    # sampling record names that version), then the workers load.
    before = (GATE.cleared, GATE.reason)
    GATE.cleared, GATE.reason = False, "a weight push is in progress"
    with tempfile.TemporaryDirectory(prefix="isoexec-weights-") as tmp:
        file = Path(tmp) / "weights.safetensors"
        file.write_bytes(body)
        try:
            got = await GATE.versions.push(engine, str(file), fingerprint, version=pushed)
        except PrefixCacheResetError as e:  # loaded: the gate stays shut
            GATE.reason = f"new weights (version {GATE.weights_version}) loaded, but {e}"
            return error(500, str(e))
        except (WeightPushFailedError, WeightPushBusyError) as e:  # nothing loaded: the old
            GATE.cleared, GATE.reason = before  # weights serve on
            return error(409 if isinstance(e, WeightPushFailedError) else 503, str(e))
    GATE.reason = f"new weights (version {GATE.weights_version}) have not passed a canary"
    return JSONResponse({"fingerprints": list(got), "weights_version": GATE.weights_version})


# The modules of vLLM's development routes that write weights or hold the scheduler.
BYPASSING_MODULES = ("vllm.entrypoints.rl.", "vllm.entrypoints.serve.dev.rpc.",
                     "vllm.entrypoints.serve.dev.sleep.")  # fmt: skip
_BYPASSING: dict[int, frozenset[str]] = {}


def _bypassing_routes(app: Any) -> frozenset[str]:
    """The paths of the app's routes defined in `BYPASSING_MODULES` (found by where their
    handler is defined, so a route vLLM adds there later is refused too)."""
    key = id(app)
    if key not in _BYPASSING:
        _BYPASSING[key] = frozenset(
            route.path for route in app.routes
            if getattr(getattr(route, "endpoint", None), "__module__", "").startswith(
                BYPASSING_MODULES)
        )  # fmt: skip
    return _BYPASSING[key]


_LIMIT: list[int] = []  # the body limit, computed at the first push (the model's size)
HEADER_SLACK = 16 * 2**20  # a safetensors header: names, shapes, offsets (JSON)


async def _body_limit(engine: Any) -> int:
    if not _LIMIT:
        sizes = await engine.collective_rpc("isoexec_expected_bytes")
        _LIMIT.append(int(max(sizes)) + HEADER_SLACK)
    return _LIMIT[0]


async def _read_at_most(request: Any, limit: int) -> bytes | None:
    """The body, or None when it is larger than `limit` (then drained without being kept: a
    client that sent too much still reads the answer, and the server holds no more than
    `limit` bytes)."""
    declared = request.headers.get("content-length", "")
    over = declared.isdigit() and int(declared) > limit
    buf = bytearray()
    async for chunk in request.stream():
        if not over and len(buf) + len(chunk) > limit:
            over, buf = True, bytearray()
        if not over:
            buf += chunk
    return None if over else bytes(buf)


async def _admitted(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    """A gated request, counted in until its response's last byte is out (or its client has
    gone): a weight push waits for every admitted request (`weight_versions`)."""
    version, fingerprint = GATE.versions.admit(), GATE.versions.fingerprint
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            GATE.versions.release()

    try:
        if request.url.path in SAMPLED and request.method == "POST":
            response = await with_sampling_record(request, call_next, version, fingerprint)
        else:
            response = await call_next(request)
    except BaseException:
        release()
        raise
    body = getattr(response, "body_iterator", None)
    if body is None:
        release()
        return response

    async def counted() -> Any:
        try:
            async for chunk in body:
                yield chunk
        finally:
            release()

    response.body_iterator = counted()
    return response


async def _canary(request: Any, engine: Any, settings: ServedHandshake, token: str) -> Any:
    """Score and offer the canary of the weights this engine holds; open or close the gate."""
    import asyncio
    import json
    import time
    import uuid

    from fastapi.responses import JSONResponse

    from isoexec.vllm import canary
    from vllm.inputs import TokensPrompt

    if request.method != "POST":
        return _json_error(405, f"{CANARY_ROUTE} takes POST")
    try:
        body = json.loads(await request.body())
        version = int(body["weights_version"])
        adapter = body.get("adapter")
    except (ValueError, KeyError, TypeError, AttributeError):
        return _json_error(400, 'the body must be {"weights_version": <int>, "adapter": ...}')
    lora = None
    if adapter is not None:
        lora = serving_models(request).lora_requests.get(adapter)
        if lora is None:
            return _json_error(404, f"no adapter {adapter!r} is served (push it first)")
    if version != GATE.weights_version:
        return _json_error(409, f"this engine holds weights version {GATE.weights_version}, "
                                f"not {version}")  # fmt: skip
    probe = canary.probe_for(request.app.state.vllm_config, settings.run_id)

    async def run(prompt: list[int], params: Any, under: Any) -> Any:
        last = None
        rid = f"isoexec-canary-{uuid.uuid4().hex}"
        gen = engine.generate(
            TokensPrompt(prompt_token_ids=prompt), params, rid, lora_request=under
        )
        async for out in gen:
            last = out
        return last

    started = time.perf_counter()
    batch = canary.canary_batch(probe)  # the probe (and every other request) under the adapter
    outs = await asyncio.gather(
        *(run(p, sp, lora if i % 2 == 0 else None) for i, (p, sp) in enumerate(batch))
    )
    values = canary.probe_logprobs(probe, outs[0].prompt_logprobs)
    scored = time.perf_counter() - started
    try:
        verdict = await asyncio.to_thread(
            canary.offer, values, address=settings.address, token=token,
            run_id=settings.run_id, weights_version=version, tls=settings.client_tls(),
            scored_s=scored,
        )  # fmt: skip
    except Exception as e:  # the service refused or could not be reached: the gate stays shut
        GATE.cleared, GATE.reason = False, f"the canary could not be offered: {e}"
        return _json_error(502, GATE.reason)
    if version == GATE.weights_version:  # no push arrived meanwhile
        GATE.cleared = bool(verdict["matched"])
        GATE.reason = "" if GATE.cleared else verdict["summary"]
    print(f"isoexec: {verdict['summary']} (engine scored it in {scored * 1e3:.0f} ms)",
          flush=True)  # fmt: skip
    return JSONResponse(verdict)


OFFER_TIMEOUT_S = 300.0  # the trainer offers too; the engine's steps wait meanwhile


async def _reoffer(request: Any, engine: Any, settings: ServedHandshake, token: str) -> Any:
    """Every worker offers its contract again; the sampling gate stays open only on MATCH."""
    from fastapi.responses import JSONResponse

    if request.method != "POST":
        return _json_error(405, f"{OFFER_ROUTE} takes POST")
    await request.body()
    tls = settings.client_tls()
    tls_fields = None if tls is None else {"ca": tls.ca, "cert": tls.cert, "key": tls.key}
    try:
        verdicts = await engine.collective_rpc(
            "isoexec_handshake",
            args=(settings.address, token, settings.run_id, OFFER_TIMEOUT_S, tls_fields),
        )
    except Exception as e:  # the service unreachable or the round timed out: no clearance
        GATE.cleared, GATE.reason = False, f"the contract could not be offered again: {e}"
        return _json_error(502, GATE.reason)
    if not all(v["outcome"] == "MATCH" for v in verdicts):
        GATE.cleared = False
        GATE.reason = next(v["summary"] for v in verdicts if v["outcome"] != "MATCH")
    return JSONResponse({"verdicts": verdicts})


_ADAPTER_DIRS: list[str] = []  # kept for the server's life: vLLM re-reads an evicted adapter


async def _adapter(request: Any, engine: Any) -> Any:
    """Announce a pushed adapter on every worker, then load it through vLLM's own adapter
    loading (the adapter gate checks it); sampling waits for its canary."""
    import atexit
    import json
    import shutil

    from fastapi.responses import JSONResponse

    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    if request.method != "POST":
        return _json_error(405, f"{ADAPTER_ROUTE} takes POST")
    body = await request.body()
    name = request.headers.get(ADAPTER_NAME_HEADER, "").strip()
    fingerprint = request.headers.get(FINGERPRINT_HEADER, "").strip()
    try:
        config = json.loads(request.headers.get(ADAPTER_CONFIG_HEADER, ""))
        if not isinstance(config, dict):
            raise ValueError("not an object")
    except ValueError as e:
        return _json_error(400, f"the {ADAPTER_CONFIG_HEADER} header is not a JSON object: {e}")
    if not name or not fingerprint:
        return _json_error(400, f"the {ADAPTER_NAME_HEADER} and {FINGERPRINT_HEADER} headers "
                                "are required")  # fmt: skip
    models = serving_models(request)
    if name in models.lora_requests:
        return _json_error(409, f"an adapter named {name!r} is served already: push each "
                                "synced adapter under a new name")  # fmt: skip
    directory = tempfile.mkdtemp(prefix="isoexec-adapter-")
    if not _ADAPTER_DIRS:
        atexit.register(lambda: [shutil.rmtree(d, ignore_errors=True) for d in _ADAPTER_DIRS])
    _ADAPTER_DIRS.append(directory)
    (Path(directory) / "adapter_model.safetensors").write_bytes(body)
    (Path(directory) / "adapter_config.json").write_text(json.dumps(config))
    try:
        await engine.collective_rpc("isoexec_expect_adapter", args=(name, fingerprint))
    except Exception as e:  # no MATCH: nothing announced, nothing loaded
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        return _json_error(409, lines[-1] if lines else type(e).__name__)
    loaded = await models.load_lora_adapter(
        LoadLoRAAdapterRequest(lora_name=name, lora_path=directory)
    )
    if not isinstance(loaded, str):  # vLLM's ErrorResponse: the gate (or vLLM) refused
        message = getattr(getattr(loaded, "error", None), "message", None) or str(loaded)
        lines = [ln for ln in message.strip().splitlines() if ln.strip()]
        return _json_error(409, lines[-1] if lines else message)
    GATE.versions.bump()
    GATE.cleared = False
    GATE.reason = (f"adapter {name!r} (weights version {GATE.weights_version}) has not passed "
                   "a canary")  # fmt: skip
    return JSONResponse({"name": name, "weights_version": GATE.weights_version})


__all__ = ["isoexec_routes"]
