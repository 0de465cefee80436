"""A small GRPO loop with IsoExec: the engine samples, the trainer learns, weights sync each step.

Toy task with a verifiable reward: a completion earns the fraction of its tokens that fall in
the "low band" (token id < vocab/8). Each step: the engine (real vLLM, own process) samples G
completions per prompt; the trainer (real Megatron) computes group-normalised advantages and
the clipped policy loss with ratios against the engine's logprobs; one optimizer step; the
weights are exported, fingerprinted and loaded into the engine behind the handshake gate, and
both sides' numeric canaries of the new weights must MATCH before the engine samples again.

With IsoExec the ratio before the update is exactly 1.0 for every token; the stock arm logs
its spread. Run:  python examples/grpo_toy.py [--arm isoexec|stock] [--steps 8] [--async 1]

`--async 1` is off-by-one asynchronous RL (as AReaL, SkyRL's async trainer, slime): the engine
samples batch k+1 while the trainer steps on batch k, so batch k+1 was sampled under weights
one version older than the trainer's. Every completion names its weights version; the trainer
scores it under that version's weights (kept until no batch needs them) and logs how far the
engine's logprobs are from that (exactly 0 with IsoExec), then the importance ratio
π_θ/π_behaviour against them (exact, because the behaviour logprobs are) and the staleness.
"""

from __future__ import annotations

import argparse
import json
import secrets
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from isoexec.contract.fingerprint import WeightFingerprint
from isoexec.handshake.server import HandshakeServer
from isoexec.megatron import (
    build_model,
    export_hf_weights,
    load_hf_weights,
    megatron_parallel,
    offer_contract,
    policy_logprobs,
    save_hf_safetensors,
)
from isoexec.megatron.canary import offer_canary
from isoexec.megatron.policy_loss import clipped_policy_loss, per_token, policy_step
from isoexec.tools.tiny_models import make_tiny_model
from isoexec.vllm.engine_process import EngineConfig, EngineProcess, SamplingSpec

CLIP = 0.2


@dataclass(frozen=True)
class GRPORun:
    """One run's settings, built once (from the command line or by a caller) and read by the
    loop: which arm, how long, how large a batch, where files go."""

    arm: str = "isoexec"  # "isoexec" or "stock" (both sides stock)
    steps: int = 8
    out: Path = Path("runs/grpo")
    prompts: int = 4
    group: int = 4  # completions per prompt (GRPO's group)
    max_tokens: int = 8
    lr: float = 2e-2
    seed: int = 1  # the engine's sampling seed
    asynchronous: int = 0  # 1: sample batch k+1 while the trainer steps on batch k

    def __post_init__(self) -> None:
        if self.arm not in ("isoexec", "stock"):
            raise ValueError(f"arm {self.arm!r}: 'isoexec' or 'stock'")
        if self.asynchronous not in (0, 1):
            raise ValueError(f"asynchronous {self.asynchronous}: 0 (in step) or 1 (off by one)")
        if min(self.steps, self.prompts, self.group, self.max_tokens) < 1:
            raise ValueError("steps, prompts, group and max_tokens must be at least 1")

    @property
    def isoexec(self) -> bool:
        return self.arm == "isoexec"


@dataclass(frozen=True)
class StepLog:
    step: int
    mean_reward: float
    tokens: int
    ratio_max_dev: float  # max |π_θ/π_behaviour - 1| before the update
    ratio_exactly_one: bool
    staleness: int = 0  # trainer's weights version minus the one the batch was sampled under
    behaviour_version: int = 0
    # max |engine logprob - trainer's scoring under the behaviour version's weights|
    behaviour_max_diff: float = 0.0


