"""`isoexec pair`: the main job. Trainer and engine, side by side, on one machine.

The engine (a real vLLM in its own process) samples a mixed batch; the trainer (a real
Megatron-core model in this process) scores exactly the sampled sequences; every sampled
token's logprob is compared bit for bit. Run once with IsoExec on (after the contract
handshake) and once off (the stock arm), and print one table. Needs both sides installed
(`isoexec-megatron` and `isoexec-vllm`), as in the development workspace.

`--backend torch|triton` chooses the canonical kernels of the IsoExec arm on both sides (the
trainer's and the engine's `IsoExecOptions`); `--device cpu|cuda` is where the trainer runs (gloo
or NCCL, built on that device; the engine runs where its vLLM build does, and the contracts
record each side's GEMM library, so a CPU trainer never MATCHes a CUDA engine).
`check_setup` refuses what cannot work before anything starts.

With `--locate`, an IsoExec arm that is not 100% bitwise is traced on both sides afterwards
(same engine, same trainer model, a few of its prompts scored one at a time) and the first
divergent site is printed (`locate_pair`, `isoexec.tools.locate`).
"""

from __future__ import annotations

import argparse
import json
import secrets
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from isoexec.contract.architectures import text_config
from isoexec.ops.penalties import Penalties, PenaltiesError
from isoexec.ops.truncation import Truncation, TruncationError
from isoexec.tools.pair_args import PRESETS, add_parser
from isoexec.tools.pair_lora import LoraArmError, attach_adapter, lora_handshake, lora_rank_for
from isoexec.tools.pair_report import (
    ArmResult,
    FullVocabStats,
    arm_result,
    format_table,
    progress,
    token_temperatures,
    write_plot,
    write_results,
)
from isoexec.tools.pair_setup import (
    BACKENDS,
    DEVICES,
    PairRun,
    PairSetupError,
    arm_settings,
    check_arms,
    check_setup,
    free_device_memory,
    trainer_mode,
)
from isoexec.tools.pair_steps import (
    _group,
    align,
    engine_fingerprint,
    handshake,
    make_prompts,
    sample,
    sample_and_score,
    score_completions,
    score_full_rows,
    weight_fingerprints,
)

# Presets that are another preset plus a random PEFT adapter (`--lora` with a made adapter).
LORA_PRESETS = {"tiny-dense-lora": "tiny-dense"}
TEMPERATURES = (1.0, 0.7)
LOCATE_SEQUENCES = 2  # prompts traced by --locate: a long shared-prefix one and a short one


