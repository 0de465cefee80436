"""One rank of a TP=2 CPU (gloo) policy-gradient step (tests/megatron/test_policy_loss.py):
prints, on rank 0, which replicated parameters differ between the ranks after the step,
taken with `policy_step` (argv[2] == "policy_step") or a bare backward and step."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from isoexec.contract.options import IsoExecOptions
from isoexec.megatron import build_model, load_hf_weights, megatron_parallel, policy_logprobs
from isoexec.megatron.policy_loss import clipped_policy_loss, per_token, policy_step


def main(model_dir: str, mode: str) -> None:
    with megatron_parallel(2, device="cpu"):
        opts = IsoExecOptions(tp_invariant=True)
        model = build_model(model_dir, isoexec=True, tp=2, dtype=torch.float32, options=opts)
        load_hf_weights(model, model_dir)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
        seqs = [[(7 * i + 3 * j) % 250 + 1 for j in range(10 + i)] for i in range(4)]
        model.train()
        lps = [lp[5:] for lp in policy_logprobs(model, seqs)]
        new = torch.cat(lps)
        adv = per_token([1.0, -1.0, 0.5, -0.5], [len(lp) for lp in lps])
        loss = clipped_policy_loss(new, new.detach() - 0.01, adv).loss
        if mode == "policy_step":
            policy_step(model, opt, loss)
        else:
            loss.backward()
            opt.step()
        differ = []
        for name, p in model.named_parameters():
            if getattr(p, "tensor_model_parallel", False):
                continue
            both = [torch.empty_like(p.data) for _ in range(2)]
            dist.all_gather(both, p.data.contiguous())
            if not torch.equal(both[0], both[1]):
                differ.append(name)
        if dist.get_rank() == 0:
            print("DIFFER " + json.dumps(differ), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], sys.argv[2])
