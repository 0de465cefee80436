"""Repeated weight reloads through the IsoExec worker extension, for every model family (fp32).

One engine per family takes three successive reloads of changed weights (every tensor
perturbed, experts and GDN parameters included) through the real gate: handshake MATCH first,
then `isoexec_load_weights` with the trainer's fingerprint. After each reload its prompt
logprobs and greedy tokens/logprobs must be bitwise equal to an engine started from a
checkpoint holding those weights, and its weight fingerprint must be the checkpoint's.

What this catches: weights a loader skips or lays out differently on reload than at start
(the stock CPU MoE path repacks experts after loading and corrupts them on a reload),
packed-weight caches that survive a reload, and prefix-cache KV computed with the old
weights: the engine generates before the first reload and between reloads, filling the
prefix cache with the long prompt's first block, and the first request after each reload
must find that cache empty.

Engine starts are the cost (20-60 s each here), so the reloaded engine starts from the first
weight set W1 (its outputs before any reload are those of a fresh W1 engine), reloads
W2 -> W3 -> W1, and only W2 and W3 get engines of their own: three starts per family. The
fresh engines start and run in a background thread while the reloaded engine works (the
two overlap on two cores); all come from the suite's engine pool, which keeps at most three
engines alive.
"""

from __future__ import annotations

import itertools
import secrets
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from _invariance import prompt
from safetensors.torch import load_file, save_file

from isoexec.contract.fingerprint import WeightFingerprint
from isoexec.handshake.server import HandshakeServer
from isoexec.vllm.engine_process import Completion, EngineProcess, SamplingSpec

pytestmark = [pytest.mark.engine, pytest.mark.slow]

VOCAB = 512  # all three tiny presets
# One prompt longer than a 128-token KV block (so the prefix cache stores a block of it),
# two shorter ones co-batched with it.
PROMPTS = [prompt(40, 140, VOCAB), prompt(41, 23, VOCAB), prompt(42, 9, VOCAB)]
GREEDY = SamplingSpec(max_tokens=5, temperature=0.0)
SCORE = SamplingSpec(max_tokens=1, prompt_logprobs=True)
BLOCK = 128


def _perturbed_checkpoint(src: str, dst: Path, seed: int) -> tuple[Path, str]:
    """A copy of `src` with every tensor changed (same names, shapes, dtypes); (weights
    file, its fingerprint)."""
    shutil.copytree(src, dst)
    file = dst / "model.safetensors"
    weights = load_file(str(file))
    gen = torch.Generator().manual_seed(seed)
    new = {
        name: (t.float() + 0.02 * torch.randn(t.shape, generator=gen)).to(t.dtype)
        for name, t in sorted(weights.items())
    }
    assert all(not torch.equal(new[n], weights[n]) for n in weights)
    save_file(new, str(file))
    return file, WeightFingerprint.of(new).digest


def _greedy(outs: list[Completion]) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.tensor([o.token_ids for o in outs])
    logprobs = torch.tensor([o.logprobs for o in outs], dtype=torch.float64)
    return tokens, logprobs


def _observe(eng: EngineProcess) -> dict[str, torch.Tensor]:
    """Greedy decode (must not find cached KV), prompt logprobs, greedy decode again (must
    reuse the long prompt's first block, now computed with the current weights)."""
    first = eng.generate(PROMPTS, GREEDY)
    assert [o.num_cached_tokens for o in first] == [0, 0, 0], "stale prefix cache"
    scored = eng.generate(PROMPTS, SCORE)
    again = eng.generate(PROMPTS, GREEDY)
    assert again[0].num_cached_tokens >= BLOCK, "the repeat did not hit the prefix cache"
    obs: dict[str, torch.Tensor] = {}
    obs["tokens"], obs["logprobs"] = _greedy(first)
    obs["cached_tokens"], obs["cached_logprobs"] = _greedy(again)
    obs["prompt_logprobs"] = torch.tensor(
        [lp for o in scored for lp in (o.prompt_logprobs or [])], dtype=torch.float64
    )
    assert obs["prompt_logprobs"].numel() == sum(len(p) - 1 for p in PROMPTS)
    assert torch.isfinite(obs["prompt_logprobs"]).all()
    return obs


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"{what}: {differ} not bitwise equal to a fresh engine"


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe", "tiny-gdn"])
def test_three_reloads_match_fresh_engines(
    tmp_path: Path,
    model_factory: Callable[[str, str], str],
    engine_pool: Callable[..., EngineProcess],
    preset: str,
) -> None:
    base = model_factory(preset, "float32")
    ckpt = {k: _perturbed_checkpoint(base, tmp_path / f"w{k}", seed=100 + k) for k in (1, 2, 3)}
    order = [2, 3, 1]  # W1 (start) -> W2 -> W3 -> back to W1
    reloaded: dict[int, dict[str, torch.Tensor]] = {}

    def fresh_engines() -> dict[int, dict[str, torch.Tensor]]:
        seen = {}
        for k in (2, 3):
            fresh = engine_pool(model=str(tmp_path / f"w{k}"), isoexec=True, enforce_eager=True)
            assert fresh.call("weight_fingerprint") == [ckpt[k][1]]
            seen[k] = _observe(fresh)
        return seen

    # The engine that reloads: only this test uses its config (a model dir of its own).
    eng = engine_pool(model=str(tmp_path / "w1"), isoexec=True, enforce_eager=True)
    # From here only the background thread calls `engine_pool` (the pool is not thread-safe).
    with ThreadPoolExecutor(max_workers=1) as background:
        fresh_seen = background.submit(fresh_engines)
        assert eng.call("weight_fingerprint") == [ckpt[1][1]]
        start = _observe(eng)  # a fresh W1 engine; leaves W1 KV in the prefix cache
        token = secrets.token_hex(16)
        with HandshakeServer({"engine": 1}, token) as server:
            (verdict,) = eng.call("handshake", server.address, token, f"reload-{preset}")
            assert verdict["outcome"] == "MATCH", verdict
            for k in order:
                file, fingerprint = ckpt[k]
                assert eng.call("load_weights", str(file), fingerprint) == [fingerprint]
                assert eng.call("weight_fingerprint") == [fingerprint]
                reloaded[k] = _observe(eng)
        fresh = fresh_seen.result()

    # Each reload really changed what the engine computes (else equality proves nothing).
    seq = [start] + [reloaded[k] for k in order]
    for before, after in itertools.pairwise(seq):
        assert not torch.equal(before["prompt_logprobs"], after["prompt_logprobs"])
        assert not torch.equal(before["logprobs"], after["logprobs"])

    # Back to W1: exactly the bits of the engine when it was freshly started from W1.
    _assert_same(reloaded[1], start, f"{preset} after reload 3 (W1)")
    for k in (2, 3):
        _assert_same(reloaded[k], fresh[k], f"{preset} after loading W{k}")
