"""Engine-side per-site tracing: forward hooks on the live vLLM model, only while tracing.

Installed inside the worker (`IsoWorkerExtension.isoexec_trace_start`), removed by
`isoexec_trace_stop`; nothing of it exists otherwise. Sites map to modules with `readback`'s
`_module_path`, the mapping the contract uses.

Token alignment: a vLLM step mixes requests, so the rows of one step are only attributable
when a single request runs. The driver (`EngineProcess.call("trace", …)`) therefore sends the
traced sequences one at a time as prompt-only scoring requests (`max_tokens=1`,
prompt logprobs), so every row is a prefill row of that sequence; its absolute position comes
from the `positions` the model runner passes to the model (chunked prefill continues them).

Per site, what is recorded (the first tensor of a tuple output, as `[T, features]`):
- norms, linears, activation, attention core, experts: the module output. The attention core
  output is `[T, heads*head_dim]`, as the trainer's;
- rope: the rotary module is shared by all layers; the layer comes from a pre-hook on the
  layer's attention module and the row is `cat(q, k)` per token;
- lm_head: `LogitsProcessor` output (the lm head's quant method runs outside any module
  forward). Its input rows are final-norm rows, so each is matched to its position by digest;
- logprobs: added by the driver from the request's prompt logprobs (T=1), one value per
  position 0..n-2 (the logprob of the next prompt token).
Not recorded (no module output of their own): `mlp.router` (routed inside the experts
runner; its effect is recorded at `mlp.experts`), GDN `conv` and `recurrence` (inside the
GDN block).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from isoexec.contract.architectures import text_config
from isoexec.contract.sites import model_sites
from isoexec.contract.trace import UNTRACED_SITES, Trace, digest_rows, first_tensor, rows_2d
from isoexec.vllm.readback import _module_path

SIDE = "engine"


class EngineTracer:
    """Hooks on one vLLM model; `stop()` removes them and returns the trace as a dict."""

    def __init__(
        self,
        model: torch.nn.Module,
        hf_config: Mapping[str, Any],
        dtype: str,
        *,
        store_values: bool = True,
    ) -> None:
        self.trace = Trace.for_model(SIDE, hf_config, dtype)
        self.store_values = store_values
        self.vocab = int(text_config(hf_config)["vocab_size"])
        self.seq: int | None = None
        self.positions: list[int] = []
        self.layer: int | None = None
        self.final_rows: dict[str, list[int]] = {}  # final-norm row digest -> positions
        self.skipped: dict[str, int] = {}
        self._handles: list[Any] = []
        self._install(model, hf_config)

    # ---- hooks ------------------------------------------------------------------------------
    def _install(self, model: torch.nn.Module, hf_config: Mapping[str, Any]) -> None:
        modules = dict(model.named_modules(remove_duplicate=False))
        hook = self._handles.append
        hook(model.register_forward_pre_hook(self._on_model, with_kwargs=True))
        rope_modules: dict[int, torch.nn.Module] = {}
        for site in model_sites(hf_config):
            name = site.name
            rest = name.split(".", 2)[2] if name.startswith("layers.") else name
            if rest in UNTRACED_SITES:
                self.trace.untraced[name] = UNTRACED_SITES[rest]
                continue
            if name == "logprobs":
                continue  # from the request's prompt logprobs (driver)
            if name == "lm_head":
                lp = modules.get("logits_processor")
                if lp is None:
                    self.trace.untraced[name] = "no logits_processor module"
                    continue
                hook(lp.register_forward_hook(self._on_logits))
                continue
            path = _module_path(name)
            mod = modules.get(path)
            if mod is None:
                self.trace.untraced[name] = f"vLLM module {path!r} not found"
                continue
            if rest == "self_attn.rope":
                layer = int(name.split(".")[1])
                attn = modules[path.rsplit(".", 1)[0]]
                hook(attn.register_forward_pre_hook(self._set_layer(layer)))
                rope_modules[id(mod)] = mod
                continue
            hook(mod.register_forward_hook(self._on_site(name)))
        for mod in rope_modules.values():
            hook(mod.register_forward_hook(self._on_rope))

    def _on_model(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        pos = kwargs.get("positions")
        if pos is None and len(args) > 1:
            pos = args[1]
        self.positions = [int(p) for p in pos.reshape(-1).tolist()] if pos is not None else []

    def _set_layer(self, layer: int) -> Callable[..., None]:
        def pre(module: Any, args: Any) -> None:
            self.layer = layer

        return pre

    def _record(self, site: str, out: torch.Tensor | None, positions: list[int]) -> None:
        if self.seq is None or out is None or not positions:
            return
        rows = rows_2d(out, len(positions))
        if rows is None:
            self.skipped[site] = self.skipped.get(site, 0) + 1
            return
        self.trace.record(self.seq, site, positions, rows, store_values=self.store_values)

    def _on_site(self, site: str) -> Callable[..., None]:
        def post(module: Any, args: Any, out: Any) -> None:
            t = first_tensor(out)
            self._record(site, t, self.positions)
            if site == "final_norm" and t is not None and self.seq is not None:
                rows = rows_2d(t, len(self.positions))
                if rows is not None:
                    for d, p in zip(digest_rows(rows), self.positions, strict=True):
                        self.final_rows.setdefault(d, []).append(p)

        return post

    def _on_rope(self, module: Any, args: Any, out: Any) -> None:
        if self.layer is None or not isinstance(out, tuple) or out[1] is None:
            return
        n = len(self.positions)
        q, k = rows_2d(out[0], n), rows_2d(out[1], n)
        if q is None or k is None:
            return
        self._record(
            f"layers.{self.layer}.self_attn.rope", torch.cat([q, k], dim=1), self.positions
        )

    def _on_logits(self, module: Any, args: Any, out: Any) -> None:
        """Logits rows are a selection of final-norm rows: find each one's position."""
        if self.seq is None or not isinstance(out, torch.Tensor) or len(args) < 2:
            return
        hidden = args[1]
        rows, positions = [], []
        for i, d in enumerate(digest_rows(hidden.reshape(hidden.shape[0], -1))):
            for p in self.final_rows.get(d, []):
                rows.append(i)
                positions.append(p)
        if rows:
            logits = out.reshape(out.shape[0], -1)[:, : self.vocab]
            self._record("lm_head", logits[torch.tensor(rows)], positions)

    # ---- session ----------------------------------------------------------------------------
    def begin_sequence(self, seq: int, tokens: list[int]) -> None:
        self.trace.begin_sequence(seq, tokens)
        self.seq = seq
        self.final_rows = {}

    def stop(self) -> dict[str, Any]:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.seq = None
        for site, n in self.skipped.items():
            self.trace.untraced.setdefault(site, f"{n} output(s) not laid out per token")
        return self.trace.to_dict()
