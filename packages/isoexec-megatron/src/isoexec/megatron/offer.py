"""The trainer's side of the handshake, in one call: read the live model's contract back and
offer it (the mirror of the engine's served handshake, which offers as soon as a worker has
loaded its checkpoint). Used by `isoexec pair`, distributed scoring and the GRPO example."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from isoexec.megatron.readback import trainer_contract

if TYPE_CHECKING:
    from isoexec.handshake.tls import ClientTLS
    from isoexec.handshake.types import Verdict

TRAINER_SIDE = "trainer"


def trainer_rank() -> int:
    """This process's rank in the trainer's world (0 outside torch.distributed)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def trainer_settings(model: torch.nn.Module) -> dict[str, str]:
    """What this rank runs that a canonical contract declares "invariant" (its parallel
    degrees), offered beside the contract and reported in the verdict
    (`isoexec.handshake.side_settings`)."""
    from isoexec.megatron.readback import _parallel_degrees

    tp = getattr(getattr(model, "config", None), "tensor_model_parallel_size", 1)
    pp, ep, dp = _parallel_degrees()
    return {
        "tensor_parallel_size": str(tp),
        "pipeline_parallel_size": str(pp),
        "expert_parallel_size": str(ep),
        "data_parallel_size": str(dp),
    }


def offer_contract(
    model: torch.nn.Module,
    hf_config: Any,
    address: str,
    token: str,
    run_id: str,
    *,
    dtype: torch.dtype | str | None = None,
    rank: int | None = None,
    tls: ClientTLS | None = None,
    timeout_s: float = 600.0,
) -> Verdict:
    """Offer `model`'s contract (read back from the live modules; `hf_config`: the checkpoint
    directory or its config, as for `trainer_contract`) as trainer/`rank` (default: this
    process's rank) for `run_id`; waits for the run's verdict. MISMATCH is returned, not
    raised (`verdict.raise_for_mismatch()` stops)."""
    from isoexec.handshake.client import HandshakeClient

    contract = trainer_contract(model, hf_config, dtype)
    with HandshakeClient(address, token, timeout_s=timeout_s, tls=tls) as client:
        return client.offer(run_id, TRAINER_SIDE, trainer_rank() if rank is None else rank,
                            contract, settings=trainer_settings(model))  # fmt: skip


__all__ = ["offer_contract", "trainer_rank", "trainer_settings"]
