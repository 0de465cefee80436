"""Interleaved A/B of engine generation: one live engine per arm, one generate each in turn.

Why: on these shared 2-core machines native's own rate drifts by up to 2x within minutes, so
two `isoexec bench` runs, or one run's three reps per arm, cannot resolve a 10% change. Here
each arm is a worker process holding one in-process vLLM engine (no engine subprocess), built
once; the driver then asks each in turn for one generate of the bench's batch, many rounds,
and reports per-arm medians and the median of the per-round ratios (arm / first arm), which
drift cancels out of.

    python benchmarks/engine_ab.py --family dense --rounds 10 native isoexec ref=/tmp/old

Arms: `native` (ISOEXEC=0), `isoexec` (ISOEXEC=1), `ref=DIR` (ISOEXEC=1 with the packages of
another checkout DIR, e.g. a `git worktree` of an older commit). `--threads N` binds every
engine to N CPUs. Workers are killed with their process groups on any exit of the driver.
They stay in the driver's session: with the kernel's autogroup scheduling (on here), a worker
in a session of its own gets a group's fair share against the running one whenever one of its
idle threads wakes, which measured IsoExec's many short parallel regions 10% slower.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ("isoexec-contract", "isoexec-vllm", "isoexec-megatron")


def worker(family: str, dtype: str, size: str) -> None:
    """One engine; on each `gen` line from stdin, one timed generate: prints `T seconds`."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch

    from isoexec.tools.bench import PROMPT_LEN, SIZES, kv_cache_bytes, make_model
    from isoexec.tools.bench_setup import SIZE_CONFIGS, SIZE_PRESETS, kv_bytes_per_token
    from isoexec.vllm.engine_process import EngineConfig, SamplingSpec, _Handler

    shape = SIZES[size]
    model = Path(f"/tmp/isoexec-ab-{family}-{dtype}-{size}")
    if not model.exists():
        make_model(model, shape["hidden"], shape["layers"], shape["vocab"], family, dtype,
                   dict(SIZE_CONFIGS.get(size, {})), SIZE_PRESETS.get(size))  # fmt: skip
    handler = _Handler(
        EngineConfig(
            model=str(model),
            dtype=dtype,
            isoexec=os.environ.get("ISOEXEC") == "1",
            kv_cache_bytes=kv_cache_bytes(
                shape["prompts"], shape["tokens"], kv_bytes_per_token(model)
            ),
        )
    )
    gen = torch.Generator().manual_seed(0)
    batch = [torch.randint(1000, (PROMPT_LEN,), generator=gen).tolist()
             for _ in range(shape["prompts"])]  # fmt: skip
    handler.generate(batch, SamplingSpec(max_tokens=8))
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "gen":
            break
        handler.llm.reset_prefix_cache()
        start = time.perf_counter()
        handler.generate(batch, SamplingSpec(max_tokens=shape["tokens"], temperature=1.0))
        print(f"T {time.perf_counter() - start:.6f}", flush=True)


def _env(arm: str, threads: int | None) -> dict[str, str]:
    env = dict(os.environ, ISOEXEC="0" if arm == "native" else "1")
    if arm.startswith("ref="):
        root = Path(arm[4:]).resolve()
        env["PYTHONPATH"] = ":".join(str(root / "packages" / p / "src") for p in PACKAGES)
    elif arm not in ("native", "isoexec"):
        raise SystemExit(f"unknown arm {arm!r}: native, isoexec or ref=DIR")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
        cpus = sorted(os.sched_getaffinity(0))[:threads]  # as `isoexec bench --threads`
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
    return env


def _read_line(proc: subprocess.Popen[str], prefix: str) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(prefix):
            return line
    raise RuntimeError(f"a worker ended before printing {prefix!r} (exit {proc.wait()})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("arms", nargs="+", help="native, isoexec, ref=DIR (the first is the base)")
    p.add_argument("--family", default="dense", choices=("dense", "moe", "gdn"))
    p.add_argument("--dtype", default=None, help="default: float32 (gdn: bfloat16)")
    p.add_argument("--size", default="small")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    dtype = a.dtype or ("bfloat16" if a.family == "gdn" else "float32")
    if a.worker:
        worker(a.family, dtype, a.size)
        return
    cmd = [sys.executable, __file__, "--worker", "--family", a.family, "--dtype", dtype,
           "--size", a.size, "x"]  # fmt: skip
    procs: dict[str, subprocess.Popen[str]] = {}
    times: dict[str, list[float]] = {arm: [] for arm in a.arms}
    try:
        for arm in a.arms:  # one at a time: two engines starting at once share 2 cores
            procs[arm] = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True, env=_env(arm, a.threads), process_group=0,
            )  # fmt: skip
            _read_line(procs[arm], "READY")
        for _ in range(a.rounds):
            for arm in a.arms:
                proc = procs[arm]
                assert proc.stdin is not None
                proc.stdin.write("gen\n")
                proc.stdin.flush()
                times[arm].append(float(_read_line(proc, "T ").split()[1]))
    finally:
        for proc in procs.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    base = a.arms[0]
    print(f"{a.family} {dtype} {a.size}, {a.rounds} rounds, threads {a.threads or 'default'}")
    for arm in a.arms:
        ratio = statistics.median(x / y for x, y in zip(times[arm], times[base], strict=True))
        print(f"  {arm:<24} median {statistics.median(times[arm]):.4f} s  "
              f"min {min(times[arm]):.4f} s  {arm}/{base} {ratio:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