def run_arm(run: PairRun, *, isoexec: bool, upstream_bi: bool = False) -> ArmResult:
    """One arm of `run`. An engine TP above 1 runs vLLM's executor; a trainer of
    trainer_tp x trainer_pp > 1 scores on a torchrun world of that many ranks (pipeline stages
    through Megatron's schedule), each offering its own contract. With a TP above 1 the
    isoexec arm runs `tp_invariant` on both sides (the only canonical form across TP
    degrees). The backend is the isoexec arm's kernels on both sides; the device is where the
    trainer is built and runs ("cpu": gloo; "cuda": NCCL, one GPU per trainer rank); both are
    checked (`check_setup`) before the engine starts. With `run.lora` (a PEFT adapter
    directory) the isoexec arm attaches it to the trainer, loads it into the engine through the
    adapter gate after MATCH, runs both canaries under it and samples every prompt under it
    (TP=1, the in-process trainer; the stock arm has no trainer LoRA to compare with).
    `upstream_bi`: the stock arm in vLLM's and Megatron-core's own batch-invariant modes."""
    import torch

    from isoexec.megatron import (
        build_model,
        load_hf_weights,
        megatron_parallel,
        trainer_contract,
    )

    check_setup(run.device, run.backend, trainer_ranks=run.trainer_ranks)
    check_arms(["upstream-bi" if upstream_bi else "isoexec" if isoexec else "stock"], run)
    hf_config = json.loads((Path(run.model_dir) / "config.json").read_text())
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[run.dtype]
    vocab = int(text_config(hf_config)["vocab_size"])
    prompts = make_prompts(run.num_prompts, vocab, run.seed)
    temps = [TEMPERATURES[i % len(TEMPERATURES)] for i in range(len(prompts))]
    truncs = None if run.truncation is None else [run.truncation] * len(prompts)
    pens = None if run.penalties is None else [run.penalties] * len(prompts)
    arm = "isoexec" if isoexec else ("upstream-bi" if upstream_bi else "stock")
    lora_rank = None
    if run.lora is not None:
        if not isoexec:
            raise LoraArmError("no stock arm with --lora: stock Megatron-core has no adapter "
                               "layers to score the engine's samples with")  # fmt: skip
        if max(run.engine_tp, run.trainer_ranks) > 1:
            raise LoraArmError("--lora runs the engine and the trainer at TP=1, PP=1")
        lora_rank = lora_rank_for(run.lora)
    options, engine_cfg = arm_settings(
        run, isoexec=isoexec, lora_rank=lora_rank, upstream_bi=upstream_bi
    )
    model_dir, dtype, device, max_tokens = run.model_dir, run.dtype, run.device, run.max_tokens
    locate_dir, lora = run.locate_dir, run.lora
    if run.trainer_ranks > 1:
        if locate_dir is not None:
            raise ValueError("--locate traces an in-process trainer: use --trainer-tp/-pp 1")
        with _started(engine_cfg, arm) as (engine, timings):
            return _torchrun_arm(
                engine, model_dir, dtype, isoexec=isoexec, options=options, tp=run.trainer_tp,
                pp=run.trainer_pp, prompts=prompts, temps=temps, max_tokens=max_tokens,
                timings=timings, device=device, truncation=run.truncation, penalties=run.penalties,
            )  # fmt: skip
    with _started(engine_cfg, arm) as (engine, timings), megatron_parallel(device=device):
        model = build_model(model_dir, isoexec=isoexec, dtype=torch_dtype, options=options)
        load_hf_weights(model, model_dir)
        status, hashes, verdict = "n/a (stock arm)", {}, None
        adapter = None
        if isoexec:
            if lora is not None:
                adapter = attach_adapter(model, lora, engine_cfg.lora[0])
            contract = trainer_contract(model, hf_config, dtype)
            if adapter is None:
                trainer_verdict, engine_verdict = handshake(contract, engine, canary_model=model)
            else:
                trainer_verdict, engine_verdict = lora_handshake(contract, engine, model, adapter)
            hashes = {"trainer": contract.hash, "engine": engine_verdict.get("hash")}
            verdict = engine_verdict["outcome"]
            progress(arm, f"handshake {verdict}")
            trainer_verdict.raise_for_mismatch()
            if engine_verdict["outcome"] != "MATCH" or not engine_verdict["canary"]["matched"]:
                raise RuntimeError(f"engine got {engine_verdict.get('canary', verdict)}")
            progress(arm, engine_verdict["canary"]["summary"])
            status = f"MATCH {contract.hash[:12]}"
        progress(arm, f"sampling {len(prompts)} prompts x {max_tokens} tokens")
        t0 = time.monotonic()
        completions = sample(
            engine, prompts, temps, max_tokens, adapter, truncs, run.full_vocab, pens
        )
        timings["sampling"] = time.monotonic() - t0
        progress(arm, "scoring the sampled sequences on the trainer")
        t0 = time.monotonic()
        with trainer_mode(upstream_bi):
            train, eng = score_completions(model, completions, temps, truncs, penalties=pens)
            rows = (
                score_full_rows(model, completions, temps, truncs, pens) if run.full_vocab else None
            )
        timings["scoring"] = time.monotonic() - t0
        fingerprints = weight_fingerprints(model, engine, adapter if isoexec else None)
        report = None
        if isoexec and locate_dir is not None and not torch.equal(train, eng):
            from isoexec.tools.locate import format_result

            located = locate_pair(engine, model, hf_config, prompts[:LOCATE_SEQUENCES], locate_dir)
            report = format_result(located)
    return arm_result(
        arm, status, train, eng, token_temperatures(completions, temps), contract_hashes=hashes,
        verdict=verdict, weight_fingerprints=fingerprints, timings_s=timings, locate=report,
        full_vocab=None if rows is None else FullVocabStats.of(*rows),
    )  # fmt: skip