def reward(tokens: list[int], vocab: int) -> float:
    return sum(t < vocab // 8 for t in tokens) / len(tokens)


def run(settings: GRPORun) -> list[StepLog]:
    isoexec, out, prompts, group = settings.isoexec, settings.out, settings.prompts, settings.group
    model_dir = make_tiny_model("tiny-dense", out / "model", seed=3)
    hf = json.loads((model_dir / "config.json").read_text())
    vocab = int(hf["vocab_size"])
    gen = torch.Generator().manual_seed(0)
    base = [torch.randint(vocab, (12,), generator=gen).tolist() for _ in range(prompts)]
    token = secrets.token_hex(16)
    logs: list[StepLog] = []
    engine = None
    with megatron_parallel(), HandshakeServer({"trainer": 1, "engine": 1}, token) as server:
        try:
            engine = EngineProcess(
                EngineConfig(model=str(model_dir), isoexec=isoexec, seed=settings.seed)
            )
            model = build_model(str(model_dir), isoexec=isoexec)
            load_hf_weights(model, str(model_dir))
            opt = torch.optim.AdamW(model.parameters(), lr=settings.lr)
            if isoexec:  # both sides offer at once: the trainer here, the engine's workers there
                addr = server.address
                tv, evs = _both(lambda: offer_contract(model, hf, addr, token, "grpo"),
                                lambda: engine.call("handshake", addr, token, "grpo"))  # fmt: skip
                tv.raise_for_mismatch()
                assert all(v["outcome"] == "MATCH" for v in evs), evs
                _canary(model, engine, server.address, token, version=0)
            sampling = SamplingSpec(max_tokens=settings.max_tokens, temperature=1.0)
            batch = [p for p in base for _ in range(group)]
            held = {0: _snapshot(model)}  # weights per version, while a batch may need them
            scorer = _Scorer(str(model_dir), isoexec)
            ahead = _Ahead(engine, batch, sampling)  # batch 0, under version 0
            for step in range(settings.steps):
                comps, behaviour = ahead.result()
                if isoexec:  # the engine counts its gated loads: it agrees on the version
                    assert {c.weights_version for c in comps} == {behaviour}, behaviour
                if settings.asynchronous and step + 1 < settings.steps:
                    ahead = _Ahead(engine, batch, sampling, version=step)  # engine's weights
                rewards = torch.tensor([reward(c.token_ids, vocab) for c in comps])
                grouped = rewards.view(prompts, group)
                adv = (
                    (grouped - grouped.mean(1, keepdim=True))
                    / (grouped.std(1, keepdim=True) + 1e-6)
                ).view(-1)
                seqs = [c.prompt_token_ids + c.token_ids for c in comps]
                old = torch.cat([torch.tensor(c.logprobs, dtype=torch.float32) for c in comps])
                # The trainer's scoring under the weights the batch was sampled with.
                scored = scorer.score(held[behaviour], comps)
                model.train()
                opt.zero_grad(set_to_none=True)
                lps = policy_logprobs(model, seqs)
                new = torch.cat([lp[-len(c.token_ids) :] for lp, c in zip(lps, comps, strict=True)])
                a = per_token(adv.tolist(), [len(c.token_ids) for c in comps])
                pl = clipped_policy_loss(new, old, a, CLIP)
                dev, loss = pl.ratio_dev_max, pl.loss
                policy_step(model, opt, loss)
                held[step + 1] = _snapshot(model)
                held.pop(behaviour - 1, None)
                logs.append(StepLog(step, float(rewards.mean()), int(new.numel()), dev, dev == 0.0,
                                    step - behaviour, behaviour,
                                    float((scored - old).abs().max())))  # fmt: skip
                print(json.dumps(asdict(logs[-1])), flush=True)
                if settings.asynchronous and step + 1 < settings.steps:
                    ahead.wait()  # the engine finishes batch k+1 before it takes new weights
                # weight sync: export, fingerprint, load behind the gate (stock arm: no gate)
                path = out / f"step{step}.safetensors"
                save_hf_safetensors(model, path)
                digest = WeightFingerprint.of(export_hf_weights(model)).digest
                if isoexec:
                    assert engine.call("load_weights", str(path), digest) == [digest]
                    _canary(model, engine, server.address, token, version=step + 1)
                elif step + 1 < settings.steps:  # stock vLLM has no gate: restart it on the
                    engine.close()  # new checkpoint (not after the last step: nothing samples)
                    engine = EngineProcess(
                        EngineConfig(model=str(_checkpoint(model_dir, path)), seed=settings.seed)
                    )
                if not settings.asynchronous and step + 1 < settings.steps:
                    ahead = _Ahead(engine, batch, sampling, version=step + 1)
        finally:
            if engine is not None:
                engine.close()
    return logs


class _Ahead:
    """One batch sampled in a background thread (the engine's own process does the work), and
    the weights version the engine held for it."""

    def __init__(self, engine: Any, batch: list[list[int]], sampling: Any, version: int = 0):
        self.version = version
        self._got: dict[str, Any] = {}
        self._thread = threading.Thread(
            target=self._run, args=(engine, batch, sampling), daemon=True
        )
        self._thread.start()

    def _run(self, engine: Any, batch: list[list[int]], sampling: Any) -> None:
        try:
            self._got["comps"] = engine.generate(batch, sampling)
        except Exception as e:  # re-raised by wait(), in the loop's thread
            self._got["error"] = e

    def wait(self) -> None:
        self._thread.join()
        if "error" in self._got:
            raise self._got["error"]

    def result(self) -> tuple[list[Any], int]:
        self.wait()
        return self._got["comps"], self.version


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class _Scorer:
    """A second model for the trainer's scoring of a batch under the weights it was sampled
    with (older than the trainer's by the staleness)."""

    def __init__(self, model_dir: str, isoexec: bool) -> None:
        self.model = build_model(model_dir, isoexec=isoexec)

    @torch.no_grad()
    def score(self, weights: dict[str, torch.Tensor], comps: list[Any]) -> torch.Tensor:
        for n, p in self.model.named_parameters():
            p.copy_(weights[n])
        self.model.train()  # as the policy's own scoring
        lps = policy_logprobs(self.model, [c.prompt_token_ids + c.token_ids for c in comps])
        return torch.cat([lp[-len(c.token_ids) :] for lp, c in zip(lps, comps, strict=True)])


def _both(trainer: Callable[[], Any], engine: Callable[[], Any]) -> tuple[Any, Any]:
    """The trainer's call in a daemon thread while the engine's runs here (an engine error
    surfaces at once; the trainer's pending offer ends with the service); both results."""
    got: dict[str, Any] = {}

    def run() -> None:
        try:
            got["ok"] = trainer()
        except Exception as e:  # re-raised below, in the caller's thread
            got["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    e = engine()
    t.join()
    if "error" in got:
        raise got["error"]
    return got["ok"], e


def _canary(model: Any, engine: Any, address: str, token: str, version: int) -> None:
    """Both sides score the run's probe under the weights they now hold; refuse on a MISMATCH."""
    t, e = _both(lambda: offer_canary(model, address, token, "grpo", version),
                 lambda: engine.call("canary", address, token, "grpo", version))  # fmt: skip
    if not (t.matched and e["matched"]):
        raise RuntimeError(f"weights version {version}: {e['summary']}")


def _checkpoint(model_dir: Path, weights: Path) -> Path:
    """An HF checkpoint dir (the original config + the exported weights)."""
    import shutil

    ckpt = weights.with_suffix("")
    ckpt.mkdir(exist_ok=True)
    shutil.copy(model_dir / "config.json", ckpt / "config.json")
    shutil.copy(weights, ckpt / "model.safetensors")
    return ckpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", choices=("isoexec", "stock"), default="isoexec")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument("--async", dest="asynchronous", type=int, choices=(0, 1), default=0,
                    help="1: sample batch k+1 while the trainer steps on batch k")  # fmt: skip
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="grpo-"))
    out.mkdir(parents=True, exist_ok=True)
    logs = run(GRPORun(arm=args.arm, steps=args.steps, out=out, asynchronous=args.asynchronous))
    (out / "grpo_log.json").write_text(json.dumps([asdict(x) for x in logs], indent=2))


if __name__ == "__main__":
    main()
