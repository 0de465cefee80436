"""The shared auth token, read from a file (never from a command line): one reader for the
handshake CLI, torchrun trainer ranks and served engine workers."""

from __future__ import annotations

from pathlib import Path


class TokenFileError(ValueError):
    """The token file cannot be read, or holds no token."""


def read_token_file(path: str | Path) -> str:
    """The token in `path`, surrounding whitespace stripped; refused when unreadable or empty."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise TokenFileError(f"cannot read token file {path}: {e}") from None
    if not token:
        raise TokenFileError(f"token file {path} is empty")
    return token


__all__ = ["TokenFileError", "read_token_file"]
