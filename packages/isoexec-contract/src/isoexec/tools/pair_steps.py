"""The steps of a pair run that every caller shares: prompts, sampling on the engine, scoring
exactly the sampled sequences on the trainer, aligning the two, and the contract handshake.

`isoexec pair`, the integration tests and the examples use these; `pair.py` is the CLI.
"""

from __future__ import annotations

import random
import secrets
import threading
from collections.abc import Hashable, Sequence
from typing import Any

from isoexec.ops.penalties import Penalties
from isoexec.ops.truncation import Truncation


def make_prompts(num: int, vocab: int, seed: int) -> list[list[int]]:
    """A mixed batch: different lengths, shared prefixes, one long prompt that gets chunked."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(140)]
    prompts = []
    for i in range(num):
        if i % 3 == 0:
            p = shared + [rng.randrange(vocab) for _ in range(rng.randrange(1, 20))]
        elif i % 3 == 1:
            p = [rng.randrange(vocab) for _ in range(rng.randrange(3, 40))]
        else:
            p = [rng.randrange(vocab) for _ in range(rng.randrange(180, 260))]
        prompts.append(p)
    return prompts


def sample(
    engine: Any,
    prompts: list[list[int]],
    temps: list[float],
    max_tokens: int,
    lora: Any = None,
    truncations: list[Truncation | None] | None = None,
    full_vocab: bool = False,
    penalties: list[Penalties | None] | None = None,
) -> list[Any]:
    """The engine samples `max_tokens` tokens per prompt, each at its temperature and under
    its truncation (top-k / top-p / min-p, if given) and penalties (penalties, logit bias,
    allowed tokens, if given), under the adapter `lora` (a `LoraAdapter` the engine has
    added) if given; `full_vocab`: each sampled position's whole processed row comes back too
    (the engine needs max_logprobs=-1)."""
    from isoexec.vllm.engine_process import SamplingSpec

    engine.call("reset_prefix_cache")
    truncs = truncations or [None] * len(temps)
    pens = penalties or [None] * len(temps)
    specs = [
        SamplingSpec(
            max_tokens=max_tokens,
            temperature=t,
            lora=lora,
            full_vocab=full_vocab,
            penalties=pen,
            **_spec_fields(tr),
        )
        for t, tr, pen in zip(temps, truncs, pens, strict=True)
    ]
    return engine.generate(prompts, specs)


def _spec_fields(truncation: Truncation | None) -> dict[str, Any]:
    if truncation is None:
        return {}
    return {"top_k": truncation.top_k, "top_p": truncation.top_p, "min_p": truncation.min_p}


def _levels(keys: Sequence[Hashable]) -> list[Hashable]:
    """The distinct sampling settings of a batch, by temperature (`token_temperatures`'s
    order), then truncation."""

    def order(key: Any) -> tuple[float, str]:
        if isinstance(key, (int, float)):
            return (float(key), "")
        return (float(key[0]), repr(key[1:]))

    return sorted(set(keys), key=order)


def _group(completions: list[Any], keys: Sequence[Hashable], key: Hashable) -> list[list[int]]:
    """The full sequences (prompt + completion) sampled with settings `key`, in order."""
    return [
        c.prompt_token_ids + c.token_ids for c, k in zip(completions, keys, strict=True) if k == key
    ]


def align(
    completions: list[Any],
    keys: Sequence[Hashable],
    scored: dict[Any, list[Any]],
    full_vocab: bool = False,
) -> Any:
    """(trainer, engine) fp32 logprobs of every sampled token, in the same order; `scored`
    maps each request's settings (a temperature, or (temperature, truncation)) to the
    trainer's logprobs of `_group(..., settings)`. `full_vocab`: whole processed rows
    [tokens, V] instead (the engine's from `sample(..., full_vocab=True)`)."""
    import torch

    train, engine = [], []
    for key in _levels(keys):
        group = [c for c, k in zip(completions, keys, strict=True) if k == key]
        for c, lp in zip(group, scored[key], strict=True):
            values = c.full_logprobs if full_vocab else c.logprobs
            if values is None:
                raise ValueError("the completions were sampled without full_vocab=True")
            train.append(lp[-len(c.token_ids) :].float())
            engine.append(torch.tensor(values, dtype=torch.float32))
    return torch.cat(train), torch.cat(engine)


def score_completions(
    model: Any,
    completions: list[Any],
    temps: list[float],
    truncations: list[Truncation | None] | None = None,
    full_vocab: bool = False,
    penalties: list[Penalties | None] | None = None,
) -> tuple[Any, Any]:
    """The trainer scores exactly the sampled sequences, each with the settings given for it
    (temperature, truncation, penalties). Returns (trainer logprobs, engine logprobs) of every
    sampled token, fp32, aligned; `full_vocab`: each position's whole processed row (the
    trainer's `score(..., full_vocab=True)` against the rows the engine returned)."""
    from isoexec.megatron import score

    n = len(temps)
    keys: list[Hashable] = list(
        zip(temps, truncations or [None] * n, penalties or [None] * n, strict=True)
    )

    def lens(key: Hashable) -> list[int]:
        return [len(c.prompt_token_ids) for c, k in zip(completions, keys, strict=True) if k == key]

    scored = {
        k: score(model, _group(completions, keys, k), temperature=k[0], truncation=k[1],
                 full_vocab=full_vocab, penalties=k[2], prompt_lens=lens(k))
        for k in _levels(keys)
    }  # fmt: skip
    return align(completions, keys, scored, full_vocab)


def score_full_rows(
    model: Any,
    completions: list[Any],
    temps: list[float],
    truncations: list[Truncation | None] | None = None,
    penalties: list[Penalties | None] | None = None,
) -> tuple[Any, Any]:
    """(trainer, engine) whole processed rows [tokens, V] of every sampled position."""
    return score_completions(model, completions, temps, truncations, True, penalties)


def sample_and_score(
    engine: Any,
    model: Any,
    prompts: list[list[int]],
    temps: list[float],
    max_tokens: int,
    truncations: list[Truncation | None] | None = None,
) -> tuple[Any, Any]:
    """Engine samples; trainer scores exactly the sampled sequences, each with the settings it
    was sampled with (temperature, truncation).

    Returns (trainer logprobs, engine logprobs) of every sampled token, fp32, aligned.
    """
    completions = sample(engine, prompts, temps, max_tokens, truncations=truncations)
    return score_completions(model, completions, temps, truncations)


def handshake(
    trainer_contract: Any,
    engine: Any,
    run_id: str = "pair",
    *,
    server: Any = None,
    token: str | None = None,
    canary_model: Any = None,
) -> tuple[Any, dict[str, Any]]:
    """Trainer rank 0 and every engine worker (one per engine TP rank) offer their contracts
    concurrently; the service gives one verdict for the run.

    With `server`/`token` the caller's running service is used (it must stay up while weights
    are synced: workers ask it before loading); without, a temporary one is hosted here.
    Returns (trainer verdict, engine verdict: the first worker's that is not MATCH, else
    worker 0's); neither raises on MISMATCH. With `canary_model` (the trainer's model), a MATCH
    is followed by both sides' canaries (`isoexec.contract.canary`); the engine verdict then
    holds the engine's canary verdict under "canary".
    """
    from isoexec.handshake.client import HandshakeClient
    from isoexec.handshake.server import HandshakeServer

    if server is None:
        token = secrets.token_hex(16)
        workers = int(getattr(getattr(engine, "config", None), "tensor_parallel_size", 1))
        with HandshakeServer({"trainer": 1, "engine": workers}, token) as own:
            return handshake(trainer_contract, engine, run_id, server=own, token=token,
                             canary_model=canary_model)  # fmt: skip
    assert token is not None
    verdicts: dict[str, Any] = {}

    def offer() -> None:
        with HandshakeClient(server.address, token) as client:
            verdicts["trainer"] = client.offer(run_id, "trainer", 0, trainer_contract)

    # A daemon thread: if the engine fails, its error surfaces now; the trainer's pending
    # offer ends with the service (or its rendezvous deadline), it is not waited for.
    t = threading.Thread(target=offer, daemon=True)
    t.start()
    engine_verdicts = engine.call("handshake", server.address, token, run_id)
    t.join()
    failed = [v for v in engine_verdicts if v["outcome"] != "MATCH"]
    engine_verdict = (failed or engine_verdicts)[0]
    if canary_model is not None and not failed and verdicts["trainer"].matched:
        _, canary = canaries(canary_model, engine, server.address, token, run_id)
        engine_verdict = {**engine_verdict, "canary": canary}
    return verdicts["trainer"], engine_verdict


def canaries(model: Any, engine: Any, address: str, token: str, run_id: str, version: int = 0,
             lora: Any = None) -> tuple[Any, dict[str, Any]]:  # fmt: skip
    """Both sides' canaries for weights `version`, offered at once: (the trainer's verdict,
    the engine's as a dict). `lora`: the engine runs its probe under that adapter (the
    trainer's model must have it attached)."""
    from isoexec.megatron.canary import offer_canary

    got: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: got.update(t=offer_canary(model, address, token, run_id, version)),
        daemon=True,
    )
    t.start()
    engine_verdict: dict[str, Any] = engine.call(
        "canary", address, token, run_id, version, None, lora
    )
    t.join()
    return got.get("t"), engine_verdict


