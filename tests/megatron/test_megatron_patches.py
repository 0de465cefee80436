"""`isoexec.megatron.patches`: the RoPE wrapper used while tracing is scoped and version-pinned."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def test_rope_calls_are_wrapped_only_inside_the_block() -> None:
    """A native model's RoPE function is wrapped for a trace and restored after (also on
    error); IsoExec's own RoPE is a module and is never rebound."""
    import megatron.core.transformer.attention as mattn

    from isoexec import ops
    from isoexec.megatron.patches import rope_calls_wrapped

    original, canonical = mattn.apply_rotary_pos_emb, ops.apply_rope
    seen: list[Callable[..., Any]] = []

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        seen.append(fn)
        return lambda *a, **k: fn(*a, **k)

    with pytest.raises(RuntimeError, match="boom"), rope_calls_wrapped(wrap):
        assert mattn.apply_rotary_pos_emb is not original
        assert ops.apply_rope is canonical
        raise RuntimeError("boom")
    assert seen == [original]
    assert mattn.apply_rotary_pos_emb is original  # restored on error
    with rope_calls_wrapped(wrap):  # a second trace inside the first is refused, the first kept
        wrapped = mattn.apply_rotary_pos_emb
        with pytest.raises(RuntimeError, match="already wrapped"), rope_calls_wrapped(wrap):
            pass
        assert mattn.apply_rotary_pos_emb is wrapped
    assert mattn.apply_rotary_pos_emb is original


def test_a_moved_megatron_function_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import megatron.core.transformer.attention as mattn

    from isoexec.megatron.patches import MegatronVersionError, rope_calls_wrapped

    monkeypatch.delattr(mattn, "apply_rotary_pos_emb")
    with pytest.raises(MegatronVersionError, match="apply_rotary_pos_emb is gone"):
        with rope_calls_wrapped(lambda fn: fn):
            pass


SHIM_AND_UNDO = """
import json
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.moe import router
from megatron.core.tensor_parallel import mappings
from isoexec.megatron import cpu_shims
from isoexec.megatron.patches import REGISTRY
objs = lambda: (RotaryEmbedding.get_emb, router.Router.gating, mappings.torch)
before = objs()
names = cpu_shims.apply_cpu_shims()
after = objs()
applied = REGISTRY.applied()
cpu_shims.undo_cpu_shims()
undone = objs()
again = cpu_shims.apply_cpu_shims()
print(json.dumps({"names": names, "applied": applied, "again": again,
                  "changed": [a is not b for a, b in zip(after, before)],
                  "restored": [a is b for a, b in zip(undone, before)],
                  "left": REGISTRY.applied() == applied}))
"""


def test_cpu_shims_are_declared_patches_and_undo_restores_megatron() -> None:
    """In a fresh process: every CPU shim is a declared trainer patch applied through the
    registry; undoing them gives Megatron back its own functions and modules; they apply
    again after an undo."""
    import json
    import subprocess
    import sys

    from isoexec.contract.patch_table import DECLARED
    from isoexec.megatron.cpu_shims import PATCH_OF

    out = subprocess.run([sys.executable, "-c", SHIM_AND_UNDO], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    declared = {e.name for e in DECLARED if e.side == "trainer"}
    assert set(PATCH_OF.values()) <= declared
    assert set(got["applied"]) <= declared and len(got["applied"]) == len(got["names"]) >= 10
    assert got["changed"] == [True, True, True]  # the shims wrote (else this proves nothing)
    assert got["restored"] == [True, True, True]
    assert got["again"] == got["names"] and got["left"]


SCOPED_SHIMS = """
import json, sys
import torch
from isoexec.megatron import build_model, cpu_shims, load_hf_weights, megatron_parallel
from isoexec.megatron.scoring import policy_logprobs
from isoexec.tools.tiny_models import make_tiny_model

out, seqs = {}, [[1, 5, 9, 2, 7, 3], [4, 4, 8]]
with megatron_parallel():
    for preset, dtype in (("tiny-dense", "float32"), ("tiny-moe", "float32"),
                          ("tiny-gdn", "bfloat16")):
        ckpt = make_tiny_model(preset, f"{sys.argv[1]}/{preset}", dtype=dtype, seed=2)
        model = build_model(ckpt, isoexec=True, dtype=getattr(torch, dtype))
        load_hf_weights(model, ckpt)
        lps = policy_logprobs(model, [torch.tensor(s) for s in seqs])
        torch.cat(lps).sum().backward()  # the backward reaches no native-only shim either
        out[preset] = {"ckpt": str(ckpt), "lp": [float(x).hex() for x in torch.cat(lps)]}
    iso_only = cpu_shims.applied_cpu_shims()
    build_model(out["tiny-dense"]["ckpt"], isoexec=False)
    with_native = cpu_shims.applied_cpu_shims()
print(json.dumps({"models": out, "iso_only": iso_only, "with_native": with_native}))
"""


def test_cpu_shims_are_scoped_to_the_native_models(parallel, tmp_path) -> None:
    """In a fresh process that builds, scores and back-propagates IsoExec models (dense, MoE,
    GDN) only the process shims are in force, none of `NATIVE_MODEL_SHIMS`; building a native
    model adds exactly those. The IsoExec logprobs are bitwise those of this process, where
    every shim is in force (the scoping changes no bit)."""
    import json
    import subprocess
    import sys

    import torch

    from isoexec.megatron import build_model, cpu_shims, load_hf_weights
    from isoexec.megatron.scoring import policy_logprobs

    out = subprocess.run([sys.executable, "-c", SCOPED_SHIMS, str(tmp_path)],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    every = {shim.__name__ for shim in cpu_shims._SHIMS}
    assert cpu_shims.NATIVE_MODEL_SHIMS < every
    assert set(got["iso_only"]) == every - cpu_shims.NATIVE_MODEL_SHIMS
    assert set(got["with_native"]) == every
    cpu_shims.apply_cpu_shims()  # all of them, here
    for preset, dtype in (("tiny-dense", "float32"), ("tiny-moe", "float32"),
                          ("tiny-gdn", "bfloat16")):  # fmt: skip
        ckpt = got["models"][preset]["ckpt"]
        model = build_model(ckpt, isoexec=True, dtype=getattr(torch, dtype))
        load_hf_weights(model, ckpt)
        here = torch.cat(
            policy_logprobs(model, [torch.tensor(s) for s in ([1, 5, 9, 2, 7, 3], [4, 4, 8])])
        )
        there = torch.tensor([float.fromhex(x) for x in got["models"][preset]["lp"]])
        assert torch.equal(here.detach().float(), there), preset
