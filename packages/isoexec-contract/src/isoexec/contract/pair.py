"""`isoexec pair`: the main job. Trainer and engine, side by side, on one machine.

The engine (a real vLLM in its own process) samples a mixed batch; the trainer (a real
Megatron-core model in this process) scores exactly the sampled sequences; every sampled
token's logprob is compared bit for bit. Run once with IsoExec on (after the contract
handshake) and once off (the stock arm), and print one table. Needs both sides installed
(`isoexec-megatron` and `isoexec-vllm`), as in the development workspace.

With `--locate`, an IsoExec arm that is not 100% bitwise is traced on both sides afterwards
(same engine, same trainer model, a few of its prompts scored one at a time) and the first
divergent site is printed (`locate_pair`, `isoexec.contract.locate`).
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from isoexec.contract.architectures import text_config

PRESETS = ("tiny-dense", "tiny-moe", "tiny-gdn", "tiny-qwen35", "tiny-qwen35-moe")
TEMPERATURES = (1.0, 0.7)
LOCATE_SEQUENCES = 2  # prompts traced by --locate: a long shared-prefix one and a short one


@dataclass(frozen=True)
class ArmResult:
    arm: str
    handshake: str
    tokens: int
    bitwise_equal: int
    max_abs_diff: float
    max_ratio_dev: float  # max |exp(lp_train - lp_engine) - 1|
    locate: str | None = None  # the `isoexec locate` report, when --locate traced this arm
    error: str | None = None  # the stock arm could not run (e.g. a kernel stock vLLM lacks)

    @property
    def equal_fraction(self) -> float:
        return self.bitwise_equal / self.tokens if self.tokens else 0.0


def make_prompts(num: int, vocab: int, seed: int) -> list[list[int]]:
    """A mixed batch: different lengths, shared prefixes, one long prompt that gets chunked."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(140)]
    prompts = []
    for i in range(num):
        if i % 3 == 0:
            p = shared + [rng.randrange(vocab) for _ in range(rng.randrange(1, 20))]
        elif i % 3 == 1:
            p = [rng.randrange(vocab) for _ in range(rng.randrange(3, 40))]
        else:
            p = [rng.randrange(vocab) for _ in range(rng.randrange(180, 260))]
        prompts.append(p)
    return prompts


def run_arm(
    model_dir: str,
    dtype: str,
    *,
    isoexec: bool,
    num_prompts: int,
    max_tokens: int,
    seed: int,
    locate_dir: Path | None = None,
    engine_tp: int = 1,
    trainer_tp: int = 1,
    trainer_pp: int = 1,
) -> ArmResult:
    """One arm. `engine_tp` > 1 runs the engine at that TP (vLLM's executor); a trainer with
    `trainer_tp` x `trainer_pp` > 1 scores on a torchrun world of that many ranks (pipeline
    stages through Megatron's schedule), each offering its own contract. With a TP above 1 the
    isoexec arm runs `tp_invariant` on both sides (the only canonical form across TP
    degrees)."""
    import torch

    from isoexec.contract.options import IsoExecOptions
    from isoexec.megatron import (
        build_model,
        load_hf_weights,
        megatron_parallel,
        trainer_contract,
    )
    from isoexec.vllm.engine_process import EngineConfig, EngineProcess

    hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    prompts = make_prompts(num_prompts, int(text_config(hf_config)["vocab_size"]), seed)
    temps = [TEMPERATURES[i % len(TEMPERATURES)] for i in range(len(prompts))]
    options = IsoExecOptions(tp_invariant=isoexec and max(engine_tp, trainer_tp) > 1)
    engine_cfg = EngineConfig(
        model=model_dir, dtype=dtype, isoexec=isoexec, seed=seed, max_num_batched_tokens=128,
        options=options, tensor_parallel_size=engine_tp,
        # --locate traces the engine per site: module hooks need eager mode (compiled and eager
        # engines compute the same bits, tests/vllm/test_compiled_engine.py)
        enforce_eager=locate_dir is not None,
    )  # fmt: skip
    if trainer_tp * trainer_pp > 1:
        if locate_dir is not None:
            raise ValueError("--locate traces an in-process trainer: use --trainer-tp/-pp 1")
        with EngineProcess(engine_cfg) as engine:
            return _torchrun_arm(
                engine, model_dir, dtype, isoexec=isoexec, options=options, tp=trainer_tp,
                pp=trainer_pp, prompts=prompts, temps=temps, max_tokens=max_tokens,
            )  # fmt: skip
    with EngineProcess(engine_cfg) as engine, megatron_parallel():
        model = build_model(model_dir, isoexec=isoexec, dtype=torch_dtype, options=options)
        load_hf_weights(model, model_dir)
        status = "n/a (stock arm)"
        if isoexec:
            contract = trainer_contract(model, hf_config, dtype)
            trainer_verdict, engine_verdict = handshake(contract, engine)
            trainer_verdict.raise_for_mismatch()
            if engine_verdict["outcome"] != "MATCH":
                raise RuntimeError(f"engine got {engine_verdict['outcome']}")
            status = f"MATCH {contract.hash[:12]}"
        train, eng = sample_and_score(engine, model, prompts, temps, max_tokens)
        report = None
        if isoexec and locate_dir is not None and not torch.equal(train, eng):
            from isoexec.contract.locate import format_result

            located = locate_pair(engine, model, hf_config, prompts[:LOCATE_SEQUENCES], locate_dir)
            report = format_result(located)
    return _arm_result(isoexec, status, train, eng, report)


