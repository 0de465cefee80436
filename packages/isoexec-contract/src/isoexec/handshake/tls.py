"""TLS for the handshake service: server certificates, optional mutual TLS, and the rule that
a non-loopback address is never served in plaintext unless asked for explicitly.

Trainers and engines live on different nodes, and the auth token travels in the request
metadata: without TLS anyone on the path reads it. `ServerTLS` gives the server a certificate
(and, with `client_ca`, requires every client to present one signed by that CA); `ClientTLS`
gives a participant the CA it trusts for the server (and, for mutual TLS, its own certificate
and key). Paths are plain strings so the settings cross process boundaries (engine workers,
torchrun ranks) as they are.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc


class TLSConfigError(ValueError):
    """Unreadable or incomplete TLS material, or plaintext where TLS is required."""


def _read(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TLSConfigError(f"cannot read {what} {path}: {e}") from None
    if not data.strip():
        raise TLSConfigError(f"{what} {path} is empty")
    return data


@dataclass(frozen=True)
class ServerTLS:
    """The server's certificate chain and key (PEM); `client_ca`: require client certificates
    signed by this CA (mutual TLS)."""

    cert: str
    key: str
    client_ca: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        cert, key = _read(self.cert, "server certificate"), _read(self.key, "server key")
        assert cert is not None and key is not None
        ca = _read(self.client_ca, "client CA")
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
        )


@dataclass(frozen=True)
class ClientTLS:
    """The CA that signed the server's certificate; `cert`/`key`: this participant's own
    certificate for mutual TLS (both or neither)."""

    ca: str
    cert: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise TLSConfigError("a client certificate needs its key, and a key its certificate")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "CA certificate"),
            private_key=_read(self.key, "client key"),
            certificate_chain=_read(self.cert, "client certificate"),
        )

    def to_dict(self) -> dict[str, str | None]:
        return {"ca": self.ca, "cert": self.cert, "key": self.key}


def is_loopback(host: str) -> bool:
    """True for a loopback address or `localhost` (plaintext stays on the machine)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_plaintext_allowed(host: str, *, insecure: bool) -> None:
    """Refuse to serve `host` without TLS unless it is loopback or `insecure` was given."""
    if not is_loopback(host) and not insecure:
        raise TLSConfigError(
            f"refusing to serve the handshake on {host} without TLS: the auth token would "
            "cross the network in the clear; give a certificate (--tls-cert/--tls-key) or "
            "pass --insecure explicitly"
        )


__all__ = ["ClientTLS", "ServerTLS", "TLSConfigError", "check_plaintext_allowed", "is_loopback"]
