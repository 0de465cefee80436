"""Engine weight sync behind the handshake gate: refused before MATCH, checked by fingerprint."""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save, save_file

from isoexec.contract.contract import Contract
from isoexec.contract.fingerprint import WeightFingerprint
from isoexec.handshake.server import HandshakeServer
from isoexec.vllm.engine_process import EngineConfig, EngineError, EngineProcess, SamplingSpec

pytestmark = pytest.mark.engine


def _perturbed_checkpoint(src: str, dst: Path, seed: int) -> Path:
    """A copy of `src` with every weight changed (same names, shapes, dtypes)."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    new = {
        n: (t.float() + 0.02 * torch.randn(t.shape, generator=gen)).to(t.dtype)
        for n, t in weights.items()
    }
    save_file(new, str(dst / "model.safetensors"))
    return dst / "model.safetensors"


def _name_twice(body: bytes) -> bytes:
    """The safetensors bytes with the header's second tensor named like its first."""
    import json
    import struct

    (n,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8 : 8 + n])
    first, second = [k for k in header if k != "__metadata__"][:2]
    text = json.dumps(header).replace(json.dumps(second) + ":", json.dumps(first) + ":", 1)
    raw = text.encode() + b" " * (-len(text.encode()) % 8)
    return struct.pack("<Q", len(raw)) + raw + body[8 + n :]


def test_weight_sync_gate_fingerprints_and_reload(
    tmp_path: Path, tiny_dense_dir: str, engine_pool: Callable[..., Any]
) -> None:
    # A dedicated engine: this test changes its weights.
    eng = EngineProcess(
        EngineConfig(model=tiny_dense_dir, isoexec=True, seed=1, enforce_eager=True)
    )
    try:
        contract = Contract.from_bytes(eng.call("contract"))
        assert not contract.native_sites
        new_file = _perturbed_checkpoint(tiny_dense_dir, tmp_path / "step1", seed=7)
        new_weights = load_file(str(new_file))
        expected = WeightFingerprint.of(new_weights).digest

        prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [11, 12, 13]]
        spec = SamplingSpec(max_tokens=1, prompt_logprobs=True)
        # Run the old weights first: a cache of the old weights must not survive the reload.
        old = eng.generate(prompts, spec)
        old_lps = [o.prompt_logprobs for o in old]
        assert {(o.weights_version, o.weights_fingerprint) for o in old} == {(0, None)}

        # 1. Before any handshake: refused, nothing loaded.
        before = eng.call("weight_fingerprint")
        with pytest.raises(EngineError, match="no MATCH from the handshake"):
            eng.call("load_weights", str(new_file), expected)
        assert eng.call("weight_fingerprint") == before

        token = secrets.token_hex(16)
        with HandshakeServer({"engine": 1}, token) as server:
            (verdict,) = eng.call("handshake", server.address, token, "run-1")
            assert verdict["outcome"] == "MATCH", verdict
            assert verdict["hash"] == contract.hash

            # 2. A corrupted transfer: fingerprint mismatch, refused, nothing loaded.
            with pytest.raises(EngineError, match="corrupted or partial transfer"):
                eng.call("load_weights", str(new_file), "0" * 64)
            assert eng.call("weight_fingerprint") == before

            # 2b. Transfers that are not the model's own set, each hashed to its own bytes (a
            # trainer that sent the wrong thing, whole): refused by name, nothing loaded.
            first = next(iter(new_weights))
            bad_sets = {
                "missing": {k: v for k, v in new_weights.items() if k != first},
                "the model does not have": {**new_weights, "model.extra.weight": torch.ones(2)},
                "another shape or dtype": {**new_weights, first: new_weights[first][:-1]},
                "another shape or dtype ": {**new_weights, first: new_weights[first].double()},
                "NaN or Inf": {**new_weights, first: new_weights[first].clone().fill_(
                    float("nan"))},
            }  # fmt: skip
            for i, (why, weights) in enumerate(bad_sets.items()):
                f = tmp_path / f"bad{i}.safetensors"
                save_file(weights, str(f))
                digest = WeightFingerprint.of(weights).digest
                with pytest.raises(EngineError, match=rf"{why.strip()}.*nothing loaded"):
                    eng.call("load_weights", str(f), digest)
                assert eng.call("weight_fingerprint") == before, why
            # A body whose header names one tensor twice (safetensors cannot write one; a
            # hand-built or corrupted transfer can): the parser refuses it, nothing loaded.
            twice = tmp_path / "twice.safetensors"
            twice.write_bytes(_name_twice(save(new_weights)))
            with pytest.raises(EngineError, match="invalid offset for tensor"):
                eng.call("load_weights", str(twice), expected)
            assert eng.call("weight_fingerprint") == before
            # NaN is let through only when asked for (a run that wants to see it fail later).
            nan = bad_sets["NaN or Inf"]
            f = tmp_path / "nan.safetensors"
            save_file(nan, str(f))
            nan_fp = WeightFingerprint.of(nan).digest
            assert eng.call("load_weights", str(f), nan_fp, True) == [nan_fp]

            # 3. Cleared: loads, and the engine's live weights hash to the trainer's export.
            assert eng.call("load_weights", str(new_file), expected) == [expected]

        after = eng.generate(prompts, spec)
        reloaded = [o.prompt_logprobs for o in after]
        assert reloaded != old_lps
        # Two gated loads (the NaN one, then this): every completion names what it ran under.
        assert {(o.weights_version, o.weights_fingerprint) for o in after} == {(2, expected)}
    finally:
        eng.close()

    # 4. The reloaded engine scores exactly like a fresh engine built from those weights.
    fresh_dir = tmp_path / "step1"
    fresh = engine_pool(model=str(fresh_dir), isoexec=True, enforce_eager=True)
    assert [o.prompt_logprobs for o in fresh.generate(prompts, spec)] == reloaded
    assert fresh.call("weight_fingerprint") == [expected]