def _arm_result(isoexec: bool, status: str, train: Any, eng: Any, report: Any = None) -> ArmResult:
    import torch

    diff = (train - eng).abs()
    ratio_dev = (torch.exp(train.double() - eng.double()) - 1).abs()
    return ArmResult(
        arm="isoexec" if isoexec else "stock",
        handshake=status,
        tokens=int(train.numel()),
        bitwise_equal=int((train == eng).sum()),
        max_abs_diff=float(diff.max()),
        max_ratio_dev=float(ratio_dev.max()),
        locate=report,
    )


def _torchrun_arm(
    engine: Any,
    model_dir: str,
    dtype: str,
    *,
    isoexec: bool,
    options: Any,
    tp: int,
    pp: int,
    prompts: list[list[int]],
    temps: list[float],
    max_tokens: int,
) -> ArmResult:
    """The arm with a TP/PP>1 trainer on torchrun: the engine samples; the trainer ranks (isoexec:
    after each rank offered its own contract, beside every engine worker) score the samples."""
    import tempfile

    from isoexec.contract.handshake.server import HandshakeServer
    from isoexec.megatron.distributed_scoring import score_on_torchrun

    completions = sample(engine, prompts, temps, max_tokens)
    levels = sorted(set(temps))
    job: dict[str, Any] = {
        "model": model_dir, "dtype": dtype, "tp": tp, "pp": pp, "isoexec": isoexec,
        "options": options.to_dict(),
        "groups": [{"temperature": t, "seqs": _group(completions, temps, t)} for t in levels],
    }  # fmt: skip
    status = "n/a (stock arm)"
    if not isoexec:
        result = score_on_torchrun(job, tp * pp)
    else:
        token = secrets.token_hex(16)
        workers = engine.config.tensor_parallel_size
        with (
            tempfile.TemporaryDirectory(prefix="isoexec-pair-") as tmp,
            HandshakeServer({"trainer": tp * pp, "engine": workers}, token) as server,
        ):
            token_file = Path(tmp) / "token"
            token_file.write_text(token)
            job["handshake"] = {
                "address": server.address, "token_file": str(token_file), "run_id": "pair",
            }  # fmt: skip
            got: dict[str, Any] = {}

            def engine_offers() -> None:
                got["engine"] = engine.call("handshake", server.address, token, "pair")

            t = threading.Thread(target=engine_offers, daemon=True)
            t.start()
            result = score_on_torchrun(job, tp * pp)
            t.join(timeout=60)
        verdict = result["verdict"]
        if verdict["outcome"] != "MATCH":
            raise RuntimeError(
                f"handshake {verdict['outcome']}: " + "; ".join(verdict["diff"][:10])
            )
        status = f"MATCH {verdict['hash'][:12]}"
    scored = dict(zip(levels, result["logprobs"], strict=True))
    train, eng = align(completions, temps, scored)
    return _arm_result(isoexec, status, train, eng)


def locate_pair(
    engine: Any,
    model: Any,
    hf_config: dict[str, Any],
    sequences: list[list[int]],
    out_dir: Path,
    *,
    store_values: bool = True,
) -> Any:
    """Trace both sides on `sequences` and return the `LocateResult` (first divergent site).

    Each sequence is scored alone on both sides (prompt-only on the engine), so the rows are
    prefill rows at known absolute positions; traces land in `out_dir` as
    `trainer.trace.json` and `engine.trace.json`, for `isoexec locate` to re-read.
    """
    from isoexec.contract.locate import locate
    from isoexec.contract.trace import Trace
    from isoexec.megatron.trace import trace_trainer

    out_dir.mkdir(parents=True, exist_ok=True)
    tpath, epath = out_dir / "trainer.trace.json", out_dir / "engine.trace.json"
    trace_trainer(model, hf_config, sequences, store_values=store_values).write(tpath)
    engine.call("trace", [list(s) for s in sequences], str(epath.resolve()), store_values)
    return locate(Trace.read(tpath), Trace.read(epath))


