"""`isoexec`: the project's single console script, an argparse dispatcher.

A subcommand is one entry in `SUBCOMMANDS`: (name, module, one-line help). The module provides
`add_parser(subparsers) -> argparse.ArgumentParser` and `run(args) -> int` (the exit code).
Only the chosen subcommand's module is imported, so `isoexec --help` stays fast even when a
subcommand (say `bench`) imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS: list[tuple[str, str, str]] = [
    ("contract", "isoexec.tools.cli_contract", "show, hash and diff execution contracts"),
    ("handshake", "isoexec.handshake.cli", "serve or use the contract handshake"),
    ("pair", "isoexec.tools.pair", "trainer vs engine, bitwise, IsoExec on and off"),
    ("locate", "isoexec.tools.cli_locate", "first divergent site between two traces"),
    ("bench", "isoexec.tools.bench", "IsoExec's overhead: engine tok/s, trainer ms/token"),
    ("engine", "isoexec.vllm.serve", "vLLM's OpenAI server with IsoExec (engine serve)"),
]


def build_parser(chosen: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="isoexec",
        description="IsoExec: bitwise-identical logprobs between trainer and rollout engine.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module, help_text in SUBCOMMANDS:
        if name == chosen:
            try:
                mod = importlib.import_module(module)
            except ModuleNotFoundError as e:  # a node with the other side only
                parser.exit(2, f"isoexec {name}: module {e.name!r} is not installed on this node\n")
            p = mod.add_parser(sub)
            p.set_defaults(_module=module)
        else:  # a placeholder, enough for the top-level help listing
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in args_list if not a.startswith("-")), None)
    parser = build_parser(chosen)
    args = parser.parse_args(args_list)
    module = getattr(args, "_module", None)
    if module is None:  # the placeholder of an unknown/unloaded name cannot happen, but be safe
        parser.error(f"unknown command {args.command!r}")
    return int(importlib.import_module(module).run(args))


if __name__ == "__main__":
    sys.exit(main())
