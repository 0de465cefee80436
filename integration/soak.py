"""The soak: a served IsoExec engine (`isoexec engine serve`, vLLM's OpenAI server) and a
Megatron trainer run N RL steps while requests stream throughout, with faults injected at
random steps drawn from a fixed seed.

Each step: sample a batch through the `openai` client, score it under the trainer's weights of
the version its record names (the deviation must be exactly 0), one train step, push the
weights (stated version = step count), both sides' canary, a trainer checkpoint. Requests from
`load_threads` background clients run all the while; each completed one is scored too when it
is of the trainer's current version (bitwise) and refused by `score_sampled` when it is not.
Every `sample_every` steps the engine's (its process group's) and the trainer's RSS and open
file descriptors are recorded. The faults, and the recovery each must end in:

- `engine_sigkill`: the server's process group is SIGKILLed; a new server starts, its worker
  offers at load (MATCH), sampling is refused until the trainer pushes the current weights and
  their canary passes;
- `handshake_restart`: the service (`isoexec handshake serve`, its own process) is SIGKILLed
  and a new one starts on its port (it remembers nothing); the next push is refused (no
  MATCH), both sides offer again, the push goes through;
- `push_truncated`: a push whose connection is cut mid-body: refused, nothing loaded;
- `trainer_restart`: the trainer process (`_soak_trainer.py`) is SIGKILLed; a new one resumes
  from its last checkpoint (weights, optimizer, weights version) and offers its contract again;
- `client_disconnect`: a streaming client goes away after its first chunk: the engine frees
  the request (the next push, which drains admitted requests, would hang otherwise);
- `malformed_request`: broken JSON and invalid fields: 400, the engine serves on.

Passes when every step completes, every deviation is exactly 0, every fault was recovered, RSS
grew under 5% and open fds by at most `FD_SLACK` from the first sample after warm-up (5 steps
past the last fault) to the last. Run:  python integration/soak.py --steps 200 --out runs/soak
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import threading
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from _served import PIDS, served, wait_cleared
from _soak_trainer import TrainerProcess

FAULTS = (
    "engine_sigkill",
    "handshake_restart",
    "push_truncated",
    "trainer_restart",
    "client_disconnect",
    "malformed_request",
)
RUN_ID = "soak"
FD_SLACK = 4
RSS_GROWTH_LIMIT = 0.05


@dataclass(frozen=True)
class SoakConfig:
    steps: int = 30
    seed: int = 0
    out: Path = Path("runs/soak")
    prompts: int = 4
    samples: int = 2  # n per prompt
    max_tokens: int = 8
    load_threads: int = 1
    sample_every: int = 10
    faults_per_kind: int = 1


@dataclass
class SoakReport:
    steps: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    resources: list[dict[str, Any]] = field(default_factory=list)
    load: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems


def fault_plan(config: SoakConfig) -> dict[int, str]:
    """Step -> fault, drawn from `seed`: each kind `faults_per_kind` times, on distinct steps
    from 3 to half the run (the rest is the warm-up and the leak window)."""
    rng = random.Random(config.seed)
    kinds = [k for k in FAULTS for _ in range(config.faults_per_kind)]
    steps = rng.sample(range(3, max(4 + len(kinds), config.steps // 2)), len(kinds))
    rng.shuffle(kinds)
    return dict(zip(sorted(steps), kinds, strict=True))


def _group_usage(pgid: int) -> tuple[int, int]:
    """RSS bytes and open fds of every process in the group `pgid`."""
    import psutil

    rss = fds = 0
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                rss += proc.memory_info().rss
                fds += proc.num_fds()
        except (psutil.Error, ProcessLookupError):
            continue
    return rss, fds


class Soak:
    """One soak run's state: the service, the engine, the trainer, the background clients."""

    def __init__(self, config: SoakConfig, model: str) -> None:
        self.config, self.model = config, model
        self.hf = json.loads((Path(model) / "config.json").read_text())
        self.out = config.out
        self.token = secrets.token_hex(16)
        (self.out / "token").write_text(self.token)
        self.report = SoakReport()
        self.version = 0
        self.trainer: TrainerProcess | None = None
        self.spares: list[TrainerProcess] = []
        self.engine_stack: ExitStack | None = None
        self.restarts = 0
        self.service_starts = 0
        self.clients = threading.local()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.loaded: list[tuple[Any, list[int], list[int], list[float]]] = []
        self.errors: dict[str, int] = {}  # the background clients' errors, by kind
        self.counts = {
            "ok": 0,
            "refused_503": 0,
            "errors": 0,
            "scored_bitwise": 0,
            "other_version_refused": 0,
        }
        rng = random.Random(config.seed + 1)
        vocab = int(self.hf["vocab_size"])
        self.pool = [[rng.randrange(vocab) for _ in range(rng.randrange(6, 24))] for _ in range(64)]

    # -- the pieces --

    def start_service(self, port: int = 0) -> None:
        """`isoexec handshake serve` in its own session (a fault SIGKILLs it), on `port` (a
        free one at first, the same one after a restart); returns once it accepts
        connections."""
        import socket
        import subprocess

        from _served import ROOT, free_port

        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        cmd = [str(ROOT / ".venv" / "bin" / "isoexec"), "handshake", "serve", "--port",
               str(self.port), "--token-file", str(self.out / "token")]  # fmt: skip
        log = (self.out / f"handshake{self.service_starts}.log").open("wb")
        self.service_starts += 1
        self.service = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # fmt: skip
        log.close()
        deadline = time.monotonic() + 60
        while True:
            if self.service.poll() is not None:
                raise RuntimeError(f"the handshake service exited {self.service.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError("the handshake service did not listen in 60 s") from None
                time.sleep(0.2)

    def start_engine(self) -> None:
        self.engine_stack = ExitStack()
        args = (
            "--handshake-address",
            self.address,
            "--handshake-token-file",
            str(self.out / "token"),
            "--handshake-run-id",
            RUN_ID,
        )
        log = self.out / f"server{self.restarts}.log"
        self.url = self.engine_stack.enter_context(
            served(self.model, stock=False, log=log, launcher_args=args)
        )

    def start_trainers(self, spares: int) -> None:
        """The trainer process, and `spares` built replacements for the ones a fault kills
        (`_soak_trainer`: why they start now)."""
        made = [TrainerProcess(self.model, self.out, self.address, self.token)
                for _ in range(1 + spares)]  # fmt: skip
        self.trainer, self.spares = made[0], made[1:]
        for t in made:
            t.call("ready")

    def call(self, method: str, *args: Any) -> Any:
        assert self.trainer is not None
        return self.trainer.call(method, *args)

    def push_and_canary(self) -> None:
        self.call("push_and_canary", self.url)

    # -- sampling and scoring --

    def _client(self) -> Any:
        """This thread's client of the current server: one connection kept alive, as a
        framework's client does (a new one per request leaves sockets in the server's
        keep-alive window, and the fd count would measure those, not a leak)."""
        from openai import OpenAI

        held = getattr(self.clients, "held", None)
        if held is None or held[0] != self.url:
            client = OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0,
                            timeout=120)  # fmt: skip
            self.clients.held = held = (self.url, client)
        return held[1]

    def _complete(self, prompts: list[list[int]], n: int) -> Any:
        from isoexec.handshake.served import SAMPLING_HEADER, SamplingRecord

        raw = self._client().completions.with_raw_response.create(
            model=self.model,
            prompt=prompts,
            max_tokens=self.config.max_tokens,
            n=n,
            temperature=1.0,
            logprobs=1,
            extra_body={"return_tokens_as_token_ids": True},
        )
        record = SamplingRecord.from_header(raw.headers.get(SAMPLING_HEADER))
        out = []
        for choice in sorted(raw.parse().choices, key=lambda c: c.index):
            ids = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
            out.append((prompts[choice.index // n], ids, list(choice.logprobs.token_logprobs)))
        return record, out

    def sample(self, rng: random.Random) -> Any:
        from openai import APIStatusError

        prompts = rng.sample(self.pool, self.config.prompts)
        deadline = time.monotonic() + 120
        while True:
            try:
                return self._complete(prompts, self.config.samples)
            except APIStatusError as e:
                if e.status_code != 503 or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def load_worker(self, seed: int) -> None:
        from openai import APIStatusError

        rng = random.Random(seed)
        while not self.stop.is_set():
            try:
                record, out = self._complete([rng.choice(self.pool)], 1)
                with self.lock:
                    self.counts["ok"] += 1
                    self.loaded += [(record, *o) for o in out]
            except APIStatusError as e:
                key = "refused_503" if e.status_code == 503 else "errors"
                with self.lock:
                    self.counts[key] += 1
            except Exception as e:  # the engine is restarting: connection refused or reset
                with self.lock:
                    self.counts["errors"] += 1
                    self.errors[type(e).__name__] = self.errors.get(type(e).__name__, 0) + 1
                time.sleep(0.5)
            time.sleep(0.2)

    def score_load(self) -> None:
        """The background completions so far: bitwise when of the current version, refused by
        `score_sampled` when not."""
        with self.lock:
            taken, self.loaded = self.loaded, []
        groups: dict[Any, list[tuple[list[int], list[int], list[float]]]] = {}
        for record, *seq in taken:
            groups.setdefault(record, []).append(tuple(seq))  # type: ignore[arg-type]
        for record, seqs in groups.items():
            if record.weights_version == self.version:
                dev = self.call("deviation", record, seqs)  # one batch per record
                if dev != 0.0:
                    self.report.problems.append(f"background completions differ by {dev}")
                self.counts["scored_bitwise"] += len(seqs)
            elif self.call("refuses", record, [p + ids for p, ids, _ in seqs]):
                self.counts["other_version_refused"] += len(seqs)
            else:
                self.report.problems.append("completions of another version were scored")

    def inject(self, kind: str, step: int) -> str:
        """Inject `kind`, drive the recovery, and say what was observed (`_soak_faults`)."""
        import _soak_faults

        return str(getattr(_soak_faults, kind)(self, step))

    # -- the run --

    def usage(self, step: int) -> None:
        import psutil

        assert self.trainer is not None
        me = psutil.Process(self.trainer.pid)
        rss, fds = _group_usage(PIDS[self.url])
        self.report.resources.append(
            {
                "step": step,
                "engine_rss": rss,
                "engine_fds": fds,
                "trainer_rss": me.memory_info().rss,
                "trainer_fds": me.num_fds(),
                "engine_restarts": self.restarts,
            }
        )

    def run(self) -> SoakReport:
        config, plan = self.config, fault_plan(self.config)
        rng = random.Random(config.seed + 2)
        self.start_service()
        threads: list[threading.Thread] = []
        try:
            self.start_trainers(sum(k == "trainer_restart" for k in plan.values()))
            self.start_engine()
            self.call("offer")
            wait_cleared(self.url, self.token)
            self.call("canary", self.url, 0)  # the checkpoint both loaded: sampling opens
            self.call("checkpoint")
            threads = [
                threading.Thread(target=self.load_worker, args=(config.seed + 10 + i,), daemon=True)
                for i in range(config.load_threads)
            ]
            for t in threads:
                t.start()
            for step in range(config.steps):
                if step in plan:
                    started = time.monotonic()
                    observed = self.inject(plan[step], step)
                    self.report.faults.append(
                        {
                            "step": step,
                            "fault": plan[step],
                            "observed": observed,
                            "recovered_s": round(time.monotonic() - started, 2),
                        }
                    )
                    print(json.dumps(self.report.faults[-1]), flush=True)
                t0 = time.monotonic()
                record, seqs = self.sample(rng)
                t1 = time.monotonic()
                dev = self.call("deviation", record, seqs)
                self.score_load()
                self.version = self.call("train", [p + ids for p, ids, _ in seqs])
                t2 = time.monotonic()
                self.push_and_canary()
                t3 = time.monotonic()
                self.call("checkpoint")
                timing = {"sample_s": t1 - t0, "score_train_s": t2 - t1, "push_canary_s": t3 - t2}
                entry = {
                    "step": step,
                    "sampled_version": record.weights_version,
                    "max_abs_diff": dev,
                    "tokens": sum(len(i) for _, i, _ in seqs),
                    **{k: round(v, 3) for k, v in timing.items()},
                }
                self.report.steps.append(entry)
                if dev != 0.0:
                    self.report.problems.append(f"step {step}: deviation {dev}")
                if step % config.sample_every == 0 or step == config.steps - 1:
                    self.usage(step)
                print(json.dumps(entry), flush=True)
        finally:
            self.stop.set()
            for t in threads:
                t.join(60)
            for trainer in [self.trainer, *self.spares]:
                if trainer is not None:
                    trainer.close()
            if self.engine_stack is not None:
                self.engine_stack.close()
            from _served import stop_session

            stop_session(self.service)
        self.report.load = {**self.counts, **{f"error {k}": v for k, v in self.errors.items()}}
        self.judge(plan)
        return self.report

    def judge(self, plan: dict[int, str]) -> None:
        report, steps = self.report, self.config.steps
        if len(report.steps) != steps:
            report.problems.append(f"{len(report.steps)} of {steps} steps completed")
        if len(report.faults) != len(plan):
            report.problems.append(f"{len(report.faults)} of {len(plan)} faults recovered")
        if self.counts["scored_bitwise"] == 0:
            report.problems.append("no background completion was scored")
        warm = max(plan, default=0) + 5
        window = [r for r in report.resources if r["step"] >= warm]
        if len(window) < 2:
            report.problems.append(f"no leak window: samples after step {warm}: {len(window)}")
            return
        first, last = window[0], window[-1]
        for side in ("engine", "trainer"):
            growth = last[f"{side}_rss"] / first[f"{side}_rss"] - 1
            if growth >= RSS_GROWTH_LIMIT:
                report.problems.append(f"{side} RSS grew {growth:.1%} after warm-up")
            if last[f"{side}_fds"] > first[f"{side}_fds"] + FD_SLACK:
                report.problems.append(
                    f"{side} fds {first[f'{side}_fds']} -> {last[f'{side}_fds']}"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--faults-per-kind", type=int, default=None)
    ap.add_argument("--out", default="runs/soak")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    per_kind = max(1, args.steps // 70) if args.faults_per_kind is None else args.faults_per_kind
    config = SoakConfig(steps=args.steps, seed=args.seed, out=out, faults_per_kind=per_kind)
    report = run_soak(config)
    print(
        json.dumps(
            {"passed": report.passed, "problems": report.problems, "load": report.load}, indent=1
        )
    )
    raise SystemExit(0 if report.passed else 1)


def run_soak(config: SoakConfig) -> SoakReport:
    """Make the tiny model, run the soak, write `soak.json` to `config.out`."""
    from isoexec.tools.tiny_models import make_tiny_model

    model = str(make_tiny_model("tiny-dense", config.out / "model", seed=3))
    report = Soak(config, model).run()
    (config.out / "soak.json").write_text(json.dumps(asdict(report), indent=1))
    return report


if __name__ == "__main__":
    main()