def sample(engine: Any, prompts: list[list[int]], temps: list[float], max_tokens: int) -> list[Any]:
    """The engine samples `max_tokens` tokens per prompt, each at its temperature."""
    from isoexec.vllm.engine_process import SamplingSpec

    engine.call("reset_prefix_cache")
    specs = [SamplingSpec(max_tokens=max_tokens, temperature=t) for t in temps]
    return engine.generate(prompts, specs)


def _group(completions: list[Any], temps: list[float], temp: float) -> list[list[int]]:
    """The full sequences (prompt + completion) sampled at `temp`, in order."""
    return [
        c.prompt_token_ids + c.token_ids
        for c, t in zip(completions, temps, strict=True)
        if t == temp
    ]


def align(completions: list[Any], temps: list[float], scored: dict[float, list[Any]]) -> Any:
    """(trainer, engine) fp32 logprobs of every sampled token, in the same order; `scored`
    maps each temperature to the trainer's logprobs of `_group(..., temperature)`."""
    import torch

    train_lps, engine_lps = [], []
    for temp in sorted(set(temps)):
        group = [c for c, t in zip(completions, temps, strict=True) if t == temp]
        for c, lp in zip(group, scored[temp], strict=True):
            train_lps.append(lp[-len(c.token_ids) :].float())
            engine_lps.append(torch.tensor(c.logprobs, dtype=torch.float32))
    return torch.cat(train_lps), torch.cat(engine_lps)


def sample_and_score(
    engine: Any,
    model: Any,
    prompts: list[list[int]],
    temps: list[float],
    max_tokens: int,
) -> tuple[Any, Any]:
    """Engine samples; trainer scores exactly the sampled sequences, each at its temperature.

    Returns (trainer logprobs, engine logprobs) of every sampled token, fp32, aligned.
    """
    from isoexec.megatron import score

    completions = sample(engine, prompts, temps, max_tokens)
    levels = sorted(set(temps))
    scored = {t: score(model, _group(completions, temps, t), temperature=t) for t in levels}
    return align(completions, temps, scored)


