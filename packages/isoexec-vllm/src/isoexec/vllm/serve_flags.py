"""Which vLLM server flags `isoexec engine serve` passes through: an allow-list, not a deny-list.

A flag is passed through only if it leaves the bits alone or the contract records what it
changes; any other flag is refused before vLLM starts, naming it, so a flag added by a future
vLLM fails closed. The workers check the engine config again (`admission`), for engines
started any other way. No vLLM import here: the launcher execs vLLM and imports none of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

_SERVING = (
    "--host", "--port", "--uds", "--api-key", "--root-path", "--allowed-origins",
    "--allowed-methods", "--allowed-headers", "--allow-credentials", "--ssl-keyfile",
    "--ssl-certfile", "--ssl-ca-certs", "--ssl-cert-reqs", "--uvicorn-log-level",
    "--disable-uvicorn-access-log", "--disable-log-requests", "--enable-log-requests",
    "--disable-log-stats", "--max-log-len", "--disable-fastapi-docs", "--served-model-name",
    "--response-role", "--chat-template", "--chat-template-content-format",
    "--return-tokens-as-token-ids", "--enable-prompt-tokens-details",
    "--enable-server-load-tracking", "--middleware",
)  # fmt: skip
_LOADING = (
    "--tokenizer", "--tokenizer-mode", "--skip-tokenizer-init", "--trust-remote-code",
    "--download-dir", "--revision", "--tokenizer-revision", "--code-revision", "--load-format",
)  # fmt: skip
_SCHEDULING = (
    "--max-num-seqs", "--max-num-batched-tokens", "--enable-chunked-prefill",
    "--no-enable-chunked-prefill", "--enable-prefix-caching", "--no-enable-prefix-caching",
    "--kv-cache-memory-bytes", "--gpu-memory-utilization", "--swap-space", "--block-size",
    "--distributed-executor-backend",
)  # fmt: skip

# flag -> why passing it through keeps a MATCH honest.
ALLOWED_FLAGS: Mapping[str, str] = {
    **dict.fromkeys(_SERVING, "the HTTP server, not the model"),
    **dict.fromkeys(_LOADING, "which files are read; the contract records the model"),
    **dict.fromkeys(
        _SCHEDULING, "scheduling and memory: canonical ops are batch-, chunk- and cache-invariant"
    ),
    "--dtype": "recorded in the contract's dtypes",
    "--hf-overrides": "recorded: the contract hashes the effective config (a trainer built "
    "from the checkpoint does not MATCH an overridden engine)",
    "--generation-config": "request defaults; every request is checked at admission",
    "--seed": "picks which tokens are drawn, not their logprobs",
    "--max-model-len": "a length limit",
    "--max-logprobs": "how many logprobs may be returned",
    "--enforce-eager": "compiled and eager engines give the same bits (tested)",
    "--tensor-parallel-size": "recorded in the contract's parallel layout",
    "-tp": "recorded in the contract's parallel layout",
    "--enable-lora": "adapters run the canonical LoRA op; the contract declares the LoRA sites",
    "--max-lora-rank": "recorded: the canonical LoRA op's padded rank",
    "--max-loras": "adapter slots: a row's bits depend on its own adapter only",
    "--max-cpu-loras": "an adapter cache size",
    "--speculative-config": "n-gram drafts are verified on canonical rows (a verification "
    "forward is a chunk; tested bitwise); other methods are refused by each worker",
}

# Refused flags whose reason is worth more than "not on the allow-list".
REFUSAL_REASONS: Mapping[str, str] = {
    "--lora-modules": "adapters loaded at start-up pass no fingerprint check: load them through "
    "the gate after MATCH",
    "--fully-sharded-loras": "the adapter GEMMs would be split over TP ranks",
    "--lora-dtype": "adapters run in the model's dtype",
    "--quantization": "the canonical ops run unquantized",
    "-q": "the canonical ops run unquantized",
    "--kv-cache-dtype": "the KV cache is kept in the model dtype",
    "--override-generation-config": "request defaults the trainer is not told about: set "
    "sampling settings per request",
    "--compilation-config": "compilation passes are not audited yet (vLLM's default mode is)",
    "-O": "compilation passes are not audited yet (vLLM's default mode is)",
}


FLAGS_TEST = "tests/vllm/test_admission.py::test_the_launcher_refuses_flags_off_its_allow_list"


def flags_markdown() -> str:
    """The launcher's flag allow-list as docs/reliability.md shows it (a test keeps them equal)."""
    rows = ["| vLLM flag | decision | why | test |", "|---|---|---|---|"]
    by_reason: dict[str, list[str]] = {}
    for flag, why in ALLOWED_FLAGS.items():
        by_reason.setdefault(why, []).append(f"`{flag}`")
    for why, flags in by_reason.items():
        rows.append(f"| {', '.join(flags)} | passed through | {why} | `{FLAGS_TEST}` |")
    for flag, why in REFUSAL_REASONS.items():
        rows.append(f"| `{flag}` | refused | {why} | `{FLAGS_TEST}` |")
    rows.append(f"| any other flag | refused | not on the allow-list | `{FLAGS_TEST}` |")
    return "\n".join(rows) + "\n"


def flag_name(arg: str) -> str | None:
    """`--max_num_seqs=4` -> `--max-num-seqs`; None for a value (not a flag)."""
    if not arg.startswith("-") or arg == "-" or _is_number(arg):
        return None
    name = arg.split("=", 1)[0]
    if name.startswith("--"):
        return "--" + name[2:].replace("_", "-")
    return name


def _is_number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return True


def refused_flags(vllm_args: Sequence[str]) -> dict[str, str]:
    """flag -> reason, for every flag in `vllm_args` not on the allow-list."""
    out = {}
    for arg in vllm_args:
        name = flag_name(arg)
        if name is not None and name not in ALLOWED_FLAGS:
            out[name] = REFUSAL_REASONS.get(name, "not on IsoExec's allow-list")
    return out


def given(vllm_args: Sequence[str], flag: str) -> bool:
    return any(flag_name(a) == flag for a in vllm_args)


__all__ = ["ALLOWED_FLAGS", "flag_name", "flags_markdown", "given", "refused_flags"]
