"""vLLM worker extension (`worker_extension_cls`): IsoExec's per-worker RPC surface.

Called through `LLM.collective_rpc("isoexec_…")`; every name is prefixed so it cannot clash
with the worker's own attributes. The weight gate lives here: a worker loads weights only
after its own contract got MATCH from the handshake service, and the service still says so.
"""

from __future__ import annotations

import json
from dataclasses import astuple
from pathlib import Path
from typing import Any

import torch

from isoexec.contract.fingerprint import WeightFingerprint
from isoexec.ops.gemm import clear_packed_weight_cache
from isoexec.vllm import weight_gate
from isoexec.vllm.readback import read_sites
from isoexec.vllm.weight_gate import WeightSyncRefusedError
from isoexec.vllm.weights import hf_named_weights

QUALNAME = "isoexec.vllm.worker_extension.IsoWorkerExtension"
ENGINE_SIDE = "engine"


class IsoWorkerExtension:
    model_runner: Any  # provided by the vLLM worker this class is mixed into

    # ---- contract ----------------------------------------------------------------------------
    def _isoexec_hf_config(self) -> dict[str, Any]:
        path = Path(self.model_runner.model_config.model) / "config.json"
        return json.loads(path.read_text())

    def _isoexec_dtype(self) -> str:
        return str(self.model_runner.model_config.dtype).removeprefix("torch.")

    def _isoexec_read_sites(self) -> dict[str, Any]:
        return read_sites(
            self.model_runner.model, self.model_runner.sampler, self._isoexec_hf_config()
        )

    def isoexec_sites(self) -> list[tuple[str, tuple[Any, ...]]]:
        """(site, ImplInfo fields) for every site, as plain tuples (they cross processes)."""
        return [(name, astuple(impl)) for name, impl in self._isoexec_read_sites().items()]

    def isoexec_contract(self) -> bytes:
        """This worker's contract (canonical bytes), read back from the live model."""
        from isoexec.vllm.engine_contract import worker_contract

        runner = self.model_runner
        rejection = getattr(runner, "rejection_sampler", None)  # built only when speculating
        return worker_contract(runner.model, runner.sampler, self.vllm_config, rejection).to_bytes()

    # ---- handshake and the weight gate ------------------------------------------------------
    def isoexec_handshake(
        self,
        address: str,
        token: str,
        run_id: str,
        timeout_s: float = 300.0,
        tls: dict[str, str | None] | None = None,
        rank_offset: int = 0,
    ) -> dict[str, Any]:
        """Offer this worker's contract (as engine rank = `rank_offset` + its worker rank:
        several engines in one run take disjoint ranks); clear it for weights only on MATCH.
        All workers offer concurrently through one collective RPC. `tls`: `ClientTLS` fields
        (ca, cert, key) to reach a TLS handshake service."""
        from isoexec.handshake.client import HandshakeClient
        from isoexec.handshake.tls import ClientTLS
        from isoexec.vllm.engine_contract import worker_settings

        rank = int(rank_offset) + int(getattr(self, "rank", 0))
        client_tls = ClientTLS(**tls) if tls else None

        weight_gate.revoke()  # no weights while this offer is open or if it does not MATCH
        with HandshakeClient(address, token, timeout_s=timeout_s, tls=client_tls) as client:
            verdict = client.offer(run_id, ENGINE_SIDE, rank, self.isoexec_contract(),
                                   settings=worker_settings(self.vllm_config))  # fmt: skip
        weight_gate.STATE.last_verdict = verdict.outcome
        if verdict.matched:
            weight_gate.grant(weight_gate.Clearance(address, token, run_id, rank, client_tls))
        return {
            "outcome": verdict.outcome,
            "hash": verdict.contract_hash,
            "summary": verdict.summary,
            "diff": list(verdict.diff),
            "settings": {p.label: dict(p.settings) for p in verdict.participants},
        }

    def isoexec_load_weights(
        self, path: str, expected_fingerprint: str, allow_nonfinite: bool = False
    ) -> str:
        """Load HF-named weights from a safetensors file; return the live weights' fingerprint.

        Refused before anything is touched when the worker is not cleared, when the tensors
        are not the model's own set (names, shapes, dtypes; NaN or Inf unless
        `allow_nonfinite`: `weight_check`), or when they do not hash to the trainer's
        fingerprint (a corrupted or partial transfer).
        """
        from safetensors.torch import load_file

        weight_gate.require_match("isoexec_load_weights")
        return self._isoexec_load_verified(load_file(path), expected_fingerprint, allow_nonfinite)

    def isoexec_stage_weights(self, chunk: dict[str, torch.Tensor]) -> int:
        """Hold one chunk of HF-named weights in this worker's memory, loading nothing (a
        transfer that arrives in pieces, e.g. through Ray's object store: `isoexec.ray`);
        `isoexec_commit_weights` then verifies and loads them all at once. Returns how many
        tensors are staged. Refused without a MATCH, and for a name staged twice."""
        weight_gate.require_match("isoexec_stage_weights")
        staged: dict[str, torch.Tensor] = self.__dict__.setdefault("_isoexec_staged", {})
        twice = sorted(set(chunk) & set(staged))
        if twice:
            self.isoexec_drop_staged()
            raise WeightSyncRefusedError(
                f"weight sync refused: {twice[:3]} arrived twice; the staged weights are "
                "dropped and nothing was loaded"
            )
        staged.update(chunk)
        return len(staged)

    def isoexec_commit_weights(
        self, expected_fingerprint: str, allow_nonfinite: bool = False
    ) -> str:
        """Load the staged weights if, all together, they are the model's set and hash to the
        trainer's fingerprint; staged weights are dropped either way (a refused transfer
        starts again whole)."""
        staged = self.__dict__.pop("_isoexec_staged", {})
        weight_gate.require_match("isoexec_commit_weights")
        if not staged:
            raise WeightSyncRefusedError("weight sync refused: no weights were staged")
        return self._isoexec_load_verified(staged, expected_fingerprint, allow_nonfinite)

    def isoexec_drop_staged(self) -> int:
        """Forget staged weights (an aborted transfer); how many tensors were dropped."""
        return len(self.__dict__.pop("_isoexec_staged", {}))

    def _isoexec_load_verified(
        self, received: dict[str, torch.Tensor], expected_fingerprint: str,
        allow_nonfinite: bool = False,
    ) -> str:  # fmt: skip
        from isoexec.vllm.weight_check import check_transfer

        check_transfer(received, self._isoexec_expected(), allow_nonfinite=allow_nonfinite)
        got = WeightFingerprint.of(received).digest
        if got != expected_fingerprint:
            raise WeightSyncRefusedError(
                f"weight sync refused: received weights hash to {got[:16]}…, the trainer sent "
                f"{expected_fingerprint[:16]}… (corrupted or partial transfer); nothing loaded"
            )
        model = self.model_runner.model
        with torch.no_grad():
            model.load_weights(iter(received.items()))  # through the gate (`weight_gate`)
        clear_packed_weight_cache()  # the loaders write through `.data`: no version bump
        return self.isoexec_weight_fingerprint()

    def _isoexec_expected(self) -> dict[str, Any]:
        """The model's HF-named tensor set (name -> shape, dtype), computed once: it does not
        change while the engine lives."""
        from isoexec.vllm.weight_check import expected_specs

        expected = self.__dict__.get("_isoexec_expected_specs")
        if expected is None:
            hf = self._isoexec_hf_config()
            expected = expected_specs(dict(hf_named_weights(self.model_runner.model, hf)))
            self._isoexec_expected_specs = expected
        return expected

    def isoexec_expected_bytes(self) -> int:
        """How many bytes the model's whole HF-named tensor set holds (a served push's body
        cannot need much more)."""
        from isoexec.vllm.weight_check import nbytes

        return nbytes(self._isoexec_expected())

    def isoexec_expect_adapter(self, name: str, fingerprint: str) -> None:
        """Announce LoRA adapter `name` with the trainer's fingerprint of it (after MATCH):
        the adapter gate lets only that adapter's tensors load under that name
        (`adapter_gate`)."""
        from isoexec.vllm.adapter_gate import expect_adapter

        expect_adapter(name, fingerprint)

    def isoexec_gate_status(self) -> dict[str, Any]:
        """Whether this worker is cleared, the verdict of its last offer (at startup for a
        served engine, or through `isoexec_handshake`), how many gated loads it took, the
        fingerprint recorded after the last one, and the adapters it loaded through the
        adapter gate with their fingerprints."""
        from isoexec.vllm.adapter_gate import LOADED

        st = weight_gate.STATE
        return {
            "rank": int(getattr(self, "rank", 0)),
            "cleared": st.clearance is not None,
            "last_verdict": st.last_verdict,
            "gated_loads": st.gated_loads,
            "last_fingerprint": st.last_fingerprint,
            "adapters": dict(LOADED),  # name -> fingerprint of each adapter loaded via the gate
        }

    def isoexec_param_shapes(self) -> list[tuple[str, list[int], str]]:
        """(name, shape, dtype) of every parameter vLLM holds (to debug weight layouts)."""
        return [
            (n, list(p.shape), str(p.dtype)) for n, p in self.model_runner.model.named_parameters()
        ]

    def isoexec_weight_fingerprint(self, adapter: str | None = None) -> str:
        """Fingerprint of the weights this worker holds, in canonical (HF) names; with
        `adapter`, of the weights a request to that adapter runs under (base + the adapter as
        the gate verified it: `served_weights_fingerprint`)."""
        from isoexec.contract.adapter import served_weights_fingerprint
        from isoexec.vllm.adapter_gate import LOADED

        if adapter is not None and adapter not in LOADED:
            raise ValueError(
                f"adapter {adapter!r} was not loaded through the adapter gate on this worker "
                f"(loaded: {sorted(LOADED) or 'none'})"
            )
        hf = self._isoexec_hf_config()
        base = WeightFingerprint.of(hf_named_weights(self.model_runner.model, hf)).digest
        return served_weights_fingerprint(base, None if adapter is None else LOADED[adapter])

    def isoexec_verified_calls(self) -> dict[str, Any]:
        """Whether this worker checks its site calls (`ISOEXEC_VERIFY_CALLS=1`), and the calls
        it checked so far by `op:impl_id` (`isoexec.ops.call_verify`)."""
        from isoexec.ops import call_verify

        enabled = call_verify.verify_calls_enabled()
        return {"enabled": enabled, "calls": call_verify.verified_calls()}

    # ---- per-site tracing (`isoexec locate`) -------------------------------------------------
    def isoexec_trace_start(self, store_values: bool = True) -> None:
        """Install per-site recording hooks (see `isoexec.vllm.trace`); off until called."""
        from isoexec.vllm.trace import EngineTracer

        if getattr(self, "_isoexec_tracer", None) is not None:
            raise RuntimeError("a trace is already running on this worker")
        if not self.model_runner.model_config.enforce_eager:
            raise RuntimeError(
                "per-site tracing needs an eager engine: its module hooks do not run inside "
                "vLLM's compiled graph (start the engine with enforce_eager=True; `isoexec pair "
                "--locate` does)"
            )
        self._isoexec_tracer: Any = EngineTracer(
            self.model_runner.model,
            self._isoexec_hf_config(),
            self._isoexec_dtype(),
            store_values=store_values,
        )

    def isoexec_trace_sequence(self, seq: int, tokens: list[int]) -> None:
        """The rows of the next forwards belong to this sequence (one request at a time)."""
        tracer = getattr(self, "_isoexec_tracer", None)
        if tracer is None:
            raise RuntimeError("no trace is running (isoexec_trace_start first)")
        tracer.begin_sequence(seq, tokens)

    def isoexec_trace_stop(self) -> dict[str, Any] | None:
        """Remove the hooks; the trace as a plain dict (`Trace.to_dict`), None if none ran."""
        tracer = getattr(self, "_isoexec_tracer", None)
        self._isoexec_tracer = None
        return None if tracer is None else tracer.stop()