class _started:
    """The engine of one arm, started with a progress line and its start time measured."""

    def __init__(self, config: Any, arm: str) -> None:
        self.config, self.arm = config, arm

    def __enter__(self) -> tuple[Any, dict[str, float]]:
        from isoexec.vllm.engine_process import EngineProcess

        log = f", its log in {self.config.log_file}" if self.config.log_file else ""
        progress(self.arm, f"starting the engine (TP={self.config.tensor_parallel_size}{log})")
        t0 = time.monotonic()
        self.engine = EngineProcess(self.config)
        timings = {"engine_start": time.monotonic() - t0}
        progress(self.arm, f"engine ready in {timings['engine_start']:.1f} s")
        return self.engine, timings

    def __exit__(self, *exc: object) -> None:
        self.engine.close()


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
    timings: dict[str, float],
    device: str = "cpu",
    truncation: Truncation | None = None,
    penalties: Penalties | None = None,
) -> ArmResult:
    """The arm with a TP/PP>1 trainer on torchrun: the engine samples; the trainer ranks (isoexec:
    after each rank offered its own contract, beside every engine worker) score the samples.
    The trainer's weight fingerprint is not gathered from the ranks (None in the report)."""
    import tempfile

    from isoexec.handshake.server import HandshakeServer
    from isoexec.megatron.distributed_scoring import score_on_torchrun

    arm = "isoexec" if isoexec else "stock"
    progress(arm, f"sampling {len(prompts)} prompts x {max_tokens} tokens")
    t0 = time.monotonic()
    n = len(temps)
    completions = sample(engine, prompts, temps, max_tokens, None, [truncation] * n,
                         penalties=[penalties] * n)  # fmt: skip
    timings["sampling"] = time.monotonic() - t0
    levels = sorted(set(temps))
    cut = None if truncation is None else asdict(truncation)
    job: dict[str, Any] = {
        "model": model_dir, "dtype": dtype, "tp": tp, "pp": pp, "device": device,
        "isoexec": isoexec, "options": options.to_dict(),
        "groups": [{"temperature": t, "truncation": cut, "seqs": _group(completions, temps, t),
                    "penalties": None if penalties is None else asdict(penalties),
                    "prompt_lens": [len(c.prompt_token_ids)
                                    for c, tc in zip(completions, temps, strict=True) if tc == t]}
                   for t in levels],
    }  # fmt: skip
    status, hashes, outcome = "n/a (stock arm)", {}, None
    progress(arm, f"scoring on a torchrun trainer of {tp * pp} ranks (TP={tp}, PP={pp})")
    t0 = time.monotonic()
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
        outcome = verdict["outcome"]
        progress(arm, f"handshake {outcome}")
        if verdict["outcome"] != "MATCH":
            raise RuntimeError(
                f"handshake {verdict['outcome']}: " + "; ".join(verdict["diff"][:10])
            )
        status = f"MATCH {verdict['hash'][:12]}"
        hashes = {"trainer": verdict["hash"], "engine": (got.get("engine") or [{}])[0].get("hash")}
    timings["scoring"] = time.monotonic() - t0
    scored = dict(zip(levels, result["logprobs"], strict=True))
    train, eng = align(completions, temps, scored)
    fingerprints = {"trainer": None, "engine": engine_fingerprint(engine)}
    return arm_result(
        arm, status, train, eng, token_temperatures(completions, temps), contract_hashes=hashes,
        verdict=outcome, weight_fingerprints=fingerprints, timings_s=timings,
    )  # fmt: skip


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
    from isoexec.contract.trace import Trace
    from isoexec.megatron.trace import trace_trainer
    from isoexec.tools.locate import locate

    out_dir.mkdir(parents=True, exist_ok=True)
    tpath, epath = out_dir / "trainer.trace.json", out_dir / "engine.trace.json"
    trace_trainer(model, hf_config, sequences, store_values=store_values).write(tpath)
    engine.call("trace", [list(s) for s in sequences], str(epath.resolve()), store_values)
    return locate(Trace.read(tpath), Trace.read(epath))


# (import name, distribution to install): what `isoexec pair` needs of each side.
SIDES = (("isoexec.megatron", "isoexec-megatron"), ("megatron.core", "isoexec-megatron"),
         ("isoexec.vllm", "isoexec-vllm[cpu] or isoexec-vllm[cuda]"),
         ("vllm", "isoexec-vllm[cpu] or isoexec-vllm[cuda]"))  # fmt: skip


def missing_sides(sides: tuple[tuple[str, str], ...] = SIDES) -> list[str]:
    """The packages to install before `isoexec pair` can run (empty when both sides are);
    `sides`: other (import name, distribution) pairs (`isoexec bench --no-trainer`)."""
    import importlib.util

    missing: list[str] = []
    for module, dist in sides:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found and dist not in missing:
            missing.append(dist)
    return missing


