"""Settings on the served engine, tried as a new user would: vLLM's own OpenAI server through
`isoexec engine serve`, the real `openai` client, a model that ships what released checkpoints
ship (a tokenizer and a generation_config.json with Qwen3's temperature/top_k/top_p defaults).

Before the admission check each of these settings gave a MATCH with 0/204 tokens bitwise, and a
refused request killed the engine mid-batch. Now a setting IsoExec does not reproduce is
refused at admission — HTTP 400 for that request alone, naming the setting — while the
concurrent good requests finish bitwise the trainer's and the server stays up. Top-k, top-p
and min-p, the penalties, logit bias and allowed tokens, and the model's shipped defaults
(a repetition penalty among them) are good requests: canonical on both sides, recorded per
completion and scored with the record. Negative control: the same settings are accepted by
the `--stock` server (`test_served_engine.py`).
"""

from __future__ import annotations

import json
import secrets
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from _served import served

from isoexec.tools.pair import make_prompts

pytestmark = [pytest.mark.engine, pytest.mark.trainer]

MAX_TOKENS = 6
# Settings IsoExec does not reproduce, each in the request body as the `openai` client sends
# it. (The fail-open audit's logit_bias, allowed_token_ids and penalties are good requests now.)
REFUSED: dict[str, dict[str, Any]] = {
    "min_tokens": {"extra_body": {"min_tokens": 2}},
    "bad_words": {"extra_body": {"bad_words": ["x"]}},
    # Valid settings, but a record too large for an HTTP header (a client reads 16 KiB).
    "sampling record": {"logit_bias": {str(i): -1.25 for i in range(500)},
                        "extra_body": {"allowed_token_ids": list(range(500))}},
}  # fmt: skip


@pytest.fixture(scope="module")
def release_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from isoexec.tools.tiny_models import make_tiny_model

    out = tmp_path_factory.mktemp("release") / "tiny-dense-release"
    return str(make_tiny_model("tiny-dense", out, release_files=True))


def _client(url: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _complete(url: str, model: str, prompt: list[int], **kw: Any) -> Any:
    """The completion, with the `SamplingRecord` its response carried as `.isoexec_record`."""
    from isoexec.handshake.served import SAMPLING_HEADER, SamplingRecord

    extra = {"return_tokens_as_token_ids": True, **kw.pop("extra_body", {})}
    raw = _client(url).completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, logprobs=1, extra_body=extra, **kw
    )
    resp = raw.parse()
    resp.isoexec_record = SamplingRecord.from_header(raw.headers.get(SAMPLING_HEADER))
    return resp


def _ids_and_logprobs(resp: Any) -> tuple[list[int], list[float]]:
    (choice,) = resp.choices
    ids = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
    return ids, list(choice.logprobs.token_logprobs)


def _bitwise(trainer: Any, prompt: list[int], resp: Any, temp: float | None = None) -> bool:
    """The trainer's scoring of the completion equals its logprobs bit for bit: scored with
    the record the response carried (`score_sampled`), or at `temp` when given (no
    truncation: what a trainer unaware of the settings computes)."""
    from isoexec.megatron import score_sampled
    from isoexec.megatron.scoring import score

    ids, lps = _ids_and_logprobs(resp)
    seqs = [prompt + ids]
    (train,) = (
        score_sampled(trainer, seqs, resp.isoexec_record, prompt_lens=[len(prompt)])
        if temp is None
        else score(trainer, seqs, temperature=temp)
    )
    return torch.equal(train[-len(ids) :].float(), torch.tensor(lps, dtype=torch.float32))


def _prompts(model: str, n: int) -> list[list[int]]:
    vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    return [p[:40] for p in make_prompts(n, vocab - 1, seed=11)]  # no end-of-text in a prompt


# Good requests: (temperature, truncation fields as the openai client sends them). None: the
# model's shipped defaults (temperature 0.6, top_k 20, top_p 0.95).
GOOD: list[tuple[float | None, dict[str, Any]]] = [
    (None, {}),
    (0.7, {}),
    (1.0, {"extra_body": {"top_k": 5}}),
    (0.9, {"top_p": 0.8}),
    (1.0, {"extra_body": {"min_p": 0.1}}),
    (0.8, {"top_p": 0.9, "extra_body": {"top_k": 12, "min_p": 0.02}}),
    (1.0, {"top_p": 1.0, "extra_body": {"top_k": -1}}),  # neutral: nothing truncated
    (1.0, {"top_p": 1.0, "extra_body": {"top_k": -1, "repetition_penalty": 1.3}}),
    (0.8, {"top_p": 1.0, "presence_penalty": 0.5, "frequency_penalty": 0.3,
           "extra_body": {"top_k": -1}}),
    (1.0, {"top_p": 1.0, "logit_bias": {"5": 3, "7": -2, "9": 250},
           "extra_body": {"top_k": -1}}),  # 250: vLLM clamps it to 100, so does the record
    (0.9, {"top_p": 1.0, "extra_body": {"top_k": -1, "allowed_token_ids": list(range(40))}}),
    (0.7, {"top_p": 0.9, "frequency_penalty": -0.4, "extra_body": {"top_k": 30}}),
] * 2  # fmt: skip
ADJUSTED = (7, 8, 9, 10)  # the untruncated requests with an adjustment


