"""The gate on every LoRA adapter an IsoExec engine worker loads.

An adapter changes the logprobs as much as a weight sync does, so it passes the same gate:
every path vLLM 0.32 has for putting an adapter into a worker — a request's `LoRARequest`,
`LLM.llm_engine.add_lora`, the server's `/v1/load_lora_adapter` — ends in
`WorkerLoRAManager._load_adapter`, which IsoExec wraps (`patches.gate_adapter_loads`). A load
passes only if

1. the adapter's name was announced with the trainer's fingerprint of it while this worker held
   a MATCH the handshake service confirmed (`expect_adapter`, the worker extension's
   `isoexec_expect_adapter`; `weight_gate.require_match`), and
2. the adapter's tensors, as the engine will hold them (in the LoRA dtype), hash to that
   fingerprint — the same `WeightFingerprint` the trainer takes of its adapter
   (`TrainerLora.fingerprint`).

Anything else is refused before vLLM reads the adapter into a slot. A verified adapter that
vLLM evicts from its cache and reads again passes on its fingerprint alone (the same bytes).

The frontend half (`check_request_adapter`): vLLM loads an adapter a request names for the
first time inside the engine's step, where a refusal would fail every request of the batch.
So a request may name only an adapter added first — `LLM.llm_engine.add_lora`,
`AsyncLLM.add_lora`, `/v1/load_lora_adapter` — which passed the gate as the caller's own error
or success; any other is refused at admission, for that request alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from isoexec.vllm.weight_gate import WeightSyncRefusedError, require_match

ADAPTER_FILE = "adapter_model.safetensors"
# adapter name -> the trainer's fingerprint of the adapter, announced after this worker's MATCH
# (by name: the OpenAI server's /v1/load_lora_adapter takes a name and picks the id itself)
EXPECTED: dict[str, str] = {}
# adapter name -> fingerprint of every adapter this worker loaded through the gate (reported
# beside the weights' fingerprint by `isoexec_gate_status`)
LOADED: dict[str, str] = {}
# adapter name -> (fingerprint, this worker's private copy of the verified files)
_VERIFIED: dict[str, tuple[str, str]] = {}
# Frontend: ids of the adapters added through the engine's add_lora (they passed the gate).
ADDED: set[int] = set()


class AdapterRefusedError(WeightSyncRefusedError):
    """An adapter load without MATCH, without an announcement, or with other tensors."""


def adapter_fingerprint(path: str | Path, dtype: torch.dtype) -> str:
    """Fingerprint of the PEFT adapter in directory `path` (its config and its tensors as held
    in `dtype`: vLLM converts adapters to its LoRA dtype, the model's; the trainer holds them
    in the model's dtype). Refuses an adapter on the lm head or the embedding, and a config
    the canonical op does not compute (`AdapterConfig`)."""
    from safetensors.torch import load_file

    from isoexec.contract.adapter import AdapterConfig, LoraAdapterError
    from isoexec.contract.adapter import adapter_fingerprint as fingerprint
    from isoexec.vllm.lora import UNCOVERED_TARGETS

    try:
        config = AdapterConfig.read(path)
    except LoraAdapterError as e:
        raise AdapterRefusedError(f"adapter refused: {e}") from None

    file = Path(path) / ADAPTER_FILE
    if not file.is_file():
        raise AdapterRefusedError(f"adapter {path}: no {ADAPTER_FILE} (IsoExec reads no .bin)")
    tensors = load_file(str(file))
    uncovered = sorted({t for k in tensors for t in UNCOVERED_TARGETS if f".{t}." in k})
    if uncovered:
        raise AdapterRefusedError(
            f"adapter {path} targets {uncovered}: no canonical trainer LoRA there (adapters on "
            "the attention and MLP projections only)"
        )
    return fingerprint({k: v.to(dtype) for k, v in tensors.items()}, config)


def expect_adapter(name: str, fingerprint: str) -> None:
    """Announce the adapter `name` with the trainer's fingerprint (needs this worker's MATCH)."""
    require_match(f"isoexec_expect_adapter({name!r})")
    if not (isinstance(fingerprint, str) and len(fingerprint) == 64):
        raise AdapterRefusedError(f"adapter {name!r}: {fingerprint!r} is not a fingerprint")
    EXPECTED[str(name)] = fingerprint


def _private_copy(path: str | Path) -> str:
    """The adapter's two files copied into a directory of this worker's (kept for its life)."""
    import atexit
    import shutil
    import tempfile

    directory = tempfile.mkdtemp(prefix="isoexec-verified-adapter-")
    if not _VERIFIED:
        atexit.register(lambda: [shutil.rmtree(d, ignore_errors=True) for _, d in
                                 _VERIFIED.values()])  # fmt: skip
    for name in (ADAPTER_FILE, "adapter_config.json"):
        shutil.copyfile(Path(path) / name, Path(directory) / name)
    return directory


def check_adapter_load(manager: Any, lora_request: Any) -> Any:
    """The request to load in place of `lora_request` (its path: this worker's verified copy);
    refuses (AdapterRefusedError) unless it passes the gate.

    The adapter is verified on a private copy, which is what vLLM then reads — also when it
    evicts the adapter and reads it again inside a later step: a trainer that overwrites the
    adapter's directory in place cannot change (or, with a refusal mid-step, stop) what an
    engine serves under that name. Push a changed adapter under a new name."""
    import msgspec

    name, int_id = lora_request.lora_name, int(lora_request.lora_int_id)
    want = EXPECTED.get(name)
    verified = _VERIFIED.get(name)
    if verified is not None and verified[0] == want:
        return msgspec.structs.replace(lora_request, lora_path=verified[1])
    if want is None:
        raise AdapterRefusedError(
            f"LoRA adapter {name!r} (id {int_id}) refused: it was not announced with the "
            "trainer's fingerprint after MATCH (isoexec_expect_adapter); an adapter the trainer "
            "does not hold would be sampled under a MATCH"
        )
    dtype = manager.lora_config.lora_dtype
    private = _private_copy(lora_request.lora_path)  # what is checked is what is loaded
    got = adapter_fingerprint(private, dtype)
    if got != want:
        raise AdapterRefusedError(
            f"LoRA adapter {name!r} (id {int_id}) refused: its tensors hash to {got[:16]}…, "
            f"the trainer announced {want[:16]}… (another adapter, or a partial write)"
        )
    _VERIFIED[name] = (got, private)
    LOADED[name] = got
    return msgspec.structs.replace(lora_request, lora_path=private)


def record_added(lora_request: Any, loaded: bool) -> None:
    """Frontend: the engine's add_lora returned (it raised if the gate refused)."""
    ADDED.add(int(lora_request.lora_int_id))


def record_removed(lora_id: int) -> None:
    ADDED.discard(int(lora_id))


def check_request_adapter(lora_request: Any) -> None:
    """Frontend, at admission: a request may name only an adapter added through the gate."""
    if lora_request is None or int(lora_request.lora_int_id) in ADDED:
        return
    raise AdapterRefusedError(
        f"IsoExec refuses this request: LoRA adapter {lora_request.lora_name!r} (id "
        f"{lora_request.lora_int_id}) was not added through the adapter gate; add it first "
        "(LLM.llm_engine.add_lora / AsyncLLM.add_lora / POST /v1/load_lora_adapter after "
        "announcing its fingerprint)"
    )


__all__ = [
    "ADDED",
    "EXPECTED",
    "LOADED",
    "AdapterRefusedError",
    "adapter_fingerprint",
    "check_adapter_load",
    "check_request_adapter",
    "expect_adapter",
    "record_added",
    "record_removed",
]