def _run_named_arm(run: PairRun, arm: str) -> ArmResult:
    """One arm as the CLI asked for it. A stock arm that cannot run (stock vLLM-CPU's own GDN
    kernel takes bf16 and one head width only) is reported in the table, not raised: it is the
    reference, the isoexec arm decides the exit code."""
    from isoexec.vllm.engine_process import EngineError

    try:
        return run_arm(run, isoexec=arm == "isoexec", upstream_bi=arm == "upstream-bi")
    except LoraArmError as e:
        if arm == "isoexec":
            raise
        return ArmResult(arm, "n/a", 0, 0, float("nan"), float("nan"), error=str(e))
    except EngineError as e:
        if arm == "isoexec":
            raise
        last = [line for line in str(e).strip().splitlines() if line.strip()][-1:]
        return ArmResult(arm, "n/a", 0, 0, float("nan"), float("nan"), error=" ".join(last))
    finally:
        free_device_memory(run.device)  # the next arm's engine finds the GPU's memory free


def run(args: argparse.Namespace) -> int:
    missing = missing_sides()
    if missing:
        print(
            "isoexec pair runs a trainer and an engine side by side and needs both sides "
            f"installed; missing: {'; '.join(missing)}",
            flush=True,
        )
        return 2
    try:  # before anything starts (no model made, no engine)
        check_setup(args.device, args.backend, trainer_ranks=args.trainer_tp * args.trainer_pp)
        check_arms(args.arms.split(","), PairRun.from_args(args, ""))
    except (PairSetupError, TruncationError, PenaltiesError) as e:
        print(f"isoexec pair: {e}", flush=True)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.model:
        model_dir = args.model
        if not (Path(model_dir) / "config.json").exists():
            print(f"isoexec pair: {model_dir} has no config.json", flush=True)
            return 2
    else:
        from isoexec.tools.tiny_models import make_tiny_model

        base = LORA_PRESETS.get(args.preset, args.preset)
        model_dir = str(make_tiny_model(base, out / f"{base}-{args.dtype}", dtype=args.dtype))
        if args.preset in LORA_PRESETS and args.lora is None:
            from isoexec.tools.tiny_lora import make_tiny_lora

            args.lora = str(make_tiny_lora(model_dir, out / f"{args.preset}-adapter", seed=1))
    if args.lora is not None and not (Path(args.lora) / "adapter_config.json").exists():
        print(f"isoexec pair: {args.lora} has no adapter_config.json", flush=True)
        return 2
    from isoexec.contract.sites import UnsupportedModelError, architecture

    try:
        architecture(json.loads((Path(model_dir) / "config.json").read_text()))
    except UnsupportedModelError as e:
        print(f"isoexec pair: {e}", flush=True)
        return 2
    if not args.verbose:  # the trainer side's own chatter (Megatron's warnings)
        import logging
        import warnings

        warnings.filterwarnings("ignore")
        logging.getLogger("megatron").setLevel(logging.ERROR)
    settings = PairRun.from_args(args, model_dir)  # one object for the run, its arms and report
    results = [_run_named_arm(settings, arm) for arm in args.arms.split(",")]
    name = args.model or args.preset
    sampling = {} if settings.truncation is None else asdict(settings.truncation)
    if settings.penalties is not None:
        sampling.update({k: v for k, v in asdict(settings.penalties).items() if v})
    if settings.full_vocab:
        sampling["full_vocab"] = True
    table = format_table(name, args.dtype, results, sampling)
    print(table, flush=True)
    if args.locate:
        for r in results:
            if r.arm != "isoexec":
                continue
            if r.locate is None:
                print("locate: the isoexec arm is 100% bitwise, nothing to locate", flush=True)
            else:
                print(f"locate ({out / 'locate'}):\n{r.locate}", flush=True)
    written = write_results(out, name, args.dtype, results, sampling)
    print(f"isoexec pair: results in {written}", flush=True)
    plot = write_plot(out, name, args.dtype, results)
    if plot is None:
        print("isoexec pair: no plot (matplotlib is not installed: isoexec-contract[report])")
    else:
        print(f"isoexec pair: plot in {plot}", flush=True)
    iso = [r for r in results if r.arm == "isoexec"]
    rows_ok = all(r.full_vocab is None or r.full_vocab.rows_bitwise == r.full_vocab.rows
                  for r in iso)  # fmt: skip
    return 0 if rows_ok and all(r.bitwise_equal == r.tokens and r.tokens > 0 for r in iso) else 1


__all__ = [  # the shared steps are re-exported: callers import them from here
    "BACKENDS",
    "DEVICES",
    "PRESETS",
    "ArmResult",
    "PairRun",
    "PairSetupError",
    "add_parser",
    "align",
    "arm_settings",
    "check_setup",
    "handshake",
    "locate_pair",
    "make_prompts",
    "run",
    "run_arm",
    "sample",
    "sample_and_score",
]
