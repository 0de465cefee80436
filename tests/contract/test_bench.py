"""`isoexec bench`: its options, its refusals, the JSON/plot/summary writer on synthetic numbers
(fast, no engine), and one real run (two engines, two Megatron models) through `cli.main`."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from isoexec.tools import bench, bench_report, cli

PNG = b"\x89PNG\r\n\x1a\n"


def parse(*argv: str) -> Any:
    return cli.build_parser("bench").parse_args(["bench", *argv])


def test_options_and_defaults() -> None:
    a = parse()
    assert (a.family, a.size, a.reps, a.mode, a.dtype) == ("dense", "small", 3, "default", None)
    assert (a.no_trainer, a.out, a._module) == (False, "isoexec-bench", "isoexec.tools.bench")
    a = parse("--family", "moe", "--size", "tiny", "--reps", "2", "--mode", "both",
              "--no-trainer", "--out", "d", "--dtype", "bfloat16")  # fmt: skip
    assert (a.family, a.size, a.reps, a.mode, a.no_trainer, a.out, a.dtype) == (
        "moe", "tiny", 2, "both", True, "d", "bfloat16")  # fmt: skip
    assert bench.MODES["both"] == ("default", "eager") and bench.MODES["default"] == ("default",)
    assert bench.SIZES["tiny"] == {"hidden": 128, "layers": 2, "vocab": 1024, "prompts": 2,
                                   "tokens": 8}  # fmt: skip


def test_top_level_help_lists_bench(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0 and "bench" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--no-trainer" in out and "--mode" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--family", "rwkv"], "argument --family: invalid choice: 'rwkv'"),
        (["--size", "huge"], "argument --size: invalid choice: 'huge'"),
        (["--mode", "graph"], "argument --mode: invalid choice: 'graph'"),
    ],
)
def test_unknown_choice_is_a_usage_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--family", "gdn", "--dtype", "float32"], "--family gdn runs in bfloat16 only"),
        (["--reps", "0"], "--reps 0: at least 1"),
    ],
)
def test_refused_before_anything_starts(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert cli.main(["bench", *argv, "--out", str(out)]) == 2
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("isoexec bench: ") and message in lines[0]
    assert not out.exists()  # no model made, no engine started, nothing written


def test_resolve_dtype() -> None:
    assert bench.resolve_dtype("dense", None) == "float32"
    assert bench.resolve_dtype("moe", "bfloat16") == "bfloat16"
    assert bench.resolve_dtype("gdn", None) == "bfloat16"
    with pytest.raises(bench.BenchSetupError, match="unknown family 'rwkv'"):
        bench.resolve_dtype("rwkv", None)
    with pytest.raises(bench.BenchSetupError, match="stock vLLM-CPU's GDN kernel"):
        bench.resolve_dtype("gdn", "float32")


def test_one_settings_object_for_the_run_the_report_and_the_cli(tmp_path: Path) -> None:
    """`BenchRun` is built once from the CLI's arguments and read by the measurements and the
    report: its `settings()` is the report's section, validated when built."""
    run = bench.BenchRun.from_args(parse("--family", "gdn", "--size", "tiny", "--out", "d"))
    assert (run.dtype, run.modes, run.trainer, run.out) == (
        "bfloat16",
        ("default",),
        True,
        Path("d"),
    )
    assert run.settings() == {
        "family": "gdn", "size": "tiny", "dtype": "bfloat16", "reps": 3, "mode": "default",
        "modes": ["default"], "trainer": True, "prompt_len": 32, "lora": False, "speculative": 0,
        "threads": None, **bench.SIZES["tiny"],
    }  # fmt: skip
    assert run.engine_log("isoexec", "eager") == str(Path("d") / "engine-isoexec-eager.log")
    assert bench.BenchRun(verbose=True).engine_log("native", "default") is None
    assert bench.BenchRun(lora=True).trainer is False  # the adapter is timed on the engine
    for kwargs, message in [
        ({"size": "huge"}, "unknown size 'huge'"),
        ({"mode": "graph"}, "unknown mode 'graph'"),
        ({"reps": 0}, "--reps 0: at least 1"),
        ({"family": "moe", "lora": True}, "--lora runs on the dense family only"),
        ({"family": "gdn", "dtype": "float32"}, "runs in bfloat16 only"),
        ({"speculative": -1}, "--speculative -1"),
        ({"family": "gdn", "speculative": 3}, "--speculative runs dense and MoE"),
        ({"lora": True, "speculative": 3}, "--speculative runs dense and MoE"),
        ({"threads": 0}, "--threads 0: this process may use"),
        ({"threads": len(os.sched_getaffinity(0)) + 1}, "--threads .*: this process may use"),
    ]:
        with pytest.raises(bench.BenchSetupError, match=message):
            bench.BenchRun(**kwargs)


