"""One rank of a `torchrun --nproc-per-node N` CPU (gloo) trainer run (conftest: run_tp_jobs).

For every job in the JSON job file: build the model at the job's TP inside
`megatron_parallel(tp)`, load the HF checkpoint, score the sequences, optionally export the
weights and run one training step (`export_after_step`: export the trained weights too), and
(rank 0) save what it got; `plain_gdn_out_proj` swaps in a negative control. TP=1 jobs run in
the same world (then every rank is a data-parallel replica), so one launch gives both sides of
the comparison. The process group is created once here and outlives the per-job parallel states.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")


def plain_gdn_out_proj(model: torch.nn.Module) -> None:
    """Negative control: every GDN layer's out_proj as a stock row-parallel linear would run it,
    the plain `ops.linear` on this rank's K-shard, the rounded partials all-reduced (at TP=1,
    the plain linear on the whole K). Every other site keeps what it was built with."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    from isoexec import ops

    for name, mod in model.named_modules():
        if not name.endswith("self_attention.out_proj"):
            continue

        def forward(x: torch.Tensor, mod: torch.nn.Module = mod) -> tuple[torch.Tensor, None]:
            y = ops.linear(x, mod.weight)
            if mod.tp_group.size() > 1:
                y = reduce_from_tensor_model_parallel_region(y, group=mod.tp_group)
            return y, None

        mod.forward = forward


def naive_dp_train_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, seqs: list[list[int]], max_tokens: int
) -> float:
    """Negative control: data parallelism as a DDP all-reduce does it. Each DP rank takes its
    contiguous half of the packs, autograd accumulates their gradients one after another, and
    the ranks' sums are all-reduced: the addition order of the packs' gradients depends on DP.
    At EP>1 the experts' gradients are not all-reduced (each expert lives on one rank, whose
    backward already summed every rank's tokens), as Megatron's DDP leaves them."""
    from megatron.core import parallel_state as ps

    from isoexec.megatron.packing import split_into_packs as _packs
    from isoexec.megatron.scoring import packed_logprobs

    ids = [torch.tensor(s) for s in seqs]
    total = sum(len(s) - 1 for s in seqs)
    packs = _packs([len(s) for s in seqs], max_tokens)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = -(-len(packs) // dp)
    opt.zero_grad(set_to_none=True)
    for pack in packs[rank * per : (rank + 1) * per]:
        (-torch.cat(packed_logprobs(model, [ids[i] for i in pack])).sum() / total).backward()
    for name, p in model.named_parameters():
        expert = "local_experts." in name and ps.get_expert_model_parallel_world_size() > 1
        if p.grad is not None and dp > 1 and not expert:
            dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
    opt.step()
    return 0.0


def run_job(job: dict, seqs: list[list[int]]) -> dict:
    from isoexec.contract.options import IsoExecOptions
    from isoexec.megatron.model_builder import build_model
    from isoexec.megatron.parallel import megatron_parallel
    from isoexec.megatron.scoring import score, train_step
    from isoexec.megatron.weights import export_hf_weights, load_hf_weights, read_hf_state_dict

    dtype = getattr(torch, job["dtype"])
    out: dict = {}
    with megatron_parallel(job["tp"], pp=job.get("pp", 1), ep=job.get("ep", 1)):
        model = build_model(
            job["model"],
            isoexec=job["isoexec"],
            tp=job["tp"],
            dtype=dtype,
            options=IsoExecOptions.from_mapping(job.get("options")),
            initialize=job.get("initialize", True),
        )
        load_hf_weights(model, job["model"])
        stage = model.isoexec_stage
        out["stage"] = (stage.rank, stage.size, list(stage.layers), len(model.decoder.layers))
        experts = {n.split("local_experts.")[1].split(".")[0] for n, _ in model.named_parameters()
                   if "local_experts." in n}  # fmt: skip
        out["local_experts"] = len(experts)  # routed experts this rank holds (EP splits them)
        if job.get("whole_fingerprint"):  # the whole model's, and this rank's export alone
            from isoexec.contract.fingerprint import WeightFingerprint
            from isoexec.megatron.weights import export_hf_weights
            from isoexec.megatron.whole_model import owned_exports, whole_model_fingerprint

            out["whole_fingerprint"] = whole_model_fingerprint(model).digest
            out["own_export_fingerprint"] = WeightFingerprint.of(export_hf_weights(model)).digest
            owned = [n for n, _ in owned_exports(model)]
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, owned)
            out["owned_by_rank"] = every
        if job.get("plain_gdn_out_proj"):
            plain_gdn_out_proj(model)
        seqs = job.get("seqs", seqs)
        if "seqs_by_rank" in job:  # each rank scores its own sequences (EP: different tokens)
            seqs = job["seqs_by_rank"][dist.get_rank()]
        out["logprobs"] = score(
            model, seqs, job.get("temperature", 1.0), max_tokens=job.get("score_max_tokens")
        )
        if "seqs_by_rank" in job:
            by_rank: list = [None] * dist.get_world_size()
            dist.all_gather_object(by_rank, out["logprobs"])
            out["logprobs_by_rank"] = by_rank
        if job.get("round_trip"):
            ref = read_hf_state_dict(job["model"])
            exported = dict(export_hf_weights(model))
            out["round_trip_exact"] = set(exported) == set(ref) and all(
                torch.equal(exported[k], ref[k].to(exported[k].dtype)) for k in ref
            )
        if job.get("train"):
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            if job.get("naive_dp"):
                out["loss"] = naive_dp_train_step(model, opt, seqs, job["max_tokens"])
            elif job.get("policy"):  # the clipped policy loss against given old logprobs
                from isoexec.megatron.policy_loss import policy_train_step

                pol = job["policy"]
                old = [lp[n - 1 :].tolist() for lp, n in zip(out["logprobs"], pol["prompt_lens"],
                                                               strict=True)]  # fmt: skip
                out["policy"] = policy_train_step(
                    model, opt, seqs, pol["prompt_lens"], old, pol["advantages"],
                    temperature=pol.get("temperature", 1.0), max_tokens=job["max_tokens"],
                )  # fmt: skip
                out["loss"] = out["policy"]["loss"]
            else:
                out["loss"] = train_step(model, opt, seqs, max_tokens=job.get("max_tokens"))
            out["logprobs_after_step"] = score(model, seqs)
            if job.get("export_after_step"):  # HF layout: comparable with a TP=1 step
                out["weights_after_step"] = every_stage_export(model)
            if job.get("save_checkpoint_like"):  # a full checkpoint in the source's layout
                from isoexec.megatron.weights import save_hf_checkpoint

                save_hf_checkpoint(model, job["save_checkpoint_like"], job["model"])
        if job.get("contract"):
            from isoexec.megatron.readback import trainer_contract

            out["contract"] = trainer_contract(model, job["model"]).to_bytes()
        if job.get("handshake"):
            out["verdict"] = offer_from_every_rank(model, job)
    return out


