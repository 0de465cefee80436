"""`isoexec engine serve`: the vLLM server command it execs, and what it refuses."""

from __future__ import annotations

import json
import sys

import pytest

from isoexec.contract.options import IsoExecOptions
from isoexec.vllm.serve import ServeArgsError, server_command


def test_server_command_sets_what_isoexec_needs_and_passes_the_rest() -> None:
    argv, env = server_command("/m", ["--port", "9000", "--enforce-eager"],
                               options=IsoExecOptions(tp_invariant=True))  # fmt: skip
    assert argv[:5] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    flags = dict(zip(argv[5:-3:2], argv[6:-3:2], strict=True))
    assert flags["--middleware"] == "isoexec.vllm.served_routes.isoexec_routes"
    assert flags["--worker-extension-cls"] == "isoexec.vllm.worker_extension.IsoWorkerExtension"
    assert flags["--logprobs-mode"] == "processed_logprobs"
    assert json.loads(flags["--additional-config"]) == {
        "isoexec": {"tp_invariant": True, "backend": "torch", "logprobs_mode": "processed_logprobs"}
    }
    assert argv[-3:] == ["--port", "9000", "--enforce-eager"]
    assert env["ISOEXEC"] == "1"
    # --raw-logprobs: vLLM's mode and the options (which the contract records) together.
    raw = IsoExecOptions(logprobs_mode="raw_logprobs")
    argv, _ = server_command("/m", [], options=raw)
    flags = dict(zip(argv[5::2], argv[6::2], strict=True))
    assert flags["--logprobs-mode"] == "raw_logprobs"
    assert json.loads(flags["--additional-config"])["isoexec"]["logprobs_mode"] == "raw_logprobs"


def test_stock_server_is_upstream_vllm() -> None:
    argv, env = server_command("/m", [], isoexec=False)
    assert env["ISOEXEC"] == "0" and "--additional-config" not in argv
    with pytest.raises(ServeArgsError, match="not with --stock"):
        server_command("/m", [], isoexec=False, options=IsoExecOptions(tp_invariant=True))


@pytest.mark.parametrize(
    "arg", ["--logprobs-mode=raw_logprobs", "--worker-extension-cls", "--additional-config"]
)
def test_contradicting_flags_are_refused(arg: str) -> None:
    with pytest.raises(ServeArgsError, match="is set by `isoexec engine serve`"):
        server_command("/m", [arg, "x"])


def test_cli_refuses_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    from isoexec.tools.cli import main

    assert main(["engine", "serve", "/m", "--logprobs-mode", "raw_logprobs"]) == 2
    assert "--logprobs-mode is set by" in capsys.readouterr().err


def test_the_middleware_named_is_the_routes_function() -> None:
    import importlib

    from isoexec.vllm import served_routes
    from isoexec.vllm.engine_kwargs import MIDDLEWARE

    module, name = MIDDLEWARE.rsplit(".", 1)
    assert getattr(importlib.import_module(module), name) is served_routes.isoexec_routes


def test_handshake_flags_reach_vllm_as_additional_config(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from isoexec.handshake.served import ServedHandshake
    from isoexec.tools.cli import main

    token = tmp_path / "token"
    token.write_text("s3cret\n")
    hs = ServedHandshake("127.0.0.1:7443", str(token), "run-1")
    argv, _ = server_command("/m", [], handshake=hs)
    extra = json.loads(argv[argv.index("--additional-config") + 1])
    assert extra["isoexec_handshake"] == {"address": "127.0.0.1:7443", "token_file": str(token),
                                          "run_id": "run-1", "timeout_s": 3600.0}  # fmt: skip
    assert ServedHandshake.from_mapping(extra["isoexec_handshake"]).token() == "s3cret"
    with pytest.raises(ServeArgsError, match="not with --stock"):
        server_command("/m", [], isoexec=False, handshake=hs)
    # The CLI refuses an incomplete set, and a token file that is missing, before vLLM starts.
    assert main(["engine", "serve", "--handshake-address", "h:1", "/m"]) == 2
    assert "--handshake-token-file, --handshake-run-id too" in capsys.readouterr().err
    assert main(["engine", "serve", "--handshake-address", "h:1", "--handshake-token-file",
                 str(tmp_path / "nope"), "--handshake-run-id", "r", "/m"]) == 2  # fmt: skip
    assert "handshake token file" in capsys.readouterr().err
