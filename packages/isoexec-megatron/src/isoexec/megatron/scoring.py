"""Per-token logprobs from a Megatron `GPTModel`, and one training step on them.

`score` is what the RL trainer compares against the engine's sampled-token logprobs: for a
sequence of token ids t_0..t_{n-1} it returns log p(t_{i+1} | t_0..t_i) for i = 0..n-2, under
`softmax(logits / temperature)` — the distribution the engine sampled from (its
`processed_logprobs`; prompt logprobs are T=1).

- isoexec model (`build_model(isoexec=True)`): sequences are **packed** into one forward
  (token ids concatenated, boundaries as `PackedSeqParams` cu_seqlens), optionally split into
  micro-batches (`max_tokens`) and padded (`pad_to_multiple`, an extra dummy sequence). Every
  op is row-invariant, so a sequence's logprobs are bitwise independent of packing, padding
  and split. Logits are the canonical lm head on every row; logprobs are
  `ops.token_logprobs(logits, next_ids, temperature=T)`, the engine sampler's op, through
  the model's logprobs binding (`logprobs.site_logprobs`).
- native model: one forward per sequence with batch size 1 (Megatron's local
  `DotProductAttention` and its `GatedDeltaNet` refuse packed sequences); fp32 log-softmax +
  gather.

At PP>1 each forward (and `train_step`'s backward) runs through Megatron's pipeline schedule
(`isoexec.megatron.pipeline.run_schedule`), one packed unit per call; every stage returns the
last stage's logprobs. Stages pass hidden states unchanged, so the bits are PP=1's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from isoexec.megatron.expert_parallel_step import check_expert_parallel_step
from isoexec.megatron.logprobs import (
    effective_penalties,
    effective_temperature,
    effective_truncation,
    full_rows,
    full_vocab,
    is_isoexec,
    token_logprobs,
    vocab_size,
)
from isoexec.megatron.packed_forward import adjustments as _adjustments
from isoexec.megatron.packed_forward import model_is_moe as _model_is_moe
from isoexec.megatron.packed_forward import packed_logprobs
from isoexec.megatron.packed_forward import pipelined as _pipelined
from isoexec.megatron.packing import split_into_packs
from isoexec.megatron.pipeline import broadcast_from_last_stage, run_schedule
from isoexec.megatron.unit_gradients import unit_gradients
from isoexec.ops.penalties import Penalties, RowAdjustments
from isoexec.ops.truncation import Truncation

TokenSeq = Sequence[int] | torch.Tensor


def _as_ids(seq: TokenSeq, vocab_size: int) -> torch.Tensor:
    ids = seq.detach().to("cpu") if isinstance(seq, torch.Tensor) else torch.tensor(list(seq))
    if ids.dim() != 1:
        raise ValueError(f"a sequence must be 1-D token ids, got shape {tuple(ids.shape)}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"token ids must be integers, got {ids.dtype}")
    if ids.numel() == 0:
        raise ValueError("empty sequence")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"token id out of range [0, {vocab_size}): {ids.tolist()}")
    return ids.to(torch.int64)


def _check_equal_forwards_over_ep(model: torch.nn.Module, forwards: int) -> None:
    """At EP>1 every MoE layer forward is a collective over the EP group: refuse (on every
    rank alike) a call whose ranks would run different numbers of forwards, which would hang."""
    from megatron.core import parallel_state as ps

    if not _model_is_moe(model) or not ps.model_parallel_is_initialized():
        return
    if ps.get_expert_model_parallel_world_size() == 1:
        return
    counts: list[int] = [0] * ps.get_expert_model_parallel_world_size()
    torch.distributed.all_gather_object(
        counts, forwards, group=ps.get_expert_model_parallel_group()
    )
    if len(set(counts)) > 1:
        raise ValueError(
            f"score at EP>1: the expert-parallel ranks would run {counts} forwards; every "
            "rank must run as many (same number of packs, or of sequences for native models)"
        )


def _forward_logprobs(
    model: torch.nn.Module,
    ids: torch.Tensor,
    temperature: float,
    trunc: Truncation | None = None,
    rows: bool = False,
    adjust: RowAdjustments | None = None,
) -> torch.Tensor:
    """Native path: one sequence, batch size 1, Megatron's default causal mask."""
    device = next(model.parameters()).device
    input_ids = ids.to(device).unsqueeze(0)  # [1, n]
    position_ids = torch.arange(ids.numel(), device=device).unsqueeze(0)
    inputs = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": None}

    def logprobs(logits: torch.Tensor) -> torch.Tensor:  # [1, n, V]
        logits = full_vocab(model, logits)[0]
        if rows:
            return full_rows(logits, temperature, trunc, adjust)
        return token_logprobs(logits, input_ids[0], temperature, trunc, adjust)

    if not _pipelined(model):
        return logprobs(model(**inputs))
    lp = run_schedule(
        model, inputs, ids.numel(), lambda lg: (lg.sum() * 0, logprobs(lg)), forward_only=True
    )
    return broadcast_from_last_stage(lp)


