"""TLS material handed to actors as bytes, written by each actor to its own private files.

The handshake crosses nodes, so it runs over TLS. The driver reads the PEM files once and
passes their bytes; an actor on another node must not read a path on the driver's disk.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from isoexec.handshake.tls import ClientTLS, ServerTLS


@dataclass(frozen=True)
class TLSMaterial:
    """The CA, the handshake service's certificate and key, and (mutual TLS) the certificate
    and key every trainer rank and engine worker presents; PEM bytes."""

    ca: bytes
    server_cert: bytes
    server_key: bytes
    client_cert: bytes | None = None
    client_key: bytes | None = None

    @staticmethod
    def from_files(
        ca: str, server_cert: str, server_key: str,
        client_cert: str | None = None, client_key: str | None = None,
    ) -> TLSMaterial:  # fmt: skip
        def read(p: str | None) -> bytes | None:
            return None if p is None else Path(p).read_bytes()

        return TLSMaterial(
            Path(ca).read_bytes(), Path(server_cert).read_bytes(), Path(server_key).read_bytes(),
            read(client_cert), read(client_key),
        )  # fmt: skip

    @property
    def mutual(self) -> bool:
        return self.client_cert is not None

    def server(self) -> ServerTLS:
        d = _private_dir()
        return ServerTLS(
            cert=_write(d, "server.pem", self.server_cert),
            key=_write(d, "server.key", self.server_key),
            client_ca=_write(d, "ca.pem", self.ca) if self.mutual else None,
        )

    def client(self) -> ClientTLS:
        d = _private_dir()
        return ClientTLS(
            ca=_write(d, "ca.pem", self.ca),
            cert=None if self.client_cert is None else _write(d, "client.pem", self.client_cert),
            key=None if self.client_key is None else _write(d, "client.key", self.client_key),
        )


def _private_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="isoexec-tls-"))  # mode 0700


def _write(d: Path, name: str, data: bytes) -> str:
    p = d / name
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return str(p)


__all__ = ["TLSMaterial"]
