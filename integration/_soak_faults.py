"""The soak's faults (`soak.py`): each injects one fault into a running `Soak`, drives the
recovery the run must end in, and returns what was observed. One function per kind in
`soak.FAULTS`; a recovery that does not happen raises, and the soak fails."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from _served import PIDS, wait_cleared

if TYPE_CHECKING:
    from soak import Soak


def engine_sigkill(soak: Soak, step: int) -> str:
    import openai

    os.killpg(PIDS[soak.url], signal.SIGKILL)
    assert soak.engine_stack is not None
    soak.engine_stack.close()
    soak.restarts += 1
    soak.start_engine()  # offers at load: the trainer's offer stands, MATCH at once
    (status,) = wait_cleared(soak.url, soak.token)
    if status["last_verdict"] != "MATCH":
        raise RuntimeError(f"restarted engine: {status}")
    try:
        soak._complete([soak.pool[0]], 1)
        raise RuntimeError("a restarted engine sampled before its canary")
    except openai.APIStatusError as e:
        if e.status_code != 503:
            raise
    soak.push_and_canary()  # the current weights, at the current version
    return f"restarted (server {soak.restarts}); refused samples until push + canary"


def handshake_restart(soak: Soak, step: int) -> str:
    from isoexec.handshake.served import served_reoffer

    killed = soak.service.pid
    os.killpg(killed, signal.SIGKILL)
    soak.service.wait(30)
    soak.start_service(soak.port)
    try:  # the new service knows no MATCH: the engine's gate refuses
        soak.call("push", soak.url, soak.version + 1)
        raise AssertionError("a push went through a service that knows no MATCH")
    except RuntimeError as e:
        if "HTTP 409" not in str(e):
            raise
    got: dict[str, Any] = {}
    reoffer = threading.Thread(
        target=lambda: got.update(v=served_reoffer(soak.url, soak.token, timeout_s=300))
    )
    reoffer.start()
    soak.call("offer")
    reoffer.join(300)
    if [v["outcome"] for v in got.get("v", [])] != ["MATCH"]:
        raise RuntimeError(f"engine re-offer: {got}")
    return (f"service pid {killed} SIGKILLed, a new one on its port; push refused (409, no "
            "MATCH) until both sides offered again; MATCH")  # fmt: skip


def push_truncated(soak: Soak, step: int) -> str:
    from isoexec.handshake.served import WEIGHTS_ROUTE, served_status

    before = served_status(soak.url, soak.token)[0]["gated_loads"]
    body, fingerprint = soak.call("weights")
    host, port = soak.url.removeprefix("http://").split(":")
    head = (
        f"POST {WEIGHTS_ROUTE} HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {soak.token}\r\n"
        f"X-IsoExec-Fingerprint: {fingerprint}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head.encode() + body[: len(body) // 2])
    time.sleep(1.0)
    after = served_status(soak.url, soak.token)[0]["gated_loads"]
    if after != before:
        raise RuntimeError(f"a truncated push loaded weights ({before} -> {after} loads)")
    return f"cut at {len(body) // 2} of {len(body)} bytes; nothing loaded"


def trainer_restart(soak: Soak, step: int) -> str:
    assert soak.trainer is not None
    held, killed = soak.version, soak.trainer.pid
    soak.trainer.kill()  # SIGKILL: nothing flushed, nothing said goodbye
    soak.trainer = soak.spares.pop()
    resumed = soak.call("resume")
    soak.call("offer")
    if resumed != held:
        raise RuntimeError(f"resumed version {resumed}, the run was at {held}")
    return (f"pid {killed} SIGKILLed; trainer pid {soak.trainer.pid} resumed from the last "
            f"checkpoint at version {resumed} and offered again: MATCH")  # fmt: skip


def client_disconnect(soak: Soak, step: int) -> str:
    from openai import OpenAI

    own = OpenAI(base_url=f"{soak.url}/v1", api_key="unused", max_retries=0)
    stream = own.completions.create(
        model=soak.model, prompt=soak.pool[1], max_tokens=200, temperature=1.0, stream=True
    )
    next(iter(stream))
    stream.close()  # the client goes away mid-stream
    own.close()
    return "stream closed after its first chunk; the next push drained without it"


def malformed_request(soak: Soak, step: int) -> str:
    import urllib.error
    import urllib.request

    bodies = [
        b"{not json",
        json.dumps({"model": soak.model, "prompt": [1, 2], "max_tokens": -1}).encode(),
        json.dumps({"model": soak.model, "prompt": [1, 2], "temperature": "hot"}).encode(),
    ]
    codes = []
    for body in bodies:
        req = urllib.request.Request(
            f"{soak.url}/v1/completions",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                codes.append(r.status)
        except urllib.error.HTTPError as e:
            codes.append(e.code)
    if not all(400 <= c < 500 for c in codes):
        raise RuntimeError(f"malformed requests answered {codes}")
    return f"answered {codes}; the engine serves on"