def _one(prompt_len: int | None) -> list[int] | None:
    return None if prompt_len is None else [prompt_len]


def score(
    model: torch.nn.Module,
    sequences: Sequence[TokenSeq],
    temperature: float = 1.0,
    *,
    max_tokens: int | None = None,
    pad_to_multiple: int | None = None,
    truncation: Truncation | None = None,
    full_vocab: bool = False,
    penalties: Penalties | None = None,
    prompt_lens: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """Per-token logprobs (fp32, length n-1) of each sequence at `temperature`; no gradients,
    eval mode (restored afterwards). `truncation`: the top-k / top-p / min-p the sequences
    were sampled with; the logprobs are then renormalised over each position's kept set.
    `penalties`: the penalties, logit bias and allowed tokens they were sampled with, applied
    before temperature from each position's history; `prompt_lens[i]` is where sequence i's
    sampled tokens begin (needed for the penalties).
    `full_vocab`: each position's whole processed row instead ([n-1, V], -inf outside the
    kept set), for KL and entropy terms; what an engine returns with logprobs=-1.

    isoexec model: packed forwards of at most `max_tokens` tokens (default: all in one), each
    padded to a multiple of `pad_to_multiple`; the bits do not depend on either. A temperature
    below vLLM's sampling epsilon is greedy, scored at T=1 like the engine does. The native
    path scores one sequence per forward and refuses the packing options.
    """
    vocab = vocab_size(model)
    all_ids = [_as_ids(s, vocab) for s in sequences]
    t = effective_temperature(temperature, model)
    trunc = effective_truncation(truncation, temperature, model)
    pens = effective_penalties(penalties, model)
    if prompt_lens is not None and len(prompt_lens) != len(all_ids):
        raise ValueError(f"{len(prompt_lens)} prompt lengths for {len(all_ids)} sequences")
    iso = is_isoexec(model)
    if not iso and (max_tokens is not None or pad_to_multiple is not None):
        raise ValueError("max_tokens / pad_to_multiple pack sequences: isoexec models only")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if not iso:
                _check_equal_forwards_over_ep(model, len(all_ids))
                lens = prompt_lens or [None] * len(all_ids)
                return [
                    _forward_logprobs(
                        model, ids, t, trunc, full_vocab, _adjustments(model, [ids], pens, _one(p))
                    ).cpu()
                    for ids, p in zip(all_ids, lens, strict=True)
                ]
            out: list[torch.Tensor] = [torch.empty(0)] * len(all_ids)
            packs = split_into_packs([int(i.numel()) for i in all_ids], max_tokens)
            _check_equal_forwards_over_ep(model, len(packs))
            for pack in packs:
                lps = packed_logprobs(
                    model,
                    [all_ids[i] for i in pack],
                    t,
                    pad_to_multiple=pad_to_multiple,
                    truncation=trunc,
                    whole_rows=full_vocab,
                    penalties=pens,
                    prompt_lens=None if prompt_lens is None else [prompt_lens[i] for i in pack],
                )
                for i, lp in zip(pack, lps, strict=True):
                    out[i] = lp.cpu()
            return out
    finally:
        model.train(was_training)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    sequences: Sequence[TokenSeq],
    *,
    max_tokens: int | None = None,
    params: Sequence[torch.nn.Parameter] | None = None,
) -> float:
    """One optimizer step on the mean negative logprob over all predicted tokens; returns it.

    `params`: the parameters trained (isoexec models), by default the model's that require
    grad; an adapter's live outside the model (`isoexec.megatron.lora.TrainerLora.parameters`).

    `sequences` is the global batch. isoexec model: packed forwards (micro-batches of <=
    `max_tokens`, the units), each unit's gradient scaled by its share of the tokens, the unit
    gradients summed in `grad_tree`'s fixed tree. Under data parallelism (Megatron's DP group)
    each DP rank computes its own block of units and the tree is finished over DP, so the step
    is bitwise the same at DP=1, 2, 4 in fp32; at EP>1 (the EP group spanning DP) each expert's
    rank sums every unit's expert gradient in the same tree (`expert_parallel_step`), so the
    step is EP=1's bit for bit. Native: one sequence per forward, gradients
    accumulated by autograd, DP>1 not wired. Tensor parallelism is fine on both (Megatron's
    autograd regions reduce what each rank needs).
    """
    from megatron.core import parallel_state as ps

    parallel = ps.model_parallel_is_initialized()
    dp = ps.get_data_parallel_world_size() if parallel else 1
    vocab = vocab_size(model)
    all_ids = [_as_ids(s, vocab) for s in sequences]
    total = sum(ids.numel() - 1 for ids in all_ids)
    if total == 0:
        raise ValueError("train_step needs at least one sequence of >= 2 tokens")
    iso = is_isoexec(model)
    if not iso and (max_tokens is not None or params is not None):
        raise ValueError("max_tokens and params: isoexec models only")
    expert_parallel = (
        parallel and ps.get_expert_model_parallel_world_size() > 1 and _model_is_moe(model)
    )
    if expert_parallel:
        if not iso:
            raise NotImplementedError("train_step at EP>1: isoexec models only")
        check_expert_parallel_step(model)
    if not iso and (dp > 1 or _pipelined(model)):
        raise NotImplementedError(
            "train_step: data and pipeline parallelism for native models are not wired"
        )
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    if iso:
        if params is None:
            params = [p for p in model.parameters() if p.requires_grad]
        params = list(params)
        kept = [ids for ids in all_ids if ids.numel() >= 2]
        units = [[kept[i] for i in pack] for pack in split_into_packs(
            [int(i.numel()) for i in kept], max_tokens)]  # fmt: skip

        def unit_loss(_: int, lps: list[torch.Tensor]) -> tuple[torch.Tensor, tuple[float, ...]]:
            return -torch.cat(lps).sum() / total, ()

        step = unit_gradients(model, params, units, unit_loss)
        grads, loss_sum = step.grads, step.loss_sum
        group = ps.get_data_parallel_group() if dp > 1 else None
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        if dp > 1:
            dev = params[0].device if params else None  # NCCL reduces CUDA tensors only
            total_loss = torch.tensor([loss_sum], dtype=torch.float64, device=dev)
            torch.distributed.all_reduce(total_loss, group=group)
            loss_sum = float(total_loss)
    else:
        for ids in all_ids:
            if ids.numel() < 2:
                continue
            lp = _forward_logprobs(model, ids, 1.0)
            loss = -lp.sum() / total
            loss.backward()
            loss_sum += float(loss.detach())
    sum_qk_norm_grads_over_tp(model)
    optimizer.step()
    return loss_sum