def every_stage_export(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's exported HF weights: each pipeline stage exports its own tensors and
    they are gathered over the pipeline group (one stage's export at PP=1), and each EP rank's
    experts over the EP group."""
    from megatron.core import parallel_state as ps

    from isoexec.megatron.pipeline import gather_over_pipeline
    from isoexec.megatron.weights import export_hf_weights

    out: dict[str, torch.Tensor] = {}
    for part in gather_over_pipeline(dict(export_hf_weights(model))):
        out.update(part)
    ep = ps.get_expert_model_parallel_world_size()
    if ep > 1:  # each EP rank exports its own experts (and the replicated rest)
        parts: list = [None] * ep
        dist.all_gather_object(parts, out, group=ps.get_expert_model_parallel_group())
        for part in parts:
            out.update(part)
    return out


def offer_from_every_rank(model: torch.nn.Module, job: dict) -> dict:
    """Every rank offers its own contract (trainer/<rank>) to the job's handshake service and
    waits for the run's one verdict; `fault_rank` first narrows that rank's attention lanes in
    its last layer (a deliberately changed site on one rank only)."""
    from isoexec.handshake.client import HandshakeClient
    from isoexec.megatron.readback import trainer_contract

    rank = dist.get_rank()
    if job.get("fault_rank") == rank:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration"))
        from _faults import narrow_attention_lanes

        narrow_attention_lanes(model.decoder.layers[-1].self_attention.core_attention)
    hs = job["handshake"]
    contract = trainer_contract(model, job["model"])
    with HandshakeClient(hs["address"], Path(hs["token_file"]).read_text()) as client:
        v = client.offer(hs["run_id"], "trainer", rank, contract)
    return {"outcome": v.outcome, "diff": list(v.diff), "hash": contract.hash}


def main() -> None:
    job_file, out_file = sys.argv[1], sys.argv[2]
    spec = json.loads(open(job_file).read())
    dist.init_process_group("gloo", init_method="env://")
    try:
        results = []
        for job in spec["jobs"]:
            try:
                results.append(run_job(job, spec["seqs"]))
            except Exception as e:  # the test asserts on refusals by message
                if not job.get("expect_error"):
                    raise
                results.append({"error": f"{type(e).__name__}: {e}"})
        if dist.get_rank() == 0:
            torch.save(results, out_file)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
