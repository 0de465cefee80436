"""Per-token logprobs from a Megatron `GPTModel`, and one training step on them.

`score` is what the RL trainer compares against the engine's sampled-token logprobs: for a
sequence of token ids t_0..t_{n-1} it returns log p(t_{i+1} | t_0..t_i) for i = 0..n-2.

Native path for now: one forward per sequence with batch size 1, explicit position ids 0..n-1
and Megatron's default causal mask. Packing (cu_seqlens) is not used: Megatron's local
`DotProductAttention` refuses `packed_seq_params` (only TE's attention supports it); the
canonical IsoExec attention will read packed sequences. The logprob op is log_softmax over the
full vocab row in fp32 + gather, as the engine's canonical `logprobs` op will be.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

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


def _vocab_size(model: torch.nn.Module) -> int:
    vocab = getattr(model, "vocab_size", None)
    if not isinstance(vocab, int):
        raise TypeError("expected a Megatron GPTModel (with .vocab_size)")
    return vocab


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[i+1] | ≤ i) from logits [n, vocab] of positions 0..n-1: fp32 log_softmax + gather.

    Reduces over the contiguous last dim of each row, which is row-invariant on CPU.
    """
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    return logp.gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1)


def _forward_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    tp = getattr(model.config, "tensor_model_parallel_size", 1)
    if tp != 1:
        raise NotImplementedError(
            f"scoring with TP={tp}: vocab-parallel logprobs are not implemented yet"
        )
    device = next(model.parameters()).device
    input_ids = ids.to(device).unsqueeze(0)  # [1, n]
    position_ids = torch.arange(ids.numel(), device=device).unsqueeze(0)
    logits = model(input_ids, position_ids, attention_mask=None)  # [1, n, vocab]
    return token_logprobs(logits[0], input_ids[0])


def score(model: torch.nn.Module, sequences: Sequence[TokenSeq]) -> list[torch.Tensor]:
    """Per-token logprobs (fp32, length n-1) of each sequence; no gradients, eval mode.

    The model's train/eval mode is restored afterwards.
    """
    vocab = _vocab_size(model)
    all_ids = [_as_ids(s, vocab) for s in sequences]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return [_forward_logprobs(model, ids).cpu() for ids in all_ids]
    finally:
        model.train(was_training)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    sequences: Sequence[TokenSeq],
) -> float:
    """One optimizer step on the mean negative logprob over all predicted tokens; returns it.

    Gradients are accumulated sequence by sequence (batch size 1, as in `score`), each scaled by
    its share of the tokens, so the step equals one on the token-mean loss. World size 1 only:
    no data-parallel gradient reduction is done.
    """
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        raise NotImplementedError("train_step: data/tensor parallel gradient sync not implemented")
    vocab = _vocab_size(model)
    all_ids = [_as_ids(s, vocab) for s in sequences]
    total = sum(ids.numel() - 1 for ids in all_ids)
    if total == 0:
        raise ValueError("train_step needs at least one sequence of >= 2 tokens")
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for ids in all_ids:
        if ids.numel() < 2:
            continue
        lp = _forward_logprobs(model, ids)
        loss = -lp.sum() / total
        loss.backward()
        loss_sum += float(loss.detach())
    optimizer.step()
    return loss_sum


__all__ = ["TokenSeq", "score", "token_logprobs", "train_step"]
