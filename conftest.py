"""Suite-wide fixtures: tiny local checkpoints (never downloaded) and clean shutdown."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from isoexec.tools.tiny_models import make_tiny_model


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # Turn SIGTERM (CI timeout, a parent stopping us) into KeyboardInterrupt: pytest then stops
    # the whole session (a SystemExit inside a test only fails that test and the run goes on)
    # and every `finally`, fixture teardown and atexit hook runs: that shuts engines down.
    raise KeyboardInterrupt(f"signal {signum}")


signal.signal(signal.SIGTERM, _exit_on_sigterm)

# Under `uv run` (README's test command) Ray's uv hook would start every Ray worker through
# `uv run` in an uploaded copy of the working directory, building a second environment per
# node; the test clusters run on this machine with this environment (the `isoexec.ray` probe
# refuses a node whose runtime differs). Read by Ray at import: set before any test imports it.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def model_factory(models_dir: Path) -> Callable[[str, str], str]:
    """(preset, dtype) -> checkpoint dir, each made once per session."""
    made: dict[tuple[str, str], str] = {}

    def get(preset: str, dtype: str = "float32") -> str:
        key = (preset, dtype)
        if key not in made:
            made[key] = str(make_tiny_model(preset, models_dir / f"{preset}-{dtype}", dtype=dtype))
        return made[key]

    return get


@pytest.fixture(scope="session")
def tiny_dense_dir(model_factory: Callable[[str, str], str]) -> str:
    return model_factory("tiny-dense", "float32")


MAX_LIVE_ENGINES = 3  # ~1.5 GB each; the CI machine has 24 GB and runs a trainer too

# What the pool started and reused this session, printed after the run: an engine started
# twice for one config is start-up time (10-30 s) the test order could save.
_POOL_LOG: list[tuple[str, float]] = []  # (config label, start seconds)
_POOL_HITS: dict[str, int] = {}


def _engine_label(cfg: Any) -> str:
    """The model's folder, then every setting that is not the default."""
    import dataclasses

    default = type(cfg)(model=cfg.model)
    rest = [
        f"{f.name}={getattr(cfg, f.name)!r}"
        for f in dataclasses.fields(cfg)
        if f.name != "model" and getattr(cfg, f.name) != getattr(default, f.name)
    ]
    return " ".join([Path(cfg.model).name, *rest])


def pytest_sessionfinish(session: pytest.Session) -> None:
    # An xdist worker hands its pool log to the controller, which prints them all.
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["engine_pool"] = json.dumps({"log": _POOL_LOG, "hits": _POOL_HITS})


@pytest.hookimpl(optionalhook=True)  # an xdist hook
def pytest_testnodedown(node: Any, error: Any) -> None:  # xdist controller: a worker finished
    out = getattr(node, "workeroutput", {}).get("engine_pool")
    if out:
        pool = json.loads(out)
        _POOL_LOG.extend((label, secs) for label, secs in pool["log"])
        for label, n in pool["hits"].items():
            _POOL_HITS[label] = _POOL_HITS.get(label, 0) + n


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _POOL_LOG:
        return
    starts: dict[str, list[float]] = {}
    for label, secs in _POOL_LOG:
        starts.setdefault(label, []).append(secs)
    total = sum(s for _, s in _POOL_LOG)
    terminalreporter.write_sep("-", f"engine pool: {len(_POOL_LOG)} starts, {total:.0f} s")
    for label, secs in sorted(starts.items(), key=lambda kv: -sum(kv[1])):
        hits = _POOL_HITS.get(label, 0)
        terminalreporter.write_line(
            f"{len(secs)} start(s) {sum(secs):6.1f} s, {hits} reuse(s): {label}"
        )


@pytest.fixture(scope="session")
def engine_pool() -> Iterator[Callable[..., Any]]:
    """Engines shared across tests, one per distinct `EngineConfig`, at most a few alive.

    Starting an engine costs 10-30 s, so tests share them (tests using the same model sit
    together); the least recently used engine is shut down when a new one would exceed
    `MAX_LIVE_ENGINES`. All are shut down at the end of the session (and by the engine
    module's atexit hook if the session dies).
    """
    from isoexec.vllm.engine_process import EngineConfig, EngineProcess

    engines: OrderedDict[EngineConfig, EngineProcess] = OrderedDict()

    def get(**kwargs: Any) -> EngineProcess:
        cfg = EngineConfig(**kwargs)
        label = _engine_label(cfg)
        if cfg in engines:
            engines.move_to_end(cfg)
            _POOL_HITS[label] = _POOL_HITS.get(label, 0) + 1
            return engines[cfg]
        while len(engines) >= MAX_LIVE_ENGINES:
            _, oldest = engines.popitem(last=False)
            oldest.close()
        t0 = time.monotonic()
        engines[cfg] = EngineProcess(cfg)
        _POOL_LOG.append((label, time.monotonic() - t0))
        return engines[cfg]

    try:
        yield get
    finally:
        for eng in engines.values():
            eng.close()


TP_WORKER = Path(__file__).parent / "tests" / "_support" / "tp_worker.py"


@pytest.fixture(scope="session")
def run_tp_jobs(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., list[dict[str, Any]]]:
    """Run trainer jobs on a real `torchrun` gloo world (see tests/_support/tp_worker.py).

    `run(jobs, seqs, nproc=2, env=None)` returns rank 0's result per job (`env`: extra
    environment for the ranks, e.g. TRITON_INTERPRET=1). torchrun and its ranks run in
    their own session, killed as a group whatever happens, so no rank outlives the call.
    """

    def run(
        jobs: list[dict[str, Any]],
        seqs: list[list[int]],
        nproc: int = 2,
        env: dict[str, str] | None = None,
    ) -> list[Any]:
        import torch

        from isoexec.megatron.torchrun import run_torchrun

        tmp = tmp_path_factory.mktemp("torchrun")
        job_file, out_file = tmp / "jobs.json", tmp / "results.pt"
        job_file.write_text(json.dumps({"jobs": jobs, "seqs": seqs}))
        target = [str(TP_WORKER), str(job_file), str(out_file)]
        run_torchrun(target, nproc, env={"ISOEXEC": "0", **(env or {})}, timeout_s=900)
        return list(torch.load(out_file))

    return run