def test_speculation_is_reported_with_its_speedup_and_drafts() -> None:
    """`--speculative K`: the speedup is IsoExec speculating against IsoExec without, from the
    same run's medians; the drafts each speculating arm proposed and accepted are reported."""
    run = bench.BenchRun.from_args(parse("--speculative", "3", "--no-trainer"))
    assert run.speculative == 3 and run.settings()["speculative"] == 3
    runs = {"isoexec": [2.0, 2.0], "native": [1.0, 1.0], bench_report.PLAIN_ARM: [4.0, 4.0]}
    spec = bench_report.speculation_result(3, runs, 64, {"isoexec": (30, 12), "native": (30, 9)})
    assert spec["isoexec_speedup"] == 2.0 and spec["tokens_per_s"]["isoexec"] == 32.0
    assert spec["drafts"]["native"] == {"proposed": 30, "accepted": 9}


def test_speculative_prompts_repeat_a_pattern_and_the_default_ones_do_not() -> None:
    """`--speculative` benches greedy on prompts that loop (n-gram drafts are accepted on a
    random-weight model only there); the default prompts are random, as before."""
    plain = bench.make_prompts(3, 8192)
    assert plain == bench.make_prompts(3, 8192)  # deterministic
    assert all(len(p) == bench.PROMPT_LEN and max(p) < 1000 for p in plain)
    assert all(p[:4] != p[4:8] for p in plain)  # not a loop
    looped = bench.make_prompts(3, 8192, period=bench.SPECULATIVE_PERIOD)
    for p in looped:
        assert len(p) == bench.PROMPT_LEN
        assert all(p[i] == p[i % 4] for i in range(len(p)))
    assert len({tuple(p[:4]) for p in looped}) == 3  # each its own pattern


