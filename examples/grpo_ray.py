"""The GRPO toy on a Ray cluster: trainer and engine as actors, weights through the object store.

Same task and loss as `examples/grpo_toy.py` (reward: the fraction of completion tokens in the
"low band", id < vocab/8), driven through `isoexec.ray.run.RayRun`. Each step logs what SkyRL
logs for the rollout/trainer mismatch (`policy/rollout_train_logprobs_abs_diff_mean`/`_max`),
the importance ratio's deviation before the update, the reward and the step time.

    python examples/grpo_ray.py                         # a local 2-node cluster (one machine)
    python examples/grpo_ray.py --address HEAD_IP:6379  # an existing cluster (`ray start`)
    python examples/grpo_ray.py --arm stock             # both sides stock: the diff is not 0

With IsoExec the diff and the deviation are exactly 0 at every step. The local cluster's
handshake runs in plaintext (one machine); on a real cluster pass `--tls-dir` holding ca.pem,
server.pem/.key and client.pem/.key whose certificates name the trainer node's address (or
`--insecure` to accept plaintext across the network).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from isoexec.ray.actors import ModelSource, SideSpec
from isoexec.ray.cluster import local_cluster
from isoexec.ray.run import RayRun, RaySpec
from isoexec.ray.tls import TLSMaterial
from isoexec.tools.tiny_models import PRESETS
from isoexec.vllm.engine_types import SamplingSpec

PRESET = "tiny-dense"
VOCAB = int(PRESETS[PRESET]["vocab_size"])


@contextmanager
def cluster(
    address: str | None, trainer_bundle: str | None, engine_bundle: str | None
) -> Iterator[tuple[dict[str, float], dict[str, float]]]:
    """Connect to `address`, or start two raylets here (trainer node, engine node); the
    bundles that place the trainer and the engine (given as JSON, e.g. '{"GPU": 1}')."""
    import ray

    if address is not None:
        ray.init(address=address)
        try:
            yield (
                json.loads(trainer_bundle or '{"CPU": 1}'),
                json.loads(engine_bundle or '{"CPU": 1}'),
            )
        finally:
            ray.shutdown()
        return
    with local_cluster([{"trainer_node": 1}, {"engine_node": 1}]):
        yield {"CPU": 1, "trainer_node": 1}, {"CPU": 1, "engine_node": 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", choices=("isoexec", "stock"), default="isoexec")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--address", default=None, help="an existing Ray cluster (default: local)")
    ap.add_argument("--trainer-bundle", default=None, help='with --address: JSON, e.g. {"GPU": 1}')
    ap.add_argument("--engine-bundle", default=None, help="with --address: JSON")
    ap.add_argument("--tls-dir", default=None)
    ap.add_argument("--insecure", action="store_true", help="plaintext handshake across nodes")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--out", default=None, help="write the step log here as JSON")
    args = ap.parse_args()
    tls = None
    if args.tls_dir:
        d = Path(args.tls_dir)
        tls = TLSMaterial.from_files(*(str(d / n) for n in (
            "ca.pem", "server.pem", "server.key", "client.pem", "client.key")))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    base = [torch.randint(VOCAB, (12,), generator=gen).tolist() for _ in range(args.prompts)]
    sampling = SamplingSpec(max_tokens=args.max_tokens, temperature=1.0)
    logs = []
    with cluster(args.address, args.trainer_bundle, args.engine_bundle) as (
        trainer_bundle,
        engine_bundle,
    ):
        side = SideSpec(ModelSource(preset=PRESET, seed=3), isoexec=args.arm == "isoexec")
        spec = RaySpec(side=side, trainer_bundle=trainer_bundle, engine_bundle=engine_bundle,
                       tls=tls, insecure=args.insecure or args.address is None,
                       run_id="grpo-ray",
                       # stock: no gate to load through, so the weights stay as they start and
                       # the diff below is the kernels' alone
                       lr=2e-2 if side.isoexec else 0.0)  # fmt: skip
        with RayRun(spec) as run:
            if side.isoexec:
                run.handshake()
            for step in range(args.steps):
                t0 = time.perf_counter()
                batch = [p for p in base for _ in range(args.group)]
                comps = run.generate(batch, sampling)
                rewards = torch.tensor([sum(t < VOCAB // 8 for t in c.token_ids)
                                        / len(c.token_ids) for c in comps])  # fmt: skip
                g = rewards.view(args.prompts, args.group)
                adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).view(-1)
                trainer = run.score(comps)
                diff = torch.cat([(torch.tensor(t) - torch.tensor(c.logprobs)).abs()
                                  for t, c in zip(trainer, comps, strict=True)])  # fmt: skip
                stats = run.train_step(comps, adv.tolist())
                if side.isoexec:
                    run.sync_weights()
                logs.append({
                    "step": step,
                    "policy/rollout_train_logprobs_abs_diff_mean": float(diff.mean()),
                    "policy/rollout_train_logprobs_abs_diff_max": float(diff.max()),
                    "ratio_dev_max": stats["ratio_dev_max"],
                    "staleness": stats["staleness"],
                    "reward": float(rewards.mean()),
                    "step_s": round(time.perf_counter() - t0, 2),
                })  # fmt: skip
                print(json.dumps(logs[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(logs, indent=2))


if __name__ == "__main__":
    main()
