"""The contract handshake: every trainer rank and engine worker offers its contract to one
rendezvous service and gets the same verdict before any weight sync.

Server side: `HandshakeServer`; participant side: `HandshakeClient`; rules: `rendezvous`.
"""

from isoexec.handshake.client import HandshakeClient
from isoexec.handshake.server import HandshakeServer
from isoexec.handshake.types import (
    MATCH,
    MISMATCH,
    TOKEN_METADATA_KEY,
    ContractMismatchError,
    HandshakeError,
    ParticipantHash,
    Verdict,
)

__all__ = [
    "MATCH",
    "MISMATCH",
    "TOKEN_METADATA_KEY",
    "ContractMismatchError",
    "HandshakeClient",
    "HandshakeError",
    "HandshakeServer",
    "ParticipantHash",
    "Verdict",
]
