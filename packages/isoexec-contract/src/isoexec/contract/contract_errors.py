"""The contract's refusal errors (one module, imported by the contract, its codec and its
validation)."""

from __future__ import annotations


class ContractError(ValueError):
    """A contract that cannot be built, read or trusted."""


class SchemaVersionError(ContractError):
    """The bytes declare a schema version this code does not know: refused, never guessed."""
