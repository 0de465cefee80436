"""The trainer's numeric canary (`isoexec.contract.canary`): the run's probe scored by the live
model, offered to the handshake service after the contracts MATCH and after every weight sync.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from isoexec.contract.canary import canary_probe
from isoexec.megatron.logprobs import vocab_size
from isoexec.megatron.scoring import score

if TYPE_CHECKING:
    from isoexec.handshake.canary_board import CanaryVerdict
    from isoexec.handshake.tls import ClientTLS

TRAINER_SIDE = "trainer"


def canary_logprobs(model: torch.nn.Module, run_id: str) -> list[float]:
    """The T=1 logprobs of probe tokens 1..n-1 under the model's live weights (as the engine's
    prompt logprobs of the same probe)."""
    probe = canary_probe(run_id, vocab_size(model))
    (lp,) = score(model, [probe], temperature=1.0)
    return [float(v) for v in lp.float()]


def offer_canary(
    model: torch.nn.Module,
    address: str,
    token: str,
    run_id: str,
    weights_version: int,
    *,
    rank: int = 0,
    tls: ClientTLS | None = None,
    timeout_s: float = 600.0,
) -> CanaryVerdict:
    """Score the probe and offer it as trainer/`rank` for `weights_version` (0: the weights both
    sides loaded at start; +1 per sync); waits for the engine's. The verdict's summary names
    the first differing position and both values on MISMATCH, and the time scoring took."""
    from isoexec.handshake.client import HandshakeClient

    started = time.perf_counter()
    values = canary_logprobs(model, run_id)
    took = time.perf_counter() - started
    with HandshakeClient(address, token, timeout_s=timeout_s, tls=tls) as client:
        verdict = client.offer_canary(run_id, TRAINER_SIDE, rank, weights_version, values)
    return replace(verdict, summary=f"{verdict.summary} (trainer scored it in {took * 1e3:.0f} ms)")


def canary_with_served_engine(
    model: torch.nn.Module,
    engine_url: str,
    address: str,
    token: str,
    run_id: str,
    weights_version: int,
    *,
    tls: ClientTLS | None = None,
    timeout_s: float = 600.0,
    adapter: str | None = None,
) -> tuple[CanaryVerdict, dict[str, Any]]:
    """The canary of a served engine (`isoexec engine serve --handshake-*`) and this trainer
    for `weights_version`, both offered at once: (trainer's verdict, engine's verdict). The
    engine samples again only after a MATCH; run it at start-up and after every push.
    `adapter`: the engine's probe runs under that pushed adapter (attach the same one to
    `model`)."""
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

    from isoexec.handshake.served import served_canary

    pool = ThreadPoolExecutor(2, thread_name_prefix="isoexec-canary")
    try:
        engine = pool.submit(
            served_canary, engine_url, token, weights_version, timeout_s, adapter=adapter
        )
        trainer = pool.submit(offer_canary, model, address, token, run_id, weights_version,
                              tls=tls, timeout_s=timeout_s)  # fmt: skip
        wait([engine, trainer], return_when=FIRST_EXCEPTION)
        if engine.done() and engine.exception() is not None:
            raise engine.exception()  # type: ignore[misc]  # e.g. the engine refused: no wait
        return trainer.result(), engine.result()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["canary_logprobs", "canary_with_served_engine", "offer_canary"]
