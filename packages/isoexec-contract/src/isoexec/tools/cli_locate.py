"""`isoexec locate TRAINER_TRACE ENGINE_TRACE`: the first site where two traces part ways.

Exit codes: 0 no divergence, 1 divergence found, 2 bad input (one-line error on stderr).
Traces come from `isoexec pair --locate` or the side tracers (`isoexec.megatron.trace`,
`EngineProcess.call("trace", …)`); see README "Finding the first divergent site".
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

NAME = "locate"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        NAME,
        help="first divergent site between a trainer trace and an engine trace",
        description="Align two per-site traces and print the first divergent site in "
        "execution order (layer, site, token position). Exit 0: no divergence, "
        "1: divergence found, 2: bad input.",
    )
    p.add_argument("trainer_trace", metavar="TRAINER_TRACE")
    p.add_argument("engine_trace", metavar="ENGINE_TRACE")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def _as_json(result: Any) -> str:
    d = asdict(result)
    if result.first is not None:
        for side in ("a", "b"):
            d["first"][side].pop("values", None)
    return json.dumps(d, indent=2)


def run(args: argparse.Namespace) -> int:
    from isoexec.contract.trace import Trace, TraceFormatError
    from isoexec.tools.locate import format_result, locate

    try:
        a = Trace.read(args.trainer_trace)
        b = Trace.read(args.engine_trace)
        result = locate(a, b)
    except TraceFormatError as e:
        print(f"isoexec locate: error: {e}", file=sys.stderr)
        return 2
    print(_as_json(result) if args.json else format_result(result))
    return 1 if result.diverged else 0