def sum_qk_norm_grads_over_tp(model: torch.nn.Module) -> None:
    """Sum the q/k norm weight gradients over the TP group (no-op at TP=1).

    Why: the q/k norm weights [head_dim] are replicated, but each TP rank applies them to its
    own heads only, so after backward each rank holds a partial gradient. Megatron leaves this
    reduction to its training loop (`finalize_model_grads`, which sums every parameter named
    `q_layernorm`/`k_layernorm` over TP); `train_step` has no such loop and does it here. A
    training loop that calls Megatron's `finalize_model_grads` must not call this too. (The
    GDN output norm, also shared by heads, reduces its gradient in autograd instead:
    `gdn.IsoGatedRMSNorm`, which `finalize_model_grads` does not know.)
    """
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() == 1:
        return
    grads = [
        p.grad
        for name, p in model.named_parameters()
        if p.grad is not None and ("q_layernorm" in name or "k_layernorm" in name)
    ]
    for g in grads:
        torch.distributed.all_reduce(g, group=ps.get_tensor_model_parallel_group())


__all__ = [
    "TokenSeq",
    "is_isoexec",
    "packed_logprobs",
    "policy_logprobs",
    "score",
    "sum_qk_norm_grads_over_tp",
    "token_logprobs",
    "train_step",
]


def policy_logprobs(
    model: torch.nn.Module,
    sequences: Sequence[TokenSeq],
    temperature: float = 1.0,
    truncation: Truncation | None = None,
    penalties: Penalties | None = None,
    prompt_lens: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """Per-token logprobs that keep the autograd graph (for policy-gradient losses); the
    sampling settings as in `score`.

    isoexec models: one packed forward through the canonical ops (the same bits as `score`);
    native models: one sequence per forward, Megatron's own path.
    """
    vocab = vocab_size(model)
    ids = [_as_ids(s, vocab) for s in sequences]
    trunc = effective_truncation(truncation, temperature, model)
    pens = effective_penalties(penalties, model)
    temperature = effective_temperature(temperature, model)
    if is_isoexec(model):
        return packed_logprobs(
            model, ids, temperature, truncation=trunc, penalties=pens, prompt_lens=prompt_lens
        )
    lens = prompt_lens or [None] * len(ids)
    return [
        _forward_logprobs(model, i, temperature, trunc, False,
                          _adjustments(model, [i], pens, _one(p)))
        for i, p in zip(ids, lens, strict=True)
    ]  # fmt: skip
