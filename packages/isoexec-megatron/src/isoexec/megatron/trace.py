"""Trainer-side per-site tracing: forward hooks on a Megatron `GPTModel`, only while tracing.

`trace_trainer` installs the hooks, scores each sequence alone (so every row is that
sequence's, at absolute position = index), and removes them; a model that is not being traced
runs without any. Sites map to modules with `readback`'s mapping, the one the
contract uses. Rows are laid out as the engine lays them out (`isoexec.vllm.trace`), so equal
maths gives equal digests:

- `[s, b=1, …]` and packed `[T, …]` outputs become `[T, features]`;
- the fused QKV output is put in the engine's `[q; k; v]` column order (Megatron keeps
  columns interleaved per query group) — an exact permutation, for canonical and native;
- rope: the output (q, k) of the core attention's `rotary` module (`IsoRotaryEmbedding`, as
  vLLM's `rotary_emb`); a native model has no RoPE module (Megatron calls
  `apply_rotary_pos_emb`), so that function is wrapped while tracing
  (`patches.rope_calls_wrapped`); the row is `cat(q, k)` per token either way;
- lm_head: logits sliced to the HF vocab (padding columns dropped);
- logprobs: `score(…, temperature=1.0)`, one value per position 0..n-2.
Not recorded: `mlp.router` (the engine routes inside its experts runner, so there is nothing
to compare it with; its effect shows at `mlp.experts`), GDN `conv` / `recurrence` (inside
the GDN block, as on the engine), a native model's experts (Megatron's
`SequentialMLP` works on expert-permuted tokens) and a native model's activation (a function,
not a module).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch

from isoexec.contract.architectures import text_config
from isoexec.contract.sites import model_sites
from isoexec.contract.trace import UNTRACED_SITES, Trace, first_tensor, rows_2d
from isoexec.megatron.hf_config import HFConfigSource, _read_source
from isoexec.megatron.patches import rope_calls_wrapped
from isoexec.megatron.readback import _LAYER_PATHS, _TOP_PATHS

SIDE = "trainer"


class TrainerTracer:
    """Hooks on one Megatron model; use `trace_trainer` rather than this class directly."""

    def __init__(
        self, model: torch.nn.Module, hf_config: dict[str, Any], *, store_values: bool = True
    ) -> None:
        # fp32-pinned parameters (GDN's A_log) do not decide the model dtype, as in the contract
        dtypes = {p.dtype for p in model.parameters() if not getattr(p, "isoexec_keep_fp32", False)}
        dtype = str(next(iter(dtypes))).removeprefix("torch.") if len(dtypes) == 1 else "mixed"
        self.trace = Trace.for_model(SIDE, hf_config, dtype)
        self.store_values = store_values
        self.vocab = int(text_config(hf_config)["vocab_size"])
        self.seq: int | None = None
        self.n = 0
        self.layer: int | None = None
        self.rope: list[torch.Tensor] = []
        self.wrapped_rope = False  # a native model's RoPE function needs wrapping to be seen
        self._handles: list[Any] = []
        self._install(model, hf_config)

    def _install(self, model: torch.nn.Module, hf_config: dict[str, Any]) -> None:
        from isoexec.megatron.canonical_modules import qkv_hf_row_order

        modules = dict(model.named_modules())
        c = model.config  # type: ignore[attr-defined]
        qkv_perm = qkv_hf_row_order(c.num_attention_heads, c.num_query_groups, c.kv_channels)
        hook = self._handles.append
        for site in model_sites(hf_config):
            name = site.name
            if name == "logprobs":
                continue  # from `score`
            if name in _TOP_PATHS:
                mod = modules.get(_TOP_PATHS[name])
                if mod is None:
                    self.trace.untraced[name] = f"Megatron module {_TOP_PATHS[name]!r} not found"
                    continue
                cut = self.vocab if name == "lm_head" else None
                hook(mod.register_forward_hook(self._on_site(name, cols=cut)))
                continue
            _, idx, rest = name.split(".", 2)
            prefix = f"decoder.layers.{idx}"
            if rest in UNTRACED_SITES:
                self.trace.untraced[name] = UNTRACED_SITES[rest]
                continue
            if rest == "self_attn.rope":
                own = modules.get(f"{prefix}.self_attention.core_attention.rotary")
                if own is not None:  # IsoExec: RoPE is a module of its own
                    hook(own.register_forward_hook(self._on_rope(int(idx))))
                    continue
                self.wrapped_rope = True  # native: Megatron's function, wrapped while tracing
                attn = modules.get(f"{prefix}.self_attention")
                if attn is None:
                    self.trace.untraced[name] = "no self_attention module"
                    continue
                hook(attn.register_forward_pre_hook(self._set_layer(int(idx))))
                continue
            if rest == "mlp.act":
                act = getattr(modules.get(f"{prefix}.mlp"), "activation_func", None)
                if not isinstance(act, torch.nn.Module):
                    self.trace.untraced[name] = "activation is a function, not a module"
                    continue
                hook(act.register_forward_hook(self._on_site(name)))
                continue
            path = f"{prefix}.{_LAYER_PATHS.get(rest, '?')}"
            mod = modules.get(path)
            if mod is None:
                self.trace.untraced[name] = f"Megatron module {path!r} not found"
                continue
            if rest == "mlp.experts" and not hasattr(mod, "isoexec_impl"):
                self.trace.untraced[name] = "native experts work on expert-permuted tokens"
                continue
            perm = qkv_perm if rest == "self_attn.qkv_proj" else None
            hook(mod.register_forward_hook(self._on_site(name, perm=perm)))
            if rest == "self_attn.core":
                hook(mod.register_forward_hook(self._flush_rope(int(idx))))

    # ---- hooks ------------------------------------------------------------------------------
    def _record(self, site: str, rows: torch.Tensor | None) -> None:
        if self.seq is None or rows is None:
            return
        self.trace.record(self.seq, site, range(self.n), rows, store_values=self.store_values)

    def _on_site(
        self, site: str, *, perm: torch.Tensor | None = None, cols: int | None = None
    ) -> Callable[..., None]:
        def post(module: Any, args: Any, out: Any) -> None:
            t = first_tensor(out)
            rows = None if t is None else rows_2d(t, self.n)
            if rows is not None and perm is not None:
                rows = rows.index_select(1, perm.to(rows.device))
            if rows is not None and cols is not None:
                rows = rows[:, :cols]
            self._record(site, rows)

        return post

    def _set_layer(self, layer: int) -> Callable[..., None]:
        def pre(module: Any, args: Any, *rest: Any) -> None:
            self.layer = layer
            self.rope = []

        return pre

    def _on_rope(self, layer: int) -> Callable[..., None]:
        def post(module: Any, args: Any, out: Any) -> None:
            q, k = (rows_2d(t, self.n) for t in out)
            if q is not None and k is not None:
                self._record(f"layers.{layer}.self_attn.rope", torch.cat([q, k], dim=1))

        return post

    def _flush_rope(self, layer: int) -> Callable[..., None]:
        def post(module: Any, args: Any, out: Any) -> None:
            captured, self.rope = self.rope, []
            if self.layer != layer or len(captured) != 2:
                return
            q, k = (rows_2d(t, self.n) for t in captured)
            if q is not None and k is not None:
                self._record(f"layers.{layer}.self_attn.rope", torch.cat([q, k], dim=1))

        return post

    def _capture(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = fn(*args, **kwargs)
            if self.seq is not None and self.layer is not None:
                self.rope.append(out.detach())
            return out

        return wrapped

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.seq = None


def trace_trainer(
    model: torch.nn.Module,
    hf_config: HFConfigSource,
    sequences: Sequence[Sequence[int]],
    *,
    store_values: bool = True,
) -> Trace:
    """Per-site trace of `model` scoring each sequence alone (sequence id = its index).

    Sequences are the same token lists the engine traced (`EngineProcess.call("trace", …)`);
    positions are absolute (0 at each sequence start).
    """
    from isoexec.megatron.scoring import score

    cfg = _read_source(hf_config)
    tracer = TrainerTracer(model, cfg, store_values=store_values)
    try:
        wrapped = rope_calls_wrapped(tracer._capture) if tracer.wrapped_rope else nullcontext()
        with wrapped:
            for i, seq in enumerate(sequences):
                ids = [int(t) for t in seq]
                tracer.trace.begin_sequence(i, ids)
                tracer.seq, tracer.n, tracer.layer = i, len(ids), None
                (lp,) = score(model, [ids], temperature=1.0)
                tracer.seq = None
                if lp.numel():
                    tracer.trace.record(
                        i,
                        "logprobs",
                        range(lp.numel()),
                        lp.float().reshape(-1, 1),
                        store_values=store_values,
                    )
    finally:
        tracer.remove()
    return tracer.trace


__all__ = ["TrainerTracer", "trace_trainer"]