def weight_fingerprints(model: Any, engine: Any, adapter: Any = None) -> dict[str, str | None]:
    """Both sides' weight fingerprints (checkpoint names): what each side holds; under an
    adapter, base + adapter on both sides (`served_weights_fingerprint`)."""
    from isoexec.contract.fingerprint import WeightFingerprint
    from isoexec.megatron import export_hf_weights

    lora = getattr(model, "isoexec_lora", None)
    if adapter is not None and lora is not None:
        trainer = lora.weight_fingerprint()
    else:
        trainer = WeightFingerprint.of(export_hf_weights(model)).digest
    return {"trainer": trainer, "engine": engine_fingerprint(engine, adapter)}


def engine_fingerprint(engine: Any, adapter: Any = None) -> str | None:
    """The engine workers' common fingerprint; None where they differ or cannot say (a stock
    engine's CPU linears hold prepacked weights that do not map back to checkpoint tensors)."""
    from isoexec.vllm.engine_process import EngineError

    try:
        name = None if adapter is None else adapter.name
        workers = engine.call("weight_fingerprint", name)
    except EngineError:
        return None
    return workers[0] if len(set(workers)) == 1 else None


__all__ = [
    "align",
    "canaries",
    "engine_fingerprint",
    "handshake",
    "make_prompts",
    "sample",
    "sample_and_score",
    "weight_fingerprints",
]
