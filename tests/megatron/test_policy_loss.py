"""The clipped policy loss shared by the GRPO drivers: the ratio's deviation, the clip, and
bad shapes refused."""

from __future__ import annotations

import pytest
import torch

from isoexec.megatron.policy_loss import clipped_policy_loss, per_token


def test_equal_logprobs_give_a_ratio_of_exactly_one() -> None:
    lp = torch.tensor([-1.5, -0.25, -3.0], requires_grad=True)
    pl = clipped_policy_loss(lp, lp.detach().clone(), per_token([2.0], [3]))
    assert pl.ratio_dev_max == 0.0 and pl.ratio_dev_mean == 0.0
    assert float(pl.loss) == -2.0  # -mean(1 * A)
    pl.loss.backward()
    assert torch.equal(lp.grad, torch.full((3,), -2.0 / 3))


def test_the_clip_stops_the_gradient_past_one_plus_epsilon() -> None:
    new = torch.tensor([0.5, -0.5], requires_grad=True)  # ratios e^0.5 and e^-0.5
    pl = clipped_policy_loss(new, torch.zeros(2), torch.tensor([1.0, -1.0]), clip=0.2)
    pl.loss.backward()
    assert torch.equal(new.grad, torch.zeros(2))  # both clipped on the side that stops them
    assert pl.ratio_dev_max == pytest.approx(float(torch.exp(torch.tensor(0.5))) - 1)


def test_per_token_repeats_each_advantage_over_its_completion() -> None:
    assert per_token([1.0, -0.5], [2, 3]).tolist() == [1.0, 1.0, -0.5, -0.5, -0.5]
    with pytest.raises(ValueError):
        per_token([1.0], [2, 3])


def test_shapes_that_differ_are_refused() -> None:
    with pytest.raises(ValueError, match="shapes differ"):
        clipped_policy_loss(torch.zeros(3), torch.zeros(2), torch.zeros(3))


@pytest.mark.trainer
@pytest.mark.parametrize("mode", ["policy_step", "bare"])
def test_policy_step_keeps_the_tp_ranks_replicated_weights_equal(tmp_path, mode: str) -> None:
    """At TP=2 each rank holds a partial gradient of the q/k norms (shared by its heads only):
    `policy_step` sums them over TP before the step, and every replicated weight stays equal
    on both ranks; a bare backward and step (the negative control) lets the q/k norms drift."""
    import json
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from isoexec.tools.tiny_models import make_tiny_model

    model = make_tiny_model("tiny-dense", tmp_path / "m", seed=3)
    worker = Path(__file__).parents[1] / "_support" / "policy_step_worker.py"
    with socket.socket() as sock:  # a free rendezvous port (the suite runs files in parallel)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(port), str(worker), str(model), mode],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("DIFFER "))
    differ = json.loads(line.removeprefix("DIFFER "))
    if mode == "policy_step":
        assert differ == []
    else:
        assert differ and all("q_layernorm" in n or "k_layernorm" in n for n in differ), differ


@pytest.mark.trainer
def test_policy_train_step_refuses_bad_batches_before_any_forward(
    parallel: object, model_factory
) -> None:
    """Old logprobs that do not cover each completion, and a stock model, are refused on every
    rank before a forward (a pipeline stage that raised alone would leave the others hanging);
    the model's weights are untouched."""
    from isoexec.megatron import build_model, load_hf_weights
    from isoexec.megatron.policy_loss import policy_train_step

    path = model_factory("tiny-dense", "float32")
    model = build_model(path, isoexec=True, tp=1, dtype=torch.float32)
    load_hf_weights(model, path)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    seqs = [[3, 4, 5, 6, 7], [8, 9, 10]]
    with pytest.raises(ValueError, match=r"sequences \[1\]: old\[i\] must hold one logprob"):
        policy_train_step(model, opt, seqs, [2, 1], [[0.0] * 3, [0.0] * 3], [1.0, -1.0])
    with pytest.raises(ValueError, match="counts differ"):
        policy_train_step(model, opt, seqs, [2], [[0.0] * 3], [1.0, -1.0])
    with pytest.raises(ValueError, match="at least one completion token"):
        policy_train_step(model, opt, seqs, [5, 3], [[], []], [1.0, -1.0])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    stock = build_model(path, isoexec=False, tp=1, dtype=torch.float32)
    with pytest.raises(TypeError, match="an isoexec model only"):
        policy_train_step(stock, opt, seqs, [2, 1], [[0.0] * 3, [0.0] * 2], [1.0, -1.0])
