"""A served engine (vLLM's OpenAI server) and the trainer: handshake and weight push, no
dev-mode endpoints.

- **Handshake at startup.** The engine is given where to offer (`ServedHandshake`: the
  service's address, a token file, a run id, optional TLS) through vLLM's own
  `additional_config[HANDSHAKE_CONFIG_KEY]` (`isoexec engine serve --handshake-*` sets it).
  Each worker offers its contract as soon as it has loaded its checkpoint (and so again after
  a restart) and is cleared for weights only on MATCH. These settings say where to meet, not
  what runs, so they are not in the contract.
- **Weight push.** `push_weights` sends HF-named tensors and their fingerprint to the server's
  `WEIGHTS_ROUTE`, authenticated with the same token; every worker checks the fingerprint and
  its MATCH (the weight gate) before loading, between engine steps. `served_status` reads each
  worker's gate state. The routes are served by `isoexec.vllm.served_routes` (vLLM's
  `--middleware` extension point).
- **Offer again.** `served_reoffer` makes every worker offer its contract again (the service
  was restarted and forgot the run, or the trainer re-offered a changed contract): the
  engine's weights stay cleared only on the new MATCH.
- **Canary before sampling.** An engine started with handshake settings samples only once a
  canary (`isoexec.contract.canary`) of the weights it holds has MATCHed: at start-up and after
  every push. `served_canary` asks the engine to score and offer its canary for a weights
  version while the trainer offers its own (`isoexec.megatron.canary`).
- **Adapter push.** `push_adapter` sends a LoRA adapter (PEFT-named tensors, its PEFT config,
  a name and the trainer's fingerprint) to `ADAPTER_ROUTE`: every worker announces it after
  checking its MATCH, the server loads it under that name through vLLM's own adapter loading
  (which the adapter gate checks against the fingerprint), and sampling waits for a canary run
  under it (`served_canary(..., adapter=name)`), as after a weight push.
- **What each completion was sampled with.** Every completion response carries a
  `SamplingRecord` (effective temperature, logprobs mode, weights version, adapter) in
  `SAMPLING_HEADER`; the trainer scores with it and refuses a sequence without it.

Framework-free: a trainer node imports this without vLLM.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from isoexec.handshake.tls import ClientTLS

HANDSHAKE_CONFIG_KEY = "isoexec_handshake"
WEIGHTS_ROUTE = "/isoexec/weights"
STATUS_ROUTE = "/isoexec/status"
CANARY_ROUTE = "/isoexec/canary"
ADAPTER_ROUTE = "/isoexec/adapter"
OFFER_ROUTE = "/isoexec/offer"
FINGERPRINT_HEADER = "X-IsoExec-Weight-Fingerprint"
ADAPTER_NAME_HEADER = "X-IsoExec-Adapter-Name"
ADAPTER_CONFIG_HEADER = "X-IsoExec-Adapter-Config"  # the adapter's PEFT config, JSON
# The weights version a push creates (the engine's current + 1); an older one is refused.
VERSION_HEADER = "X-IsoExec-Weights-Version"
DEFAULT_OFFER_TIMEOUT_S = 3600.0  # a served engine may start long before its trainer


SAMPLING_HEADER = "X-IsoExec-Sampling"
SAMPLING_FIELDS = (
    "temperature", "logprobs_mode", "weights_version", "adapter", "top_k", "top_p", "min_p",
    "weights_fingerprint", "repetition_penalty", "frequency_penalty", "presence_penalty",
    "logit_bias", "allowed_token_ids",
)  # fmt: skip
# The largest record a server sends (a long allow-list or bias map): HTTP clients cap a
# response's header block (h11, under httpx and the openai client: 16 KiB); the server refuses
# a request whose record would not fit, rather than send one the client cannot read.
MAX_SAMPLING_HEADER_BYTES = 8192


class SamplingRecordError(ValueError):
    """A sequence without the record of what it was sampled with, or a malformed one."""


@dataclass(frozen=True)
class SamplingRecord:
    """What a served completion was sampled with, after the server's defaults: the effective
    temperature and truncation (top-k, top-p, min-p in vLLM's spelling: 0, 1.0, 0.0 are off),
    the engine's logprobs mode, and the weights version it was sampled under (0: as loaded,
    +1 per push, or the version the push stated) with those weights' fingerprint (None: the
    checkpoint the engine started from). The server sends it in `SAMPLING_HEADER` of every
    completion response; the trainer scores with it (`isoexec.megatron.score_sampled`). The
    other settings need no record: the admission check lets through only those that leave
    the distribution alone. The penalties, logit bias (sorted (id, bias) pairs, after vLLM's
    clamp to [-100, 100]) and allow-list are `isoexec.ops.penalties.Penalties`'s."""

    temperature: float
    logprobs_mode: str
    weights_version: int
    adapter: str | None = None  # the LoRA adapter (the request's model name), None: the base
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    weights_fingerprint: str | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None

    def to_header(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def penalties(self) -> Any:
        """The record's logit adjustments (`isoexec.ops.penalties.Penalties`)."""
        from isoexec.ops.penalties import Penalties

        return Penalties(self.repetition_penalty, self.frequency_penalty, self.presence_penalty,
                         self.logit_bias, self.allowed_token_ids)  # fmt: skip

    @classmethod
    def from_header(cls, text: str | None) -> SamplingRecord:
        if not text:
            raise SamplingRecordError(
                f"no {SAMPLING_HEADER} header: the completion does not say what it was sampled "
                "with (an IsoExec server sends it with every completion)"
            )
        try:
            raw = json.loads(text)
            if set(raw) != set(SAMPLING_FIELDS):
                raise ValueError(f"fields {sorted(raw)}, want {sorted(SAMPLING_FIELDS)}")
            adapter = raw["adapter"]
            if adapter is not None and not isinstance(adapter, str):
                raise ValueError(f"adapter {adapter!r} is not a name")
            if isinstance(raw["top_k"], bool) or not isinstance(raw["top_k"], int):
                raise ValueError(f"top_k {raw['top_k']!r} is not an integer")
            fingerprint = raw["weights_fingerprint"]
            if fingerprint is not None and not isinstance(fingerprint, str):
                raise ValueError(f"weights_fingerprint {fingerprint!r} is not a digest")
            allowed = raw["allowed_token_ids"]
            record = cls(float(raw["temperature"]), str(raw["logprobs_mode"]),
                         int(raw["weights_version"]), adapter, raw["top_k"],
                         float(raw["top_p"]), float(raw["min_p"]), fingerprint,
                         float(raw["repetition_penalty"]), float(raw["frequency_penalty"]),
                         float(raw["presence_penalty"]),
                         tuple((t, float(b)) for t, b in raw["logit_bias"]),
                         None if allowed is None else tuple(allowed))  # fmt: skip
            record.penalties()  # validated: ids, finite values, sorted, distinct
        except (ValueError, TypeError, AttributeError) as e:
            raise SamplingRecordError(f"malformed {SAMPLING_HEADER} header {text!r}: {e}") from None
        return record


class ServedHandshakeError(ValueError):
    """Malformed handshake settings for a served engine."""


class WeightPushError(RuntimeError):
    """The served engine refused pushed weights (or could not be reached); nothing loaded."""


@dataclass(frozen=True)
class ServedHandshake:
    address: str
    token_file: str
    run_id: str
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    timeout_s: float = DEFAULT_OFFER_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("address", "token_file", "run_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ServedHandshakeError(f"handshake {name} must be a non-empty string")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ServedHandshakeError("a TLS client certificate needs its key, and a key its cert")
        if self.tls_cert is not None and self.tls_ca is None:
            raise ServedHandshakeError("a TLS client certificate needs tls_ca")

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> ServedHandshake:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(m) - known)
        if unknown:
            raise ServedHandshakeError(
                f"unknown handshake setting(s) {unknown}; known: {sorted(known)}"
            )
        missing = sorted({"address", "token_file", "run_id"} - set(m))
        if missing:
            raise ServedHandshakeError(f"handshake settings lack {missing}")
        return cls(**dict(m))

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def token(self) -> str:
        """The shared token, read from its file (refused when missing or empty)."""
        from isoexec.handshake.token import TokenFileError, read_token_file

        try:
            return read_token_file(self.token_file)
        except TokenFileError as e:
            raise ServedHandshakeError(f"handshake token file: {e}") from None

    def client_tls(self) -> ClientTLS | None:
        """How to reach a TLS handshake service; None for a plaintext (loopback) one."""
        from isoexec.handshake.tls import ClientTLS, TLSConfigError

        if self.tls_ca is None:
            return None
        try:
            return ClientTLS(self.tls_ca, self.tls_cert, self.tls_key)
        except TLSConfigError as e:
            raise ServedHandshakeError(f"handshake TLS: {e}") from None


def push_weights(
    base_url: str,
    token: str,
    tensors: Mapping[str, Any],
    *,
    fingerprint: str | None = None,
    timeout_s: float = 600.0,
    version: int | None = None,
) -> list[str]:
    """Send HF-named `tensors` to a served engine; return each worker's fingerprint of the
    weights it then holds (all equal to the sent one). Raises `WeightPushError` with the
    server's reason when it refuses (wrong token, no MATCH, a fingerprint that does not match
    the bytes, not the model's tensor set, a body larger than the model, `version` not newer
    than the engine's): nothing is loaded then. `version`: the weights version this push
    creates (a trainer that restarted from an old checkpoint cannot push over newer weights)."""
    from safetensors.torch import save

    from isoexec.contract.fingerprint import WeightFingerprint

    body = save({k: v.contiguous() for k, v in tensors.items()})
    sent = fingerprint or WeightFingerprint.of(tensors).digest
    headers = {FINGERPRINT_HEADER: sent, "Content-Type": "application/octet-stream"}
    if version is not None:
        headers[VERSION_HEADER] = str(int(version))
    reply = _request(base_url + WEIGHTS_ROUTE, token, body, headers, timeout_s)
    return [str(f) for f in reply["fingerprints"]]


def push_adapter(
    base_url: str,
    token: str,
    name: str,
    tensors: Mapping[str, Any],
    peft_config: Mapping[str, Any],
    fingerprint: str,
    *,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Send a LoRA adapter to a served engine, to be served as model `name`; the reply holds
    the weights version sampling now waits on (a canary under the adapter). Raises
    `WeightPushError` with the server's reason when it refuses (wrong token, no MATCH, tensors
    that do not hash to `fingerprint` — the trainer's, `TrainerLora.fingerprint`)."""
    from safetensors.torch import save

    body = save({k: v.contiguous() for k, v in tensors.items()})
    headers = {FINGERPRINT_HEADER: fingerprint, ADAPTER_NAME_HEADER: name,
               ADAPTER_CONFIG_HEADER: json.dumps(dict(peft_config)),
               "Content-Type": "application/octet-stream"}  # fmt: skip
    return _request(base_url + ADAPTER_ROUTE, token, body, headers, timeout_s)


def served_canary(
    base_url: str,
    token: str,
    weights_version: int,
    timeout_s: float = 600.0,
    *,
    adapter: str | None = None,
) -> dict[str, Any]:
    """Ask a served engine to score the run's canary probe under the weights it holds (and
    the LoRA adapter `adapter`, pushed before) and offer it for `weights_version` (0 at start,
    +1 per push); its verdict (`matched`, `summary`, `first_position`, `engine_scored_s`). The
    trainer offers its own concurrently; the engine samples again only after a MATCH."""
    body = json.dumps({"weights_version": int(weights_version), "adapter": adapter}).encode()
    headers = {"Content-Type": "application/json"}
    return _request(base_url + CANARY_ROUTE, token, body, headers, timeout_s)


def served_reoffer(base_url: str, token: str, timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Every worker of a served engine offers its contract again to the service it was started
    with (the trainer offers its own concurrently); each worker's verdict (`outcome`, `hash`,
    `summary`, `diff`). Without MATCH the engine is refused weights and samples nothing."""
    reply = _request(base_url + OFFER_ROUTE, token, b"{}", {}, timeout_s)
    return list(reply["verdicts"])


def served_status(base_url: str, token: str, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Each worker's gate state: cleared, last verdict, gated loads, last fingerprint."""
    return list(_request(base_url + STATUS_ROUTE, token, None, {}, timeout_s)["workers"])


def _request(
    url: str, token: str, body: bytes | None, headers: dict[str, str], timeout_s: float
) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=body, method="POST" if body is not None else "GET",
        headers={**headers, "Authorization": f"Bearer {token}"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return dict(json.loads(r.read()))
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        try:
            detail = json.loads(detail)["error"]
        except (ValueError, KeyError, TypeError):
            pass
        raise WeightPushError(f"{url}: HTTP {e.code}: {detail}") from None
    except urllib.error.URLError as e:
        raise WeightPushError(f"{url}: {e.reason}") from None


__all__ = [
    "ADAPTER_CONFIG_HEADER",
    "ADAPTER_NAME_HEADER",
    "ADAPTER_ROUTE",
    "CANARY_ROUTE",
    "FINGERPRINT_HEADER",
    "HANDSHAKE_CONFIG_KEY",
    "SAMPLING_HEADER",
    "STATUS_ROUTE",
    "VERSION_HEADER",
    "WEIGHTS_ROUTE",
    "SamplingRecord",
    "SamplingRecordError",
    "ServedHandshake",
    "ServedHandshakeError",
    "WeightPushError",
    "push_adapter",
    "push_weights",
    "served_canary",
    "served_status",
]
