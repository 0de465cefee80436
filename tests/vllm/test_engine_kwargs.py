"""The engine arguments an IsoExec engine needs, one list for the harness, the server launcher
and a framework's `engine_init_kwargs`."""

from __future__ import annotations

import json

from isoexec.contract.options import IsoExecOptions
from isoexec.vllm.engine_kwargs import (
    ADMISSION,
    MIDDLEWARE,
    WORKER_EXTENSION,
    as_server_flags,
    isoexec_engine_kwargs,
)
from isoexec.vllm.serve import server_command


def test_the_kwargs_name_vllm_engine_args_fields() -> None:
    from vllm.engine.arg_utils import EngineArgs

    kw = isoexec_engine_kwargs(IsoExecOptions(tp_invariant=True), worker_extension="m.Ext")
    fields = set(EngineArgs.__dataclass_fields__)
    assert set(kw) <= fields, set(kw) - fields
    assert kw["worker_extension_cls"] == "m.Ext" and kw["logits_processors"] == [ADMISSION]
    assert kw["additional_config"] == {"isoexec": IsoExecOptions(tp_invariant=True).to_dict()}
    EngineArgs(model="/m", **kw)  # vLLM accepts them as given


def test_the_server_gets_the_same_list_as_flags_plus_the_routes() -> None:
    hs = {"address": "127.0.0.1:1", "token_file": "/t", "run_id": "r"}
    kw = isoexec_engine_kwargs(IsoExecOptions(logprobs_mode="raw_logprobs"), handshake=hs)
    flags = as_server_flags(kw)
    pairs = dict(zip(flags[::2], flags[1::2], strict=True))
    assert pairs["--worker-extension-cls"] == WORKER_EXTENSION
    assert pairs["--logprobs-mode"] == "raw_logprobs"
    assert pairs["--logits-processors"] == ADMISSION
    assert pairs["--middleware"] == MIDDLEWARE
    assert json.loads(pairs["--additional-config"])["isoexec_handshake"] == hs
    argv, _ = server_command("/m", [], options=IsoExecOptions(logprobs_mode="raw_logprobs"))
    no_hs = as_server_flags(isoexec_engine_kwargs(IsoExecOptions(logprobs_mode="raw_logprobs")))
    assert argv[5 : 5 + len(no_hs)] == no_hs  # the launcher passes exactly this list
