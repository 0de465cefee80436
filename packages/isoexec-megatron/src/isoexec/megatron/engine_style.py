"""A trainer IsoExec model driven the way an engine drives its model, without vLLM.

Why: the GPU machine this project is lent has no vLLM, yet the engine's half of the claim
(prefill, then one token per step, attention read from a paged KV cache, the GDN states carried
and updated in place between steps) must be checked on the device. The model's canonical
modules are the engine's ops in the engine's order already (that is what the contract
records), so this swaps in only what an engine does differently:

- attention (`IsoCoreAttention`, in dense, MoE and Qwen3-Next layers): the step's keys and
  values, after RoPE at their absolute positions, are written into a paged cache
  `[num_blocks, block_size, Hkv, D]` through a shuffled block table, and `ops.attention_paged`
  reads the whole prefix from it, as the engine's attention backend does;
- GDN (`IsoGatedDeltaNet`): `ops.gdn_sequence` from the conv and recurrent states the last step
  left, both updated in place, as the engine's GDN core does.

Every other site (norms, GEMMs, MoE, logprobs) runs as in the trainer, each on the step's rows
only. `EngineStyleDecode(model).logprobs(seq, prefill=n)` gives the per-token logprobs an
engine would report for `seq` with its first `n` tokens prefilled at once: bitwise the
trainer's `score` of `seq` when the ops are row- and batch-invariant. The overrides are
per instance and exist only during a `logprobs` call.
"""

from __future__ import annotations

import torch

from isoexec import ops as torch_ops
from isoexec.megatron.attention import IsoCoreAttention
from isoexec.megatron.gdn import IsoGatedDeltaNet
from isoexec.megatron.logprobs import effective_temperature, site_logprobs


class _PagedAttention:
    """One attention layer's paged KV cache and the `_attend` that reads it."""

    def __init__(self, core: IsoCoreAttention, block_table: torch.Tensor, blocks: int, bs: int):
        self.core, self.block_table, self.bs = core, block_table, bs
        self.blocks = blocks
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.pos0 = 0

    def _slots(self, positions: torch.Tensor) -> torch.Tensor:
        blocks = self.block_table[0, positions // self.bs]
        return blocks * self.bs + positions % self.bs

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor):
        """q [T, H, D], k/v [T, Hkv, D] of this step's tokens (one sequence)."""
        if cu.numel() != 2:
            raise ValueError("EngineStyleDecode drives one sequence at a time")
        t, dev = q.shape[0], q.device
        positions = torch.arange(self.pos0, self.pos0 + t, device=dev)
        q, k = self.core.rotary(positions, q, k)
        if self.k_cache is None:
            shape = (self.blocks, self.bs, k.shape[1], k.shape[2])
            # Garbage in unused slots, as a real cache holds: nothing may read them.
            self.k_cache = torch.full(shape, float("nan"), dtype=k.dtype, device=dev)
            self.v_cache = torch.full(shape, float("nan"), dtype=v.dtype, device=dev)
        assert self.v_cache is not None
        slots = self._slots(positions)
        self.k_cache.view(-1, *k.shape[1:])[slots] = k
        self.v_cache.view(-1, *v.shape[1:])[slots] = v
        seq_lens = torch.tensor([self.pos0 + t], dtype=torch.int32, device=dev)
        qsl = torch.tensor([0, t], dtype=torch.int32, device=dev)
        return self.core.ops.attention_paged(
            q, self.k_cache, self.v_cache, self.block_table, seq_lens, qsl, scale=self.core.scale
        )


