"""Score sequences with a Megatron trainer at TP>1 on a real torchrun world.

`score_on_torchrun(job, nproc)` is what `isoexec pair --trainer-tp N --trainer-pp M` runs
(nproc = N x M): every rank builds its part of the model at the job's TP and PP (a pipeline
stage holds its own layers) and loads the checkpoint; with a handshake in the job, every rank offers
the contract read back from its own model (trainer/<rank>) and waits for the run's verdict;
then the ranks score each group of sequences at its temperature, and rank 0 returns the
logprobs. Run as `python -m isoexec.megatron.distributed_scoring JOB_JSON OUT_PT` by torchrun.

The job (JSON): model, dtype, tp, pp (default 1), device ("cpu": gloo, the default; "cuda": NCCL,
one GPU per rank), isoexec, options (IsoExecOptions mapping), groups
([{"temperature": t, "seqs": [[ids]]}]), and optionally handshake ({"address", "token_file",
"run_id", optional "tls": ClientTLS fields}: the token is read from a file, never from argv).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from isoexec.ops.penalties import Penalties
from isoexec.ops.truncation import Truncation


def score_on_torchrun(
    job: dict[str, Any], nproc: int, *, timeout_s: float = 900.0
) -> dict[str, Any]:
    """Run `job` on an `nproc`-rank torchrun world; rank 0's result (see the module doc)."""
    from isoexec.megatron.torchrun import run_torchrun

    with tempfile.TemporaryDirectory(prefix="isoexec-score-") as tmp:
        job_file, out_file = Path(tmp) / "job.json", Path(tmp) / "out.pt"
        job_file.write_text(json.dumps(job))
        run_torchrun(
            ["-m", "isoexec.megatron.distributed_scoring", str(job_file), str(out_file)],
            nproc,
            env={"ISOEXEC": "0"},
            timeout_s=timeout_s,
        )
        return dict(torch.load(out_file))


def _run(job: dict[str, Any]) -> dict[str, Any]:
    from isoexec.contract.options import IsoExecOptions
    from isoexec.megatron.model_builder import build_model
    from isoexec.megatron.parallel import megatron_parallel
    from isoexec.megatron.scoring import score
    from isoexec.megatron.weights import load_hf_weights

    out: dict[str, Any] = {}
    device = str(job.get("device", "cpu"))
    with megatron_parallel(int(job["tp"]), pp=int(job.get("pp", 1)), device=device):
        model = build_model(
            job["model"], isoexec=bool(job["isoexec"]), tp=int(job["tp"]),
            dtype=getattr(torch, job["dtype"]),
            options=IsoExecOptions.from_mapping(job.get("options")),
        )  # fmt: skip
        load_hf_weights(model, job["model"])
        hs = job.get("handshake")
        if hs:
            from isoexec.handshake.tls import ClientTLS
            from isoexec.handshake.token import read_token_file
            from isoexec.megatron.offer import offer_contract, trainer_rank

            token = read_token_file(hs["token_file"])
            tls = ClientTLS(**hs["tls"]) if hs.get("tls") else None
            v = offer_contract(model, job["model"], hs["address"], token, hs["run_id"],
                               dtype=job["dtype"], tls=tls)  # fmt: skip
            own = [p.contract_hash for p in v.participants
                   if (p.side, p.rank) == ("trainer", trainer_rank())]  # fmt: skip
            out["verdict"] = {"outcome": v.outcome, "diff": list(v.diff),
                              "hash": own[0] if own else v.contract_hash}  # fmt: skip
            if not v.matched:
                return out  # nothing is scored for a run that did not MATCH
        out["logprobs"] = [
            score(model, g["seqs"], temperature=float(g["temperature"]),
                  truncation=Truncation(**g["truncation"]) if g.get("truncation") else None,
                  penalties=_penalties(g.get("penalties")), prompt_lens=g.get("prompt_lens"))
            for g in job["groups"]
        ]  # fmt: skip
    return out


def _penalties(fields: dict[str, Any] | None) -> Penalties | None:
    """A group's penalties from the job's JSON (tuples came back as lists)."""
    if not fields:
        return None
    allowed = fields.get("allowed_token_ids")
    return Penalties(fields["repetition_penalty"], fields["frequency_penalty"],
                     fields["presence_penalty"], tuple((t, b) for t, b in fields["logit_bias"]),
                     None if allowed is None else tuple(allowed))  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    import torch.distributed as dist

    from isoexec.megatron.parallel import device_plan, local_cuda_device

    job_file, out_file = argv or sys.argv[1:]
    job = json.loads(Path(job_file).read_text())
    plan = device_plan(str(job.get("device", "cpu")))  # gloo on the CPU, NCCL on CUDA
    if plan.device == "cuda":
        torch.cuda.set_device(local_cuda_device())  # before NCCL: one device per rank
    dist.init_process_group(plan.backend, init_method="env://")
    try:
        result = _run(job)
        if dist.get_rank() == 0:
            torch.save(result, out_file)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