def test_refused_settings_get_400_alone_and_good_requests_stay_bitwise(
    tmp_path: Path, release_model: str, trainer_factory: Callable[..., Any]
) -> None:
    """24 good requests and one request per refused setting, all at once: every refused one
    gets HTTP 400 naming its setting, every good one — top-k, top-p, min-p, combined, the
    penalties, logit bias, allowed tokens, and the model's shipped defaults — is bitwise the
    trainer's scoring with the record its response carried, and the server stays up. Negative
    controls: the truncated or adjusted completions scored without their settings (or at
    T=1.0 for the shipped defaults) are not bitwise."""
    import openai

    prompts = _prompts(release_model, len(GOOD))
    log = tmp_path / "server.log"
    with served(release_model, stock=False, log=log, tokenizer=True) as url:

        def good(i: int) -> Any:
            temp, fields = GOOD[i]
            kw = dict(fields) if temp is None else {"temperature": temp, **fields}
            return _complete(url, release_model, prompts[i], **kw)

        def bad(name: str) -> str:
            try:
                _complete(url, release_model, prompts[0], **REFUSED[name])
            except openai.BadRequestError as e:
                return str(e)
            return "accepted"

        with ThreadPoolExecutor(len(prompts) + len(REFUSED)) as pool:
            bad_f = {name: pool.submit(bad, name) for name in REFUSED}
            good_f = [pool.submit(good, i) for i in range(len(prompts))]
            refused = {name: f.result() for name, f in bad_f.items()}
            answers = [f.result() for f in good_f]
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            assert r.status == 200  # the engine survived the refusals
        after = _complete(url, release_model, prompts[1], temperature=0.7)
        running_log = log.read_text()  # before shutdown (which reports the engine stopping)

    for name, message in refused.items():
        assert "Error code: 400" in message and "IsoExec refuses this request" in message
        if name == "sampling record":
            assert "would be" in message and "at most 8192" in message, message
        else:
            assert f"{name}=" in message, (name, message)
    trainer = trainer_factory(release_model, "float32", isoexec=True)
    shipped = answers[0].isoexec_record  # a request naming nothing: the model's defaults
    assert (shipped.temperature, shipped.top_k, shipped.top_p) == (0.6, 20, 0.95), shipped
    assert answers[2].isoexec_record.top_k == 5 and answers[3].isoexec_record.top_p == 0.8
    assert answers[4].isoexec_record.min_p == 0.1 and answers[5].isoexec_record.top_k == 12
    assert answers[7].isoexec_record.repetition_penalty == 1.3
    assert answers[8].isoexec_record.penalties().presence_penalty == 0.5
    assert answers[9].isoexec_record.logit_bias == ((5, 3.0), (7, -2.0), (9, 100.0))
    assert answers[10].isoexec_record.allowed_token_ids == tuple(range(40))
    assert all(t < 40 for t in _ids_and_logprobs(answers[10])[0])
    for i, resp in enumerate(answers):  # each scored with the record its response carried
        assert resp.isoexec_record.logprobs_mode == "processed_logprobs"
        assert _bitwise(trainer, prompts[i], resp), (i, resp.isoexec_record)
    assert _bitwise(trainer, prompts[1], after)
    for i in (0, 2, 3, 5, *ADJUSTED):  # negative controls: scored without their settings
        temp = GOOD[i][0] or 0.6
        assert not _bitwise(trainer, prompts[i], answers[i], temp=temp), i
    assert not _bitwise(trainer, prompts[0], answers[0], temp=1.0)
    assert "generation_config.json (temperature=0.6, top_k=20, top_p=0.95) apply" in running_log
    assert "EngineDeadError" not in running_log