class _GDNState:
    """One GDN layer's conv and recurrent states and the `core` that carries them."""

    def __init__(self, layer: IsoGatedDeltaNet) -> None:
        self.layer = layer
        self.conv_state: torch.Tensor | None = None
        self.state: torch.Tensor | None = None

    def core(
        self, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, starts: list[int]
    ) -> torch.Tensor:
        if len(starts) != 2:
            raise ValueError("EngineStyleDecode drives one sequence at a time")
        m = self.layer
        conv_w = m.conv1d_weight.view(m.conv_dim, m.kernel)
        o, conv_state, state = torch_ops.gdn_sequence(
            mixed_qkv, conv_w, a, b, m.A_log, m.dt_bias, heads=(m.hk, m.hv, m.kd, m.vd),
            conv_state=self.conv_state, state=self.state,
            conv=m.ops.gdn_conv, recurrence=m.ops.gdn_recurrence,
        )  # fmt: skip
        if self.state is None:
            self.conv_state, self.state = conv_state.clone(), state.clone()
        else:  # in place, as the engine updates its state cache
            self.conv_state.copy_(conv_state)  # type: ignore[union-attr]
            self.state.copy_(state)
        return o.to(mixed_qkv.dtype)


class EngineStyleDecode:
    """`with EngineStyleDecode(model) as d: d.logprobs(seq, prefill=n)` (see the module)."""

    def __init__(self, model: torch.nn.Module, *, block_size: int = 16, seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        self.seed = seed
        self._attn = [m for m in model.modules() if isinstance(m, IsoCoreAttention)]
        self._gdn = [m for m in model.modules() if isinstance(m, IsoGatedDeltaNet)]
        if not self._attn and not self._gdn:
            raise TypeError("EngineStyleDecode drives an IsoExec model (no canonical attention)")
        self._caches: list[_PagedAttention] = []
        self._states: list[_GDNState] = []

    def __enter__(self) -> EngineStyleDecode:
        return self

    def __exit__(self, *exc: object) -> None:
        self._remove()

    def _remove(self) -> None:
        for m in self._attn:
            m.__dict__.pop("_attend", None)
        for g in self._gdn:
            g.__dict__.pop("core", None)

    def _install(self, length: int) -> None:
        """Fresh caches and states for a sequence of `length` tokens, and the overrides."""
        device = next(self.model.parameters()).device
        blocks = -(-length // self.block_size) + 2  # two spare blocks the table never names
        g = torch.Generator().manual_seed(self.seed)
        table = torch.randperm(blocks, generator=g)[: blocks - 2].to(device).unsqueeze(0)
        self._caches = [_PagedAttention(m, table, blocks, self.block_size) for m in self._attn]
        self._states = [_GDNState(m) for m in self._gdn]
        for m, c in zip(self._attn, self._caches, strict=True):
            m._attend = c.attend  # type: ignore[method-assign]
        for m, s in zip(self._gdn, self._states, strict=True):
            m.core = s.core  # type: ignore[method-assign]

    def _step(self, ids: torch.Tensor, pos0: int) -> torch.Tensor:
        """Logits [t, vocab] of `ids` at positions pos0.. (the cache holds the prefix)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        t, dev = ids.numel(), ids.device
        for c in self._caches:
            c.pos0 = pos0
        cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=t, max_seqlen_kv=t
        )
        logits = self.model(
            input_ids=ids.unsqueeze(0),
            position_ids=torch.arange(pos0, pos0 + t, device=dev).unsqueeze(0),
            attention_mask=None,
            packed_seq_params=params,
        )
        return logits[0]

    def logprobs(self, seq: list[int], *, prefill: int, temperature: float = 1.0) -> torch.Tensor:
        """fp32 [len(seq) - 1]: log p(seq[i+1] | seq[:i+1]), the first `prefill` tokens in
        one forward, then one token per forward."""
        if not 1 <= prefill <= len(seq):
            raise ValueError(f"prefill={prefill} must be in 1..{len(seq)}")
        device = next(self.model.parameters()).device
        ids = torch.tensor(seq, dtype=torch.int64, device=device)
        t = effective_temperature(temperature, self.model)
        self._install(len(seq))
        was_training = self.model.training
        self.model.eval()
        rows = []
        try:
            with torch.no_grad():
                rows.append(self._step(ids[:prefill], 0))
                for i in range(prefill, len(seq)):
                    rows.append(self._step(ids[i : i + 1], i))
        finally:
            self._remove()  # outside a call the model is the trainer's, untouched
            self.model.train(was_training)
        logits = torch.cat(rows)[:-1]
        return site_logprobs(self.model, logits, ids[1:], t).cpu()


__all__ = ["EngineStyleDecode"]