def compose(*others: type) -> type:
    """One worker extension with IsoExec's methods and those of `others` (vLLM's
    `worker_extension_cls` takes a single class; an RL framework brings its own, e.g. SkyRL's
    `NewInferenceWorkerWrap`). A name defined by two of them is refused, never shadowed.
    The others' weight updates stay gated: every write ends in the model's `load_weights`,
    which the gated model class checks (`weight_gate`), whoever calls it.

    Bind the result to a module-level name and pass its qualname, e.g. in `my_ext.py`:
    `Extension = compose(FrameworkExtension)` and `worker_extension_cls="my_ext.Extension"`.
    """
    if not others:
        raise ValueError("compose() needs at least one extension class besides IsoExec's")
    owners: dict[str, str] = {}
    for cls in (IsoWorkerExtension, *others):
        if not isinstance(cls, type):
            raise TypeError(f"compose() takes classes, got {cls!r}")
        for name in _own_names(cls):
            if name in owners:
                raise ValueError(
                    f"worker extensions clash on {name!r}: defined by {owners[name]} and by "
                    f"{cls.__qualname__}; rename one (IsoExec's names all start with isoexec_)"
                )
            owners[name] = cls.__qualname__
    names = "+".join(c.__name__ for c in others)
    return type(f"IsoExec+{names}", (IsoWorkerExtension, *others), {"__module__": __name__})


def require_isoexec_extension(qualname: str) -> type:
    """The class `qualname` names, if it includes IsoExec's extension; else a clear refusal
    (an IsoExec engine without its RPC surface could not offer, gate or read back)."""
    import importlib

    module, _, name = qualname.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"worker extension {qualname!r} cannot be imported: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, IsoWorkerExtension)):
        raise ValueError(
            f"worker extension {qualname!r} does not include IsoExec's: an IsoExec engine "
            "needs it to offer its contract and gate weights; pass "
            "isoexec.vllm.worker_extension.compose(YourExtension) instead"
        )
    return cls


def _own_names(cls: type) -> set[str]:
    """Attributes a class and its bases define, beyond `object`'s and dunders."""
    out: set[str] = set()
    for base in cls.__mro__:
        if base is object:
            continue
        out |= {n for n in vars(base) if not (n.startswith("__") and n.endswith("__"))}
    return out