def handshake(
    trainer_contract: Any,
    engine: Any,
    run_id: str = "pair",
    *,
    server: Any = None,
    token: str | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Trainer rank 0 and every engine worker (one per engine TP rank) offer their contracts
    concurrently; the service gives one verdict for the run.

    With `server`/`token` the caller's running service is used (it must stay up while weights
    are synced: workers ask it before loading); without, a temporary one is hosted here.
    Returns (trainer verdict, engine verdict: the first worker's that is not MATCH, else
    worker 0's); neither raises on MISMATCH.
    """
    from isoexec.contract.handshake.client import HandshakeClient
    from isoexec.contract.handshake.server import HandshakeServer

    if server is None:
        token = secrets.token_hex(16)
        workers = int(getattr(getattr(engine, "config", None), "tensor_parallel_size", 1))
        with HandshakeServer({"trainer": 1, "engine": workers}, token) as own:
            return handshake(trainer_contract, engine, run_id, server=own, token=token)
    assert token is not None
    verdicts: dict[str, Any] = {}

    def offer() -> None:
        with HandshakeClient(server.address, token) as client:
            verdicts["trainer"] = client.offer(run_id, "trainer", 0, trainer_contract)

    # A daemon thread: if the engine fails, its error surfaces now; the trainer's pending
    # offer ends with the service (or its rendezvous deadline), it is not waited for.
    t = threading.Thread(target=offer, daemon=True)
    t.start()
    engine_verdicts = engine.call("handshake", server.address, token, run_id)
    t.join()
    failed = [v for v in engine_verdicts if v["outcome"] != "MATCH"]
    return verdicts["trainer"], (failed or engine_verdicts)[0]


def format_table(model: str, dtype: str, results: list[ArmResult]) -> str:
    head = f"isoexec pair — model {model}, dtype {dtype}"
    rows = [
        f"{'arm':<8} {'handshake':<20} {'tokens':>6} {'bitwise equal':>14} "
        f"{'max |Δ logprob|':>16} {'max |ratio-1|':>14}"
    ]
    for r in results:
        if r.error is not None:
            rows.append(f"{r.arm:<8} failed: {r.error}")
            continue
        rows.append(
            f"{r.arm:<8} {r.handshake:<20} {r.tokens:>6} "
            f"{f'{r.bitwise_equal} ({100 * r.equal_fraction:.1f}%)':>14} "
            f"{r.max_abs_diff:>16.3e} {r.max_ratio_dev:>14.3e}"
        )
    return "\n".join([head, *rows])


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("pair", help="trainer vs engine, bitwise, IsoExec on and off")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a Hugging Face checkpoint directory")
    src.add_argument("--preset", choices=PRESETS, default="tiny-dense")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/pair", help="where the model and results go")
    p.add_argument("--arms", default="isoexec,stock", help="comma list of isoexec,stock")
    p.add_argument(
        "--engine-tp",
        type=int,
        default=1,
        help="the engine's tensor-parallel degree (vLLM's executor); above 1 the isoexec arm "
        "runs tp_invariant on both sides",
    )
    p.add_argument(
        "--trainer-tp",
        type=int,
        default=1,
        help="the trainer's tensor-parallel degree (a torchrun world of that many ranks, each "
        "offering its own contract); above 1 the isoexec arm runs tp_invariant on both sides",
    )
    p.add_argument(
        "--trainer-pp",
        type=int,
        default=1,
        help="the trainer's pipeline-parallel degree (Megatron's schedule; the torchrun world "
        "has trainer-tp x trainer-pp ranks)",
    )
    p.add_argument(
        "--locate",
        action="store_true",
        help="if the isoexec arm is not 100%% bitwise, trace both sides and print the first "
        "divergent site (traces in OUT/locate/)",
    )
    return p


# (import name, distribution to install): what `isoexec pair` needs of each side.
SIDES = (("isoexec.megatron", "isoexec-megatron"), ("megatron.core", "isoexec-megatron"),
         ("isoexec.vllm", "isoexec-vllm[cpu] or isoexec-vllm[cuda]"),
         ("vllm", "isoexec-vllm[cpu] or isoexec-vllm[cuda]"))  # fmt: skip


def missing_sides() -> list[str]:
    """The packages to install before `isoexec pair` can run (empty when both sides are)."""
    import importlib.util

    missing: list[str] = []
    for module, dist in SIDES:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found and dist not in missing:
            missing.append(dist)
    return missing


def _run_named_arm(args: argparse.Namespace, arm: str, model_dir: str, out: Path) -> ArmResult:
    """One arm as the CLI asked for it. A stock arm that cannot run (stock vLLM-CPU's own GDN
    kernel takes bf16 and one head width only) is reported in the table, not raised: it is the
    reference, the isoexec arm decides the exit code."""
    from isoexec.vllm.engine_process import EngineError

    try:
        return run_arm(
            model_dir, args.dtype, isoexec=arm == "isoexec", num_prompts=args.num_prompts,
            max_tokens=args.max_tokens, seed=args.seed,
            locate_dir=out / "locate" if args.locate else None, engine_tp=args.engine_tp,
            trainer_tp=args.trainer_tp, trainer_pp=args.trainer_pp,
        )  # fmt: skip
    except EngineError as e:
        if arm == "isoexec":
            raise
        last = [line for line in str(e).strip().splitlines() if line.strip()][-1:]
        return ArmResult(arm, "n/a", 0, 0, float("nan"), float("nan"), error=" ".join(last))


def run(args: argparse.Namespace) -> int:
    missing = missing_sides()
    if missing:
        print(
            "isoexec pair runs a trainer and an engine side by side and needs both sides "
            f"installed; missing: {'; '.join(missing)}",
            flush=True,
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.model:
        model_dir = args.model
        if not (Path(model_dir) / "config.json").exists():
            print(f"isoexec pair: {model_dir} has no config.json", flush=True)
            return 2
    else:
        from isoexec.contract.tiny_models import make_tiny_model

        model_dir = str(
            make_tiny_model(args.preset, out / f"{args.preset}-{args.dtype}", dtype=args.dtype)
        )
    from isoexec.contract.sites import UnsupportedModelError, architecture

    try:
        architecture(json.loads((Path(model_dir) / "config.json").read_text()))
    except UnsupportedModelError as e:
        print(f"isoexec pair: {e}", flush=True)
        return 2
    results = [_run_named_arm(args, arm, model_dir, out) for arm in args.arms.split(",")]
    table = format_table(args.model or args.preset, args.dtype, results)
    print(table, flush=True)
    if args.locate:
        for r in results:
            if r.arm != "isoexec":
                continue
            if r.locate is None:
                print("locate: the isoexec arm is 100% bitwise, nothing to locate", flush=True)
            else:
                print(f"locate ({out / 'locate'}):\n{r.locate}", flush=True)
    (out / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    iso = [r for r in results if r.arm == "isoexec"]
    return 0 if all(r.bitwise_equal == r.tokens and r.tokens > 0 for r in iso) else 1