def test_missing_sides_trainer_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Megatron, `--no-trainer` still runs; without vLLM nothing does."""
    real = importlib.util.find_spec

    def find_spec(name: str, *a: Any) -> Any:
        return None if name.split(".")[0] == "megatron" else real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert bench.missing_sides(trainer=True) == ["isoexec-megatron"]
    assert bench.missing_sides(trainer=False) == []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert bench.missing_sides(trainer=False) == ["isoexec-vllm[cpu] or isoexec-vllm[cuda]"]


def test_cpu_model_from_cpuinfo(tmp_path: Path) -> None:
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9454P\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nCPU part\t: 0xd40\n\nModel\t: Graviton\n")
    assert bench_report.cpu_model(x86) == "AMD EPYC 9454P"
    assert bench_report.cpu_model(arm) == "Graviton"
    assert bench_report.cpu_model(tmp_path / "missing")  # platform's answer, never empty


def test_machine_info_names_cpu_threads_versions_commit() -> None:
    m = bench_report.machine_info()
    assert m["cpu"] and m["cpus_available"] >= 1 and m["torch_threads"] >= 1
    assert set(m["versions"]) == {"python", "torch", "vllm", "megatron-core"}
    assert m["versions"]["torch"]
    git = m["git"]  # this checkout: a commit (an installed wheel has none)
    assert git is not None and len(git["commit"]) == 40 and isinstance(git["dirty"], bool)
    line = bench_report.machine_line(m)
    assert line.startswith("machine: ") and git["commit"][:12] in line and m["cpu"] in line
    import torch

    from isoexec.ops import moe  # the expert GEMM differs by CPU: the line says which

    assert m["bf16_experts"] == moe.expert_gemm(torch.bfloat16)
    assert f"bf16 experts {m['bf16_experts']}" in line


def synthetic_doc(trainer: bool = True) -> dict[str, Any]:
    engine = {
        "default": bench_report.engine_result(
            {"isoexec": [2.0, 4.0, 3.0], "native": [1.0, 1.5, 2.0]}, 300, "default"
        ),
        "eager": bench_report.engine_result({"isoexec": [5.0], "native": [2.5]}, 300, "eager"),
    }
    tr = None
    if trainer:
        profile = {"linear": 0.2, "attention_varlen": 0.1, "total (fwd+bwd)": 0.5}
        tr = bench_report.trainer_result(
            {"isoexec": [0.6, 0.5, 0.7], "native": [0.4, 0.5, 0.45]}, 500, profile
        )
    settings = {"family": "dense", "size": "small", "dtype": "float32", "reps": 3,
                "mode": "both", "modes": ["default", "eager"], "trainer": trainer,
                "prompt_len": 32, **bench.SIZES["small"]}  # fmt: skip
    machine = {"cpu": "Test CPU", "cpus_available": 2, "cpus_total": 4, "torch_threads": 2,
               "omp_num_threads": "1", "cuda": None,
               "versions": {"python": "3.11", "torch": "2.x", "vllm": "0.y",
                            "megatron-core": "0.z"},
               "git": {"commit": "a" * 40, "dirty": False}}  # fmt: skip
    return {"settings": settings, "machine": machine, "engine": engine, "trainer": tr}


def test_ratios_from_synthetic_runs() -> None:
    doc = synthetic_doc()
    e = doc["engine"]["default"]
    assert e["median_s"] == {"isoexec": 3.0, "native": 1.5}
    assert e["tokens_per_s"] == {"isoexec": 100.0, "native": 200.0}
    assert e["overhead"] == 2.0 and e["compiled"] is True  # native tok/s / IsoExec tok/s
    assert doc["engine"]["eager"]["compiled"] is False
    t = doc["trainer"]
    assert t["ms_per_token"] == pytest.approx({"isoexec": 1.2, "native": 0.9})
    assert t["overhead"] == pytest.approx(1.2 / 0.9)  # IsoExec ms/tok / native ms/tok
    with pytest.raises(ValueError, match="no runs"):
        bench_report.engine_result({"isoexec": [], "native": [1.0]}, 10, "eager")


def test_writer_json_plot_and_summary(tmp_path: Path) -> None:
    doc = synthetic_doc()
    path = bench_report.write_results(tmp_path / "out", doc)
    assert path.name == "bench.json"
    back = json.loads(path.read_text())
    assert back["engine"]["eager"]["runs_s"] == {"isoexec": [5.0], "native": [2.5]}
    assert back["trainer"]["isoexec_op_profile_s"]["linear"] == 0.2
    assert back["machine"]["git"]["commit"] == "a" * 40
    nan = synthetic_doc()
    nan["engine"]["eager"]["overhead"] = math.nan  # written as null, never as NaN
    assert "NaN" not in bench_report.write_results(tmp_path / "nan", nan).read_text()

    lines = bench_report.summary_lines(doc)
    text = "\n".join(lines)
    assert "engine  default (compiled)" in text and "overhead 2.00x" in text
    assert "engine  eager" in text and "trainer fwd+bwd" in text and "overhead 1.33x" in text
    assert "linear" in text and "40.0%" in text  # 0.2 s of a 0.5 s step
    assert lines[-1].startswith("machine: Test CPU, 2 CPUs available of 4")
    assert "(OMP_NUM_THREADS=1)" in lines[-1] and "commit aaaaaaaaaaaa" in lines[-1]

    plot = bench_report.write_plot(tmp_path / "out", doc)
    engine_only = bench_report.write_plot(tmp_path / "engine-only", synthetic_doc(False))
    if importlib.util.find_spec("matplotlib") is None:
        assert plot is None and engine_only is None
    else:
        assert plot == tmp_path / "out" / "bench.png" and plot.read_bytes()[:8] == PNG
        assert engine_only is not None and engine_only.read_bytes()[:8] == PNG
    engine_only_text = "\n".join(bench_report.summary_lines(synthetic_doc(False)))
    assert "trainer" not in engine_only_text and "engine  eager" in engine_only_text


def test_plot_is_skipped_and_said_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises
    assert bench_report.write_plot(tmp_path, synthetic_doc()) is None
    assert not (tmp_path / "bench.png").exists()


def test_threads_reach_the_engines_and_the_report() -> None:
    """`--threads N`: every engine binds one OpenMP thread to each of this process's first N
    CPUs; the report's settings name N (None: each side's own default)."""
    run = bench.BenchRun.from_args(parse("--threads", "1", "--no-trainer"))
    first = str(sorted(os.sched_getaffinity(0))[0])
    assert run.engine_env() == (("OMP_NUM_THREADS", "1"), ("VLLM_CPU_OMP_THREADS_BIND", first))
    assert run.settings()["threads"] == 1
    assert bench.BenchRun().engine_env() == ()


def test_qwen3_size_has_the_released_widths(tmp_path: Path) -> None:
    """`--size qwen3-0.6b`: Qwen3-0.6B's widths, layers and vocabulary, tied embeddings; the
    checkpoint is written with them (checked here at a small width: the real one is 2.4 GB)."""
    run = bench.BenchRun(size="qwen3-0.6b")
    assert (run.shape["hidden"], run.shape["layers"], run.shape["vocab"]) == (1024, 28, 151936)
    assert run.settings()["num_key_value_heads"] == 8
    model = bench.make_model(tmp_path / "m", 256, 1, 1024, "dense", "float32", run.config)
    cfg = json.loads((model / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (16, 8, 128)
    assert cfg["intermediate_size"] == 3072 and cfg["tie_word_embeddings"] is True
    # the KV cache the engines get is sized from the checkpoint: 28 layers x 2 x 8 x 128 fp32
    assert bench.kv_bytes_per_token(model) == 1 * 2 * 8 * 128 * 4
    # vLLM refuses a cache smaller than one sequence of max_model_len: the real model's
    # 28 layers need 117 MB for 512 tokens, more than 8 prompts x 48 tokens
    per_token = 28 * 2 * 8 * 128 * 4
    assert bench.kv_cache_bytes(8, 16, per_token) == 2 * 512 * per_token


def test_tiny_gdn_model_has_an_attention_layer(tmp_path: Path) -> None:
    """Under 4 layers the last one attends (Qwen3-Next: every 4th), so tiny GDN has one."""
    model = bench.make_model(tmp_path / "m", 128, 2, 1024, "gdn", "bfloat16")
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["layer_types"] == ["linear_attention", "full_attention"]
    assert cfg["num_experts"] == 8 and cfg["hidden_size"] == 128


@pytest.mark.engine
@pytest.mark.trainer
@pytest.mark.slow
@pytest.mark.matrix  # 73 s for CI time: the bench measures speed, no bitwise claim rests on it
def test_tiny_bench_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The real thing at the tiny size: two engines (vLLM's default compiled mode) alive at once,
    two Megatron models; the JSON has both arms with positive tokens/s, the plot is there, and
    no engine outlives the command."""
    from isoexec.vllm import engine_process

    live_before = set(engine_process._LIVE_GROUPS)
    out = tmp_path / "bench"
    argv = ["bench", "--size", "tiny", "--reps", "1", "--family", "dense", "--out", str(out)]
    assert cli.main(argv) == 0
    assert engine_process._LIVE_GROUPS == live_before
    printed = capsys.readouterr().out
    assert "engine  default (compiled)" in printed and "trainer fwd+bwd" in printed
    assert "machine: " in printed and f"results in {out / 'bench.json'}" in printed

    doc = json.loads((out / "bench.json").read_text())
    assert doc["settings"]["modes"] == ["default"] and doc["settings"]["hidden"] == 128
    e = doc["engine"]["default"]
    assert e["compiled"] is True and e["tokens_per_rep"] == 2 * 8
    tps = e["tokens_per_s"]
    assert all(len(e["runs_s"][arm]) == 1 and tps[arm] > 0 for arm in ("isoexec", "native"))
    assert e["overhead"] == pytest.approx(tps["native"] / tps["isoexec"])
    t = doc["trainer"]
    profile = t["isoexec_op_profile_s"]
    assert t["tokens_per_step"] == 2 * (32 + 8 - 1)
    assert t["ms_per_token"]["isoexec"] > 0 and t["ms_per_token"]["native"] > 0
    assert profile["linear"] > 0 and "total (fwd+bwd)" in profile
    assert doc["machine"]["versions"]["vllm"] and doc["machine"]["cpu"]
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "bench.png").read_bytes()[:8] == PNG
    else:
        assert "no plot (matplotlib is not installed" in printed


