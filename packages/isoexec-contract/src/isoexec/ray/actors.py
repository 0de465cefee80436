"""The actor classes: the handshake service, one trainer rank, one engine.

Plain classes: `isoexec.ray.run` makes them Ray actors with the resources, placement and
restart policy of the run. Each runs where Ray puts it and reads nothing from another node's
disk: the model comes from a path every node has or is made on the node (a tiny preset, the
same bits from the same seed), TLS material arrives as bytes, weights through the object store.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch

import ray
from isoexec.contract.options import IsoExecOptions
from isoexec.ray.identity import RuntimeIdentity
from isoexec.ray.tls import TLSMaterial
from isoexec.ray.weights import DEFAULT_CHUNK_BYTES, WeightManifest, fetch, publish


@dataclass(frozen=True)
class ModelSource:
    """A checkpoint directory present on every node, or a tiny preset each node makes for
    itself (`isoexec.tools.tiny_models`, deterministic in `seed`)."""

    path: str | None = None
    preset: str | None = None
    seed: int = 3

    def __post_init__(self) -> None:
        if (self.path is None) == (self.preset is None):
            raise ValueError("ModelSource: give a checkpoint path or a tiny preset, not both")

    def materialise(self) -> str:
        if self.path is not None:
            if not os.path.isfile(os.path.join(self.path, "config.json")):
                raise FileNotFoundError(
                    f"{self.path}: no config.json on node {socket.gethostname()} (a checkpoint "
                    "path must exist on every node that runs a trainer rank or an engine)"
                )
            return self.path
        from isoexec.tools.tiny_models import make_tiny_model

        out = tempfile.mkdtemp(prefix=f"isoexec-{self.preset}-")
        return str(make_tiny_model(self.preset or "", out, seed=self.seed))


@dataclass(frozen=True)
class SideSpec:
    """What both sides are built with; `options` and `isoexec` may differ per side only to
    show a refusal."""

    model: ModelSource
    isoexec: bool = True
    dtype: str = "float32"
    options: IsoExecOptions = field(default_factory=IsoExecOptions)
    enforce_eager: bool = False  # engines in vLLM's default compiled mode unless True


def _tls_dict(tls: TLSMaterial | None) -> dict[str, str | None] | None:
    return None if tls is None else tls.client().to_dict()


class HandshakeActor:
    """The handshake service, bound to this node's address (TLS unless told otherwise)."""

    def __init__(
        self, expected: dict[str, int], token: str, tls: TLSMaterial | None,
        rendezvous_timeout_s: float = 300.0, insecure: bool = False,
    ) -> None:  # fmt: skip
        from isoexec.handshake.server import HandshakeServer

        self.server = HandshakeServer(
            expected, token, host=ray.util.get_node_ip_address(),
            tls=None if tls is None else tls.server(),
            rendezvous_timeout_s=rendezvous_timeout_s, insecure=insecure,
        )  # fmt: skip
        self.server.start()

    def identity(self) -> RuntimeIdentity:
        return RuntimeIdentity.here()

    def address(self) -> str:
        return self.server.address

    def stop(self) -> None:
        self.server.stop()


def _node_id() -> str:
    return str(ray.get_runtime_context().get_node_id())


