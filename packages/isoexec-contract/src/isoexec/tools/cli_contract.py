"""`isoexec contract show|hash|diff|write`: inspect execution contracts from files, and write
the contract one side would offer for a model (`write`: the side's package does it).

Exit codes: 0 ok / equal, 1 contracts differ (diff), 2 bad input (one-line error on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys

NAME = "contract"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help="show, hash, diff and write execution contracts")
    sub = p.add_subparsers(dest="contract_command", metavar="ACTION", required=True)
    show = sub.add_parser("show", help="print a contract readably")
    show.add_argument("file")
    show.add_argument("--json", action="store_true", help="print indented JSON instead")
    h = sub.add_parser("hash", help="print the contract hash (SHA-256 of the canonical bytes)")
    h.add_argument("file")
    d = sub.add_parser("diff", help="explain how two contracts differ (exit 1 if they do)")
    d.add_argument("a")
    d.add_argument("b")
    w = sub.add_parser("write", help="write the contract a side offers for a model to a file")
    w.add_argument("--model", required=True, help="HF checkpoint directory")
    w.add_argument("--side", required=True, choices=sorted(WRITERS))
    w.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16")
    w.add_argument("--tp-invariant", action="store_true", help="the TP-invariant variant")
    w.add_argument("--backend", default="torch", help="canonical kernels: torch or triton")
    w.add_argument("out", help="where to write the contract (JSON)")
    return p


# side -> (module whose `write(model_dir, out, dtype, options)` builds that side, its package)
WRITERS = {
    "trainer": ("isoexec.megatron.contract_file", "isoexec-megatron"),
    "engine": ("isoexec.vllm.contract_file", "isoexec-vllm"),
}


def _write(args: argparse.Namespace) -> int:
    import importlib
    import importlib.util

    from isoexec.contract.options import IsoExecOptions

    module, dist = WRITERS[args.side]
    if importlib.util.find_spec(module.rsplit(".", 1)[0]) is None:
        raise _BadInput(f"the {args.side} side is not installed on this node: pip install {dist}")
    options = IsoExecOptions(tp_invariant=args.tp_invariant, backend=args.backend)
    try:
        contract = importlib.import_module(module).write(args.model, args.out, args.dtype, options)
    except (OSError, ValueError) as e:
        raise _BadInput(str(e)) from None
    print(f"{args.side} contract {contract.hash} written to {args.out}")
    return 0


def run(args: argparse.Namespace) -> int:
    from isoexec.contract.contract import Contract, ContractError

    def load(path: str) -> Contract:
        try:
            return Contract.load(path)
        except OSError as e:
            raise _BadInput(f"cannot read {path}: {e.strerror or e}") from None
        except ContractError as e:
            raise _BadInput(f"{path}: {e}") from None

    try:
        if args.contract_command == "write":
            return _write(args)
        if args.contract_command == "hash":
            print(load(args.file).hash)
            return 0
        if args.contract_command == "show":
            c = load(args.file)
            if args.json:
                print(json.dumps(c.to_dict(), indent=2, sort_keys=True, ensure_ascii=False))
            else:
                print(render(c))
            return 0
        if args.contract_command == "diff":
            from isoexec.contract.diff import diff

            a, b = load(args.a), load(args.b)
            d = diff(a, b)
            if d.equal:
                print(d.summary())
                return 0
            for line in d.lines:
                print(line)
            print(d.summary())
            return 1
    except _BadInput as e:
        print(f"isoexec contract: error: {e}", file=sys.stderr)
        return 2
    raise AssertionError(args.contract_command)


class _BadInput(Exception):
    pass


def render(c: object) -> str:
    """Human-readable view: identity first, then one line per site in contract order."""
    from isoexec.contract.contract import Contract

    assert isinstance(c, Contract)
    lines = [
        f"hash      {c.hash}",
        f"schema    {c.schema_version}",
        f"model     {c.model.architecture}  config {c.model.config_digest}",
        f"layers    {len(c.model.layer_kinds)}: {_kinds(c.model.layer_kinds)}",
        "dtypes    " + "  ".join(f"{k}={v}" for k, v in vars(c.dtypes).items()),
        "device    " + "  ".join(f"{k}={v}" for k, v in vars(c.device).items() if v is not None),
        f"sites     {len(c.sites)} ({len(c.native_sites)} native)",
    ]
    width = max(len(s.name) for s in c.sites)
    for s in c.sites:
        params = " ".join(f"{k}={v}" for k, v in s.impl.params)
        fp = f" src={s.impl.source_fingerprint[:12]}" if s.impl.source_fingerprint else ""
        tp = "" if s.tp == "1" else f" tp={s.tp}"
        lines.append(
            f"  {s.name:<{width}}  {s.impl.op:<14} {s.impl.impl_id} v{s.impl.version}"
            f" [{s.impl.backend}]{tp}{fp}{' ' + params if params else ''}"
        )
    return "\n".join(lines)


def _kinds(kinds: tuple[str, ...]) -> str:
    """Run-length form: 'linear_attention×3, attention, …' keeps hybrid layouts readable."""
    out: list[str] = []
    i = 0
    while i < len(kinds):
        j = i
        while j < len(kinds) and kinds[j] == kinds[i]:
            j += 1
        out.append(kinds[i] if j - i == 1 else f"{kinds[i]}×{j - i}")
        i = j
    return ", ".join(out) or "-"