def test_tiny_bench_lora_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--lora`: both engines generate under the same adapter (IsoExec's through its adapter
    gate, cleared by a handshake), engine only; the report says LoRA engines run uncompiled."""
    from isoexec.vllm import engine_process

    live_before = set(engine_process._LIVE_GROUPS)
    out = tmp_path / "bench"
    argv = ["bench", "--size", "tiny", "--reps", "1", "--lora", "--out", str(out)]
    assert cli.main(argv) == 0
    assert engine_process._LIVE_GROUPS == live_before
    printed = capsys.readouterr().out
    assert "LoRA: both engine arms generate under a rank-8 adapter" in printed
    assert "trainer fwd+bwd" not in printed
    doc = json.loads((out / "bench.json").read_text())
    e = doc["engine"]["default"]
    assert doc["settings"]["lora"] is True and e["compiled"] is False
    assert all(e["tokens_per_s"][arm] > 0 for arm in ("isoexec", "native"))
    assert cli.main(["bench", "--lora", "--family", "moe", "--out", str(tmp_path / "x")]) == 2


def test_qwen35_slice_size_has_the_released_widths_and_vocabulary(tmp_path: Path) -> None:
    """`--size qwen3.5-35b-a3b-slice`: Qwen3.5-35B-A3B's text widths (256 experts of 512, top-8,
    16 attention / 2 KV heads of 256, 16/32 GDN heads) and 248,320-token vocabulary, two layers
    (one GDN, one attention), in Qwen3.5's architecture; the GDN family only. The checkpoint is
    written with them (at a small width and expert count here: the real one is 5.4 GB)."""
    run = bench.BenchRun(family="gdn", size="qwen3.5-35b-a3b-slice")
    assert (run.shape["hidden"], run.shape["layers"], run.shape["vocab"]) == (2048, 2, 248320)
    s = run.settings()
    assert (s["num_experts"], s["num_experts_per_tok"], s["moe_intermediate_size"]) == (256, 8, 512)
    assert s["vocab_size"] == 248320 and s["layer_types"] == ["linear_attention", "full_attention"]
    small = {**run.config, "vocab_size": 1024, "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8}  # fmt: skip
    model = bench.make_model(tmp_path / "m", 128, 2, 1024, "gdn", "bfloat16", small, run.preset)
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_moe_text" and cfg["architectures"] == [
        "Qwen3_5MoeForCausalLM"
    ]
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (16, 2, 256)
    assert (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]) == (16, 32)
    for family in ("dense", "moe"):
        with pytest.raises(bench.BenchSetupError, match="--family gdn"):
            bench.BenchRun(family=family, size="qwen3.5-35b-a3b-slice")