class TrainerActor:
    """One rank of the trainer's torch.distributed world (gloo on CPU, NCCL on a GPU that Ray
    assigned it)."""

    def __init__(self, spec: SideSpec, rank: int, world: int, lr: float = 2e-2) -> None:
        self.spec, self.rank, self.world, self.lr = spec, rank, world, lr
        self._stack = contextlib.ExitStack()
        self.model: Any = None
        self.pipelined = False

    def identity(self) -> RuntimeIdentity:
        return RuntimeIdentity.here()

    def node(self) -> str:
        return _node_id()

    def endpoint(self) -> tuple[str, int]:
        """This node's address and a free port: rank 0's is the world's rendezvous."""
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), int(s.getsockname()[1])

    def setup(self, master: tuple[str, int], tp: int = 1, pp: int = 1, ep: int = 1) -> int:
        """Join the world, lay out Megatron's parallel groups, build the model and load the
        checkpoint; returns this rank."""
        from isoexec.megatron import build_model, load_hf_weights, megatron_parallel

        os.environ.update(
            MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(self.rank),
            WORLD_SIZE=str(self.world), LOCAL_RANK="0",
        )  # fmt: skip
        # the GPUs Ray gave this rank (its bundle's), not whatever the node has: a CPU rank on
        # a GPU node stays on the CPU, gloo; a GPU rank uses its GPU, NCCL
        device = "cuda" if ray.get_gpu_ids() else "cpu"
        # before joining the world: transformers' save_pretrained writes on rank 0 alone once
        # torch.distributed is up, and each rank makes its own copy of a preset
        self.model_dir = self.spec.model.materialise()
        self._stack.enter_context(megatron_parallel(tp, pp=pp, ep=ep, device=device))
        dtype = getattr(torch, self.spec.dtype)
        self.model = build_model(self.model_dir, isoexec=self.spec.isoexec, tp=tp, dtype=dtype,
                                 options=self.spec.options)  # fmt: skip
        load_hf_weights(self.model, self.model_dir)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.lr)
        self.pipelined = pp > 1
        if self.spec.isoexec and ep > 1 and getattr(self.model.isoexec_arch, "is_moe", False):
            from isoexec.megatron.expert_parallel_step import check_expert_parallel_step

            check_expert_parallel_step(self.model)  # a layout the step cannot take: at build
        return self.rank

    def offer(
        self, address: str, token: str, run_id: str, tls: TLSMaterial | None
    ) -> dict[str, Any]:
        from isoexec.megatron import offer_contract

        client_tls = None if tls is None else tls.client()
        v = offer_contract(self.model, self.model_dir, address, token, run_id, tls=client_tls)
        return {"outcome": v.outcome, "hash": v.contract_hash, "summary": v.summary,
                "diff": list(v.diff)}  # fmt: skip

    def canary(
        self, address: str, token: str, run_id: str, version: int, tls: TLSMaterial | None
    ) -> dict[str, Any]:
        """Score the run's canary probe under the live weights and offer it as this rank for
        weights `version` (every rank must call: the forward is the world's)."""
        from isoexec.megatron.canary import offer_canary

        client_tls = None if tls is None else tls.client()
        v = offer_canary(self.model, address, token, run_id, version, rank=self.rank,
                         tls=client_tls)  # fmt: skip
        return {"matched": v.matched, "summary": v.summary}

    def score(
        self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0,
        truncation: Any = None, penalties: Any = None,
    ) -> list[list[float]]:  # fmt: skip
        """The logprobs of each sequence's tokens after its prompt (every rank must call),
        under the truncation and penalties they were sampled with."""
        from isoexec.megatron import score

        lps = score(self.model, sequences, temperature=temperature, truncation=truncation,
                    penalties=penalties, prompt_lens=prompt_lens)  # fmt: skip
        return [lp[n - 1 :].float().tolist() for lp, n in zip(lps, prompt_lens, strict=True)]

    def train_step(
        self, sequences: list[list[int]], prompt_lens: list[int], old: list[list[float]],
        advantages: list[float], temperature: float = 1.0, clip: float = 0.2,
        pack_tokens: int | None = None,
    ) -> dict[str, float]:  # fmt: skip
        """One clipped policy-gradient step (GRPO's loss) against the engine's logprobs `old`;
        the ratio's deviation before the update is returned with the loss. Every rank gets the
        whole batch. An IsoExec trainer splits it over its DP ranks in packs of `pack_tokens`
        (`policy_train_step`: bitwise the same step at any DP, also at PP>1 and EP>1); a
        stock trainer (the negative control) steps on all of it on every rank, at PP=1."""
        from isoexec.megatron import policy_logprobs
        from isoexec.megatron.policy_loss import (
            clipped_policy_loss,
            per_token,
            policy_step,
            policy_train_step,
        )

        if self.spec.isoexec:
            return policy_train_step(self.model, self.opt, sequences, prompt_lens, old,
                                     advantages, temperature=temperature, clip=clip,
                                     max_tokens=pack_tokens)  # fmt: skip
        if self.pipelined:
            raise NotImplementedError(
                "train_step: a stock (ISOEXEC off) trainer at PP>1 is not wired (its pipelined "
                "forward returns no autograd graph); run the stock arm at PP=1"
            )
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        lps = policy_logprobs(self.model, sequences, temperature=temperature)
        new = torch.cat([lp[n - 1 :] for lp, n in zip(lps, prompt_lens, strict=True)])
        behaviour = torch.tensor([x for row in old for x in row], dtype=new.dtype)
        adv = per_token(advantages, [len(o) for o in old])
        pl = clipped_policy_loss(new, behaviour, adv, clip)
        policy_step(self.model, self.opt, pl.loss)
        self.model.eval()
        return {"loss": float(pl.loss), "ratio_dev_max": pl.ratio_dev_max,
                "ratio_dev_mean": pl.ratio_dev_mean}  # fmt: skip

    def publish_weights(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> WeightManifest:
        """This rank's share of the model into the object store (every rank must call: the
        export gathers); the driver merges the parts (`weights.merge`). At PP=1, EP=1 rank 0
        owns every weight and the other ranks' parts are empty."""
        from isoexec.megatron.whole_model import owned_exports

        return publish(owned_exports(self.model), chunk_bytes)

    def weight_fingerprint(self) -> str:
        """The whole model's fingerprint, every stage and expert (every rank must call)."""
        from isoexec.megatron.whole_model import whole_model_fingerprint

        return whole_model_fingerprint(self.model).digest

    def shutdown(self) -> None:
        self._stack.close()


class EngineActor:
    """One vLLM engine (its own process tree, TP through vLLM's executor), started when the
    actor is (a restarted actor starts a fresh engine, which must offer again)."""

    def __init__(
        self, spec: SideSpec, tensor_parallel_size: int = 1, seed: int = 0, index: int = 0
    ) -> None:
        from isoexec.vllm.engine_process import EngineConfig, EngineProcess

        self.first_rank = index * tensor_parallel_size  # its workers' engine ranks in the run

        self.model_dir = spec.model.materialise()
        self.engine = EngineProcess(EngineConfig(
            model=self.model_dir, dtype=spec.dtype, isoexec=spec.isoexec, options=spec.options,
            tensor_parallel_size=tensor_parallel_size, seed=seed, enforce_eager=spec.enforce_eager,
        ))  # fmt: skip
        self._progress = (0, 0)

    def identity(self) -> RuntimeIdentity:
        return RuntimeIdentity.here()

    def node(self) -> str:
        return _node_id()

    def pid(self) -> int:
        return os.getpid()

    def offer(
        self, address: str, token: str, run_id: str, tls: TLSMaterial | None
    ) -> list[dict[str, Any]]:
        """Every worker of this engine offers its contract (one verdict per worker)."""
        return self.engine.call("handshake", address, token, run_id, _tls_dict(tls),
                                self.first_rank)  # fmt: skip

    def canary(
        self, address: str, token: str, run_id: str, version: int, tls: TLSMaterial | None
    ) -> dict[str, Any]:
        """Score the run's canary probe (in a batch with other requests) and offer it for
        weights `version` as this engine's first worker."""
        return self.engine.call("canary", address, token, run_id, version, _tls_dict(tls),
                                None, self.first_rank)  # fmt: skip

    def generate(self, prompts: list[list[int]], sampling: Any) -> list[Any]:
        return self.engine.generate(prompts, sampling)

    def sync(self, manifest: WeightManifest, timeout_s: float = 300.0) -> list[str]:
        """Fetch the chunks one at a time into the workers' staging, then commit (the gate
        checks MATCH and the fingerprint); a failure drops what was staged."""
        n = len(manifest.chunks)
        self._progress = (0, n)
        try:
            for i, chunk in enumerate(fetch(manifest, timeout_s)):
                self.engine.call("stage_weights", chunk)
                self._progress = (i + 1, n)
            return self.engine.call("commit_weights", manifest.fingerprint)
        except BaseException:
            with contextlib.suppress(Exception):
                self.engine.call("drop_staged")
            raise

    @ray.method(concurrency_group="progress")
    def sync_progress(self) -> tuple[int, int]:
        """(chunks staged, chunks in the manifest) of the latest sync: answered on its own
        thread while `sync` runs (the actor's other methods run one at a time)."""
        return self._progress

    def weight_fingerprint(self) -> list[str]:
        return self.engine.call("weight_fingerprint")

    def gate_status(self) -> list[dict[str, Any]]:
        return self.engine.call("collective_rpc", "isoexec_gate_status")

    def shutdown(self) -> None:
        self.engine.close()


__all__ = ["EngineActor", "HandshakeActor", "ModelSource", "SideSpec", "TrainerActor"]
