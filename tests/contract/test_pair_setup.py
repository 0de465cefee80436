"""`isoexec pair --backend torch|triton --device cpu|cuda`: the flags, the refusals said before
anything starts, and the chosen backend reaching both sides' options. No engine is started."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from isoexec.contract.options import IsoExecOptions
from isoexec.tools import pair

ISOEXEC = Path(sys.executable).parent / "isoexec"
CMD = [str(ISOEXEC)] if ISOEXEC.exists() else [sys.executable, "-m", "isoexec.tools.cli"]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def _pair(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CMD, "pair", *args], capture_output=True, text=True, timeout=120,
                          env=env)  # fmt: skip


def test_help_lists_backend_and_device() -> None:
    r = _pair("--help")
    assert r.returncode == 0, r.stderr
    assert "--backend {torch,triton}" in r.stdout and "--device {cpu,cuda}" in r.stdout


@NO_CUDA
def test_device_cuda_without_cuda_exits_before_anything_starts(tmp_path: Path) -> None:
    out = tmp_path / "run"
    r = _pair("--device", "cuda", "--out", str(out))
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("isoexec pair: --device cuda: CUDA is not")
    assert not out.exists()  # no model made, no engine started


@NO_CUDA
def test_triton_on_cpu_needs_the_interpreter(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = _pair("--backend", "triton", "--out", str(tmp_path / "run"), env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "TRITON_INTERPRET=1" in r.stdout and "starting the engine" not in r.stdout


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, devices: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: devices > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)


def test_check_setup_decisions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _fake_cuda(monkeypatch, 0)
    pair.check_setup("cpu", "torch")
    with pytest.raises(pair.PairSetupError, match="CUDA is not available"):
        pair.check_setup("cuda", "torch")
    with pytest.raises(pair.PairSetupError, match="TRITON_INTERPRET=1"):
        pair.check_setup("cpu", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pair.check_setup("cpu", "triton")
    with pytest.raises(pair.PairSetupError, match="known"):
        pair.check_setup("tpu", "torch")
    _fake_cuda(monkeypatch, 2)
    pair.check_setup("cuda", "triton", trainer_ranks=2)
    with pytest.raises(pair.PairSetupError, match="3 ranks needs one CUDA device per rank"):
        pair.check_setup("cuda", "torch", trainer_ranks=3)
    with pytest.raises(pair.PairSetupError, match="--device cpu on a machine with CUDA"):
        pair.check_setup("cpu", "torch")


def test_arm_settings_give_both_sides_the_backend() -> None:
    run = pair.PairRun("/m", "bfloat16", seed=3, backend="triton")
    options, engine = pair.arm_settings(run, isoexec=True)
    assert options == IsoExecOptions(backend="triton")
    assert engine.options is options and engine.isoexec and engine.seed == 3
    assert engine.lora is None and not engine.enforce_eager and engine.log_file is None
    tp2 = pair.PairRun("/m", "float32", backend="triton", engine_tp=2)
    options, engine = pair.arm_settings(tp2, isoexec=True, lora_rank=16)
    assert options == IsoExecOptions(tp_invariant=True, backend="triton") == engine.options
    assert engine.lora == (16, 1)
    # the stock arm is stock on both sides, whatever the backend
    options, engine = pair.arm_settings(pair.PairRun("/m", backend="triton"), isoexec=False)
    assert options == IsoExecOptions() == engine.options and not engine.isoexec


def test_pair_run_from_the_cli_arguments(tmp_path: Path) -> None:
    """The CLI's arguments become one `PairRun`: --locate traces in OUT/locate with an eager
    engine, and the engine logs go to OUT unless --verbose."""
    import argparse

    parser = argparse.ArgumentParser()
    pair.add_parser(parser.add_subparsers())
    args = parser.parse_args(["pair", "--out", str(tmp_path), "--locate", "--engine-tp", "2"])
    run = pair.PairRun.from_args(args, "/m")
    assert run.engine_tp == 2 and run.locate_dir == tmp_path / "locate"
    assert run.engine_log("stock") == str(tmp_path / "engine-stock.log")
    assert pair.arm_settings(run, isoexec=True)[1].enforce_eager
    verbose = pair.PairRun.from_args(parser.parse_args(["pair", "--verbose"]), "/m")
    assert verbose.engine_log("isoexec") is None and verbose.locate_dir is None


def test_pair_truncation_arguments_become_the_runs_truncation() -> None:
    """--top-k/--top-p/--min-p: one `Truncation` every prompt is sampled and scored with;
    none given is no truncation; values outside their domain are refused (exit 2, one line)."""
    import argparse

    from isoexec.ops.truncation import Truncation, TruncationError

    parser = argparse.ArgumentParser()
    pair.add_parser(parser.add_subparsers())
    args = parser.parse_args(["pair", "--top-k", "20", "--top-p", "0.95"])
    assert pair.PairRun.from_args(args, "/m").truncation == Truncation(20, 0.95, 0.0)
    assert pair.PairRun.from_args(parser.parse_args(["pair"]), "/m").truncation is None
    with pytest.raises(TruncationError, match="top_p"):
        pair.PairRun.from_args(parser.parse_args(["pair", "--top-p", "0"]), "/m")


def test_pair_penalty_arguments_become_the_runs_penalties() -> None:
    """--repetition/frequency/presence-penalty and --logit-bias: one `Penalties` every prompt
    is sampled and scored with (the bias clamped as vLLM clamps it); none given is None; a
    malformed bias map or a penalty outside its domain is refused."""
    import argparse

    from isoexec.ops.penalties import Penalties, PenaltiesError

    parser = argparse.ArgumentParser()
    pair.add_parser(parser.add_subparsers())
    argv = ["pair", "--repetition-penalty", "1.1", "--presence-penalty", "0.5",
            "--logit-bias", '{"7": 2.0, "3": 500}']  # fmt: skip
    run = pair.PairRun.from_args(parser.parse_args(argv), "/m")
    assert run.penalties == Penalties(1.1, 0.0, 0.5, ((3, 100.0), (7, 2.0)))
    assert pair.PairRun.from_args(parser.parse_args(["pair"]), "/m").penalties is None
    with pytest.raises(PenaltiesError, match="repetition_penalty"):
        pair.PairRun.from_args(parser.parse_args(["pair", "--repetition-penalty", "0"]), "/m")
    with pytest.raises(SystemExit):
        parser.parse_args(["pair", "--logit-bias", "[1, 2]"])


def test_full_vocab_asks_the_engine_for_whole_rows_and_refuses_a_torchrun_trainer() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    pair.add_parser(parser.add_subparsers())
    run = pair.PairRun.from_args(parser.parse_args(["pair", "--full-vocab"]), "/m")
    assert run.full_vocab and pair.arm_settings(run, isoexec=True)[1].max_logprobs == -1
    plain = pair.PairRun.from_args(parser.parse_args(["pair"]), "/m")
    assert pair.arm_settings(plain, isoexec=True)[1].max_logprobs is None
    wide = pair.PairRun.from_args(
        parser.parse_args(["pair", "--full-vocab", "--trainer-tp", "2"]), "/m"
    )
    with pytest.raises(pair.PairSetupError, match="--full-vocab"):
        pair.check_arms(["isoexec"], wide)


def test_greedy_and_raw_scoring_take_no_truncation() -> None:
    """vLLM's SamplingParams drops top-k/top-p/min-p for a greedy request; a raw_logprobs
    engine returns the untruncated row: the trainer's effective truncation is None then."""
    from types import SimpleNamespace

    from isoexec.megatron.logprobs import effective_truncation
    from isoexec.ops.truncation import Truncation

    cut = Truncation(top_k=20, top_p=0.95)
    assert effective_truncation(cut, 0.6) is cut
    assert effective_truncation(cut, 0.0) is None
    assert effective_truncation(Truncation(), 0.6) is None
    raw = SimpleNamespace(isoexec_logprobs_mode="raw_logprobs")
    assert effective_truncation(cut, 0.6, raw) is None  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Truncation"):
        effective_truncation((20, 0.95), 0.6)  # type: ignore[arg-type]


