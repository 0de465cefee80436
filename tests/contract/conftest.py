"""Fixtures for the handshake tests: servers on ephemeral loopback ports, always stopped."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from _contract_testlib import TOKEN

from isoexec.handshake import HandshakeServer


@pytest.fixture()
def make_server() -> Iterator[Callable[..., HandshakeServer]]:
    servers: list[HandshakeServer] = []

    def make(expected: dict[str, int] | None = None, **kw: object) -> HandshakeServer:
        s = HandshakeServer(expected or {"trainer": 1, "engine": 2}, TOKEN, port=0, **kw)  # type: ignore[arg-type]
        servers.append(s)
        s.start()
        return s

    try:
        yield make
    finally:
        for s in servers:
            s.stop(grace=0)
