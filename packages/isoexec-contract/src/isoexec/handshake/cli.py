"""`isoexec handshake serve|offer|query`: run the rendezvous service standalone, or offer a
contract file by hand (debugging a refusal without starting a trainer).

Exit codes: 0 served / MATCH / cleared, 1 MISMATCH / not cleared, 2 refused or bad input.
"""

from __future__ import annotations

import argparse
import sys

NAME = "handshake"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help="serve or use the contract handshake")
    sub = p.add_subparsers(dest="handshake_command", metavar="ACTION", required=True)
    # No abbreviations: `--token SECRET` must not pass for `--token-file` (tokens never in argv).
    serve = sub.add_parser(
        "serve", help="run the ContractExchange service until interrupted", allow_abbrev=False
    )
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=0, help="port (0: pick a free one)")
    serve.add_argument("--token-file", help=TOKEN_HELP)
    serve.add_argument("--tls-cert", help="server certificate chain (PEM): serve over TLS")
    serve.add_argument("--tls-key", help="the server certificate's private key (PEM)")
    serve.add_argument(
        "--tls-client-ca", help="require client certificates signed by this CA (mutual TLS)"
    )
    serve.add_argument(
        "--insecure",
        action="store_true",
        help="allow plaintext on a non-loopback address (the token travels in the clear)",
    )
    serve.add_argument(
        "--expect",
        action="append",
        metavar="SIDE=N",
        help="expected participants, repeatable or comma-separated (default trainer=1,engine=1)",
    )
    serve.add_argument("--rendezvous-timeout", type=float, default=300.0, metavar="S")
    for name, help_text in (("offer", "offer a contract file"), ("query", "may it get weights?")):
        q = sub.add_parser(name, help=help_text, allow_abbrev=False)
        q.add_argument("--address", required=True, help="host:port of the service")
        q.add_argument("--token-file", help=TOKEN_HELP)
        q.add_argument("--tls-ca", help="CA that signed the server's certificate: use TLS")
        q.add_argument("--tls-cert", help="this participant's certificate (mutual TLS)")
        q.add_argument("--tls-key", help="this participant's private key (mutual TLS)")
        q.add_argument("--run-id", required=True)
        q.add_argument("--side", required=True)
        q.add_argument("--rank", type=int, default=0)
        q.add_argument("--timeout", type=float, default=60.0, metavar="S")
        if name == "offer":
            q.add_argument("file", help="contract file")
            q.add_argument(
                "--setting",
                action="append",
                default=[],
                metavar="KEY=VALUE",
                help="what this participant runs unhashed, reported in the verdict (repeatable)",
            )
    return p


TOKEN_ENV = "ISOEXEC_HANDSHAKE_TOKEN"
TOKEN_HELP = f"file holding the shared auth token (or set {TOKEN_ENV}; never on the command line)"


def _token(args: argparse.Namespace) -> str:
    """The auth token, from --token-file or the environment (never from argv)."""
    import os

    if args.token_file:
        return _read_token(args.token_file)
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise _BadInput(f"no auth token: give --token-file or set {TOKEN_ENV}")
    return token


def _server_tls(args: argparse.Namespace) -> object:
    from isoexec.handshake.tls import ServerTLS

    if args.tls_cert is None and args.tls_key is None:
        if args.tls_client_ca:
            raise _BadInput("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise _BadInput("TLS needs both --tls-cert and --tls-key")
    return ServerTLS(args.tls_cert, args.tls_key, args.tls_client_ca)


def _client_tls(args: argparse.Namespace) -> object:
    from isoexec.handshake.tls import ClientTLS, TLSConfigError

    if args.tls_ca is None:
        if args.tls_cert or args.tls_key:
            raise _BadInput("a client certificate needs --tls-ca (the server's CA)")
        return None
    try:
        return ClientTLS(args.tls_ca, args.tls_cert, args.tls_key)
    except TLSConfigError as e:
        raise _BadInput(str(e)) from None


def _read_token(path: str) -> str:
    from isoexec.handshake.token import TokenFileError, read_token_file

    try:
        return read_token_file(path)
    except TokenFileError as e:
        raise _BadInput(str(e)) from None


def _parse_expect(values: list[str] | None) -> dict[str, int]:
    expected: dict[str, int] = {}
    for item in ",".join(values or ["trainer=1,engine=1"]).split(","):
        side, sep, n = item.strip().partition("=")
        if not sep or not side or not n.isdigit() or int(n) < 1:
            raise _BadInput(f"--expect wants SIDE=N with N ≥ 1, got {item!r}")
        expected[side] = int(n)
    return expected


class _BadInput(Exception):
    pass


def run(args: argparse.Namespace) -> int:
    try:
        if args.handshake_command == "serve":
            return _serve(args)
        return _participant(args)
    except _BadInput as e:
        print(f"isoexec handshake: error: {e}", file=sys.stderr)
        return 2


def _serve(args: argparse.Namespace) -> int:
    import signal
    import threading

    from isoexec.handshake.server import HandshakeServer

    token = _token(args)
    expected = _parse_expect(args.expect)
    try:
        server = HandshakeServer(
            expected,
            token,
            host=args.host,
            port=args.port,
            rendezvous_timeout_s=args.rendezvous_timeout,
            tls=_server_tls(args),  # type: ignore[arg-type]
            insecure=args.insecure,
        )
        port = server.start()
    except (ValueError, OSError, RuntimeError) as e:
        raise _BadInput(str(e)) from None
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    parts = ", ".join(f"{s}×{n}" for s, n in expected.items())
    mode = "plaintext" if server.tls is None else "TLS"
    mode = "mutual TLS" if args.tls_client_ca else mode
    print(f"isoexec handshake: serving on {args.host}:{port} over {mode} (expecting {parts})",
          flush=True)  # fmt: skip
    try:
        done.wait()
    finally:
        server.stop()
    return 0


def _participant(args: argparse.Namespace) -> int:
    from isoexec.contract.contract import Contract, ContractError
    from isoexec.handshake.client import HandshakeClient
    from isoexec.handshake.side_settings import SideSettingsError, format_settings
    from isoexec.handshake.types import HandshakeError

    token = _token(args)
    tls = _client_tls(args)
    with HandshakeClient(args.address, token, timeout_s=args.timeout, tls=tls) as client:  # type: ignore[arg-type]
        try:
            if args.handshake_command == "query":
                ok, reason = client.may_receive_weights(args.run_id, args.side, args.rank)
                print("cleared" if ok else f"not cleared: {reason}")
                return 0 if ok else 1
            try:
                contract = Contract.load(args.file)
            except (OSError, ContractError) as e:
                raise _BadInput(f"{args.file}: {e}") from None
            verdict = client.offer(
                args.run_id, args.side, args.rank, contract, settings=_settings(args.setting)
            )
        except (HandshakeError, SideSettingsError) as e:
            raise _BadInput(f"refused: {e}") from None
    print(f"{verdict.outcome} (run {verdict.run_id}, generation {verdict.generation})")
    if not verdict.matched:
        print(verdict.summary)
        for line in verdict.diff:
            print(line)
    else:
        print(verdict.contract_hash)
    for p in verdict.participants:
        if p.settings:
            print(f"settings {p.label}: {format_settings(p.settings)}")
    return 0 if verdict.matched else 1


def _settings(pairs: list[str]) -> dict[str, str]:
    """`--setting KEY=VALUE` options as a mapping (checked by the client)."""
    from isoexec.handshake.side_settings import SideSettingsError

    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key in out:
            raise SideSettingsError(f"--setting {pair!r}: expected KEY=VALUE, each key once")
        out[key] = value
    return out