class _Stop(Exception):
    pass


def test_run_arm_puts_the_trainer_on_the_device_with_the_engines_options(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """run_arm: the engine config and the trainer's build_model get the same options; the
    trainer's parallel layout gets the device. Stopped at build_model; no engine starts."""
    import isoexec.megatron as trainer

    (tmp_path / "config.json").write_text(
        '{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 64}'
    )
    seen: dict[str, Any] = {}

    @contextmanager
    def started(config: Any, arm: str) -> Any:
        seen["engine"] = config
        yield object(), {}

    @contextmanager
    def parallel(**kwargs: Any) -> Any:
        seen["parallel"] = kwargs
        yield

    def build_model(model_dir: str, **kwargs: Any) -> Any:
        seen["build"] = kwargs
        raise _Stop

    _fake_cuda(monkeypatch, 1)
    monkeypatch.setattr(pair, "_started", started)
    monkeypatch.setattr(trainer, "megatron_parallel", parallel)
    monkeypatch.setattr(trainer, "build_model", build_model)
    with pytest.raises(_Stop):
        run = pair.PairRun(str(tmp_path), "bfloat16", num_prompts=2, max_tokens=2,
                           backend="triton", device="cuda")  # fmt: skip
        pair.run_arm(run, isoexec=True)
    assert seen["parallel"] == {"device": "cuda"}
    assert seen["build"]["options"] is seen["engine"].options
    assert seen["engine"].options.backend == "triton" and seen["engine"].isoexec
    # refused before the engine starts
    seen.clear()
    _fake_cuda(monkeypatch, 0)
    with pytest.raises(pair.PairSetupError, match="CUDA is not available"):
        pair.run_arm(pair.PairRun(str(tmp_path), "bfloat16", num_prompts=2, max_tokens=2,
                                  device="cuda"), isoexec=True)  # fmt: skip
    assert seen == {}


@NO_CUDA
@pytest.mark.parametrize(
    ("arms", "says"),
    [
        ("isoexec,stok", "known arms isoexec, stock, upstream-bi"),  # never run as stock
        ("isoexec,upstream-bi", "upstream-bi needs --device cuda"),
    ],
)
def test_arms_refused_before_anything_starts(tmp_path: Path, arms: str, says: str) -> None:
    out = tmp_path / "run"
    r = _pair("--arms", arms, "--out", str(out))
    assert r.returncode == 2, r.stdout + r.stderr
    assert says in r.stdout and "starting the engine" not in r.stdout, r.stdout
    assert not out.exists()


def test_upstream_bi_arm_settings_and_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    """The upstream-bi arm is the stock arm with vLLM's batch-invariant mode in the engine's
    environment; on CUDA it is refused only with a multi-rank trainer, LoRA or --locate."""
    from isoexec.tools.pair_setup import (
        ENGINE_GPU_SHARE,
        PairRun,
        PairSetupError,
        arm_settings,
        check_arms,
    )

    cpu = PairRun(model_dir="m")
    with pytest.raises(PairSetupError, match="CUDA-only"):
        check_arms(["upstream-bi"], cpu)
    check_arms(["isoexec", "stock"], cpu)
    gpu = PairRun(model_dir="m", device="cuda")
    check_arms(["isoexec", "stock", "upstream-bi"], gpu)
    with pytest.raises(PairSetupError, match="in-process trainer"):
        check_arms(["upstream-bi"], PairRun(model_dir="m", device="cuda", trainer_tp=2))
    options, cfg = arm_settings(gpu, isoexec=False, upstream_bi=True)
    assert cfg.extra_env == (("VLLM_BATCH_INVARIANT", "1"),) and not cfg.isoexec
    assert options == IsoExecOptions(backend="torch")
    _, stock = arm_settings(gpu, isoexec=False)
    assert stock.extra_env == ()
    with pytest.raises(ValueError, match="upstream_bi is a stock arm"):
        arm_settings(gpu, isoexec=True, upstream_bi=True)
    assert cfg.gpu_memory_utilization == ENGINE_GPU_SHARE  # beside the trainer on one GPU
    assert arm_settings(cpu, isoexec=True)[1].gpu_memory_utilization is None