def test_a_shipped_penalty_is_applied_and_recorded(
    tmp_path: Path, release_model: str, trainer_factory: Callable[..., Any]
) -> None:
    """A model whose generation_config.json also ships a repetition penalty (Qwen2.5 shipped
    1.05), served as it ships, with n-gram speculation (`--speculative-config`, verified on
    canonical rows): a request naming nothing is sampled with every shipped default,
    which its record says, and scored with that record it is bitwise. Negative control: the
    record without its penalty (what a trainer unaware of the shipped default computes) is not
    bitwise, on a request that turns the truncation off so that every prompt token is in the
    kept set. A sequence without a record, or recorded in another logprobs mode, or a penalised
    one scored without prompt lengths, is refused."""
    import shutil
    from dataclasses import replace

    from isoexec.handshake.served import SamplingRecordError
    from isoexec.megatron import score_sampled
    from isoexec.ops.penalties import PenaltiesError

    model = tmp_path / "penalised"
    shutil.copytree(release_model, model)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "repetition_penalty": 1.05}))
    (prompt,) = _prompts(str(model), 1)
    log = tmp_path / "server.log"
    ngram = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
    with served(str(model), stock=False, log=log, tokenizer=True,
                vllm_args=("--speculative-config", ngram)) as url:  # and speculating  # fmt: skip
        shipped = _complete(url, str(model), prompt)
        untruncated = _complete(url, str(model), prompt, top_p=1.0, extra_body={"top_k": -1})
    trainer = trainer_factory(str(model), "float32", isoexec=True)
    record = shipped.isoexec_record
    assert (record.temperature, record.top_k, record.top_p) == (0.6, 20, 0.95), record
    assert record.repetition_penalty == 1.05 == untruncated.isoexec_record.repetition_penalty
    assert _bitwise(trainer, prompt, shipped) and _bitwise(trainer, prompt, untruncated)
    unaware = replace(untruncated.isoexec_record, repetition_penalty=1.0)
    ids, lps = _ids_and_logprobs(untruncated)
    (train,) = score_sampled(trainer, [prompt + ids], unaware, prompt_lens=[len(prompt)])
    assert not torch.equal(train[-len(ids) :].float(), torch.tensor(lps, dtype=torch.float32))

    seq = [prompt + _ids_and_logprobs(shipped)[0]]
    with pytest.raises(SamplingRecordError, match="without the record"):
        score_sampled(trainer, seq, None)
    raw = replace(record, logprobs_mode="raw_logprobs")
    with pytest.raises(SamplingRecordError, match="raw_logprobs"):
        score_sampled(trainer, seq, raw)
    with pytest.raises(PenaltiesError, match="prompt length"):
        score_sampled(trainer, seq, record)
    assert "repetition_penalty=1.05) apply" in log.read_text()


def test_a_config_override_does_not_match(
    tmp_path: Path, release_model: str, trainer_factory: Callable[..., Any]
) -> None:
    """`--hf-overrides '{"rms_norm_eps": 0.01}'` on the server: the worker's contract hashes
    the effective config, so the trainer built from the checkpoint gets MISMATCH naming the
    config digest (before, both said MATCH and 0/204 tokens were bitwise). Negative control:
    the same server without the override MATCHes (`test_served_engine.py`)."""
    from isoexec.handshake.client import HandshakeClient
    from isoexec.handshake.server import HandshakeServer
    from isoexec.megatron import trainer_contract

    hf = json.loads((Path(release_model) / "config.json").read_text())
    trainer = trainer_factory(release_model, "float32", isoexec=True)
    token = secrets.token_hex(16)
    (tmp_path / "token").write_text(token)
    with HandshakeServer({"trainer": 1, "engine": 1}, token) as hs:
        launcher = ("--handshake-address", hs.address, "--handshake-token-file",
                    str(tmp_path / "token"), "--handshake-run-id", "override-run")  # fmt: skip
        with served(release_model, stock=False, log=tmp_path / "server.log", tokenizer=True,
                    launcher_args=launcher,
                    vllm_args=("--hf-overrides", '{"rms_norm_eps": 0.01}')):  # fmt: skip
            with HandshakeClient(hs.address, token, timeout_s=120) as client:
                verdict = client.offer("override-run", "trainer", 0,
                                       trainer_contract(trainer, hf, "float32"))  # fmt: skip
    assert verdict.outcome == "MISMATCH", verdict
    assert any("config_digest" in d for d in verdict.diff), verdict.diff


def test_a_speculating_server_offers_an_invariant_contract_and_matches(
    tmp_path: Path, release_model: str, trainer_factory: Callable[..., Any]
) -> None:
    """vLLM's OpenAI server with `--speculative-config` ngram and a handshake: its worker reads
    its verifier back from the sampler (IsoExec's rejection sampler registers there), declares
    speculation "invariant" and MATCHes the trainer, which does not speculate. (The negative
    control, vLLM's own verifier declaring "ngram/3" and refused, is in test_speculative.py.)"""
    from isoexec.handshake.client import HandshakeClient
    from isoexec.handshake.server import HandshakeServer
    from isoexec.megatron import trainer_contract

    hf = json.loads((Path(release_model) / "config.json").read_text())
    trainer = trainer_contract(trainer_factory(release_model, "float32", isoexec=True), hf)
    assert trainer.speculation == "invariant"
    token = secrets.token_hex(16)
    (tmp_path / "token").write_text(token)
    ngram = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
    with HandshakeServer({"trainer": 1, "engine": 1}, token) as hs:
        launcher = ("--handshake-address", hs.address, "--handshake-token-file",
                    str(tmp_path / "token"), "--handshake-run-id", "speculating-run")  # fmt: skip
        with served(release_model, stock=False, log=tmp_path / "server.log", tokenizer=True,
                    launcher_args=launcher,
                    vllm_args=("--speculative-config", ngram)):  # fmt: skip
            with HandshakeClient(hs.address, token, timeout_s=120) as client:
                verdict = client.offer("speculating-run", "trainer", 0, trainer)
    assert verdict.outcome == "MATCH", verdict.diff
    assert verdict.contract_hash == trainer.hash
    settings = {p.label: dict(p.settings) for p in verdict.participants}
    assert settings["engine/0"] == {"speculative": "ngram/3", "tensor_parallel_size": "1"}
