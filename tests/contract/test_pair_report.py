"""`isoexec pair`'s report: per-arm and per-temperature statistics, the table, the JSON and the
plot, computed from known logprobs (the CLI runs are in integration/)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from isoexec.tools.pair_report import (
    TokenStats,
    arm_result,
    format_table,
    token_temperatures,
    write_plot,
    write_results,
)


def test_token_stats_values() -> None:
    train = torch.tensor([-1.0, -2.0, -3.0, -0.5])
    eng = torch.tensor([-1.0, -2.5, -3.0, -0.25])
    s = TokenStats.of(train, eng)
    assert (s.tokens, s.bitwise_equal, s.equal_fraction) == (4, 2, 0.5)
    assert s.max_abs_diff == 0.5 and s.mean_abs_diff == pytest.approx(0.1875)
    assert s.ratio_min == pytest.approx(math.exp(-0.25)) and s.ratio_max == pytest.approx(
        math.exp(0.5)
    )
    d = torch.tensor([0.0, 0.5, 0.0, -0.25], dtype=torch.float64)
    assert s.kl_k3 == pytest.approx(float((d.exp() - 1 - d).mean()))
    assert s.kl_k3 > 0
    equal = TokenStats.of(train, train.clone())
    assert equal.kl_k3 == 0.0 and equal.ratio_min == equal.ratio_max == 1.0


def test_arm_result_by_temperature_table_json_plot(tmp_path: Path) -> None:
    completions = [SimpleNamespace(token_ids=[1, 2]), SimpleNamespace(token_ids=[3]),
                   SimpleNamespace(token_ids=[4, 5, 6])]  # fmt: skip
    temps = [1.0, 0.7, 1.0]
    token_temps = token_temperatures(completions, temps)
    assert token_temps == [0.7, 1.0, 1.0, 1.0, 1.0, 1.0]  # align's order: by temperature
    train = torch.tensor([-1.0, -2.0, -3.0, -1.5, -0.5, -0.25])
    iso = arm_result("isoexec", "MATCH abc", train, train.clone(), token_temps,
                     contract_hashes={"trainer": "a" * 64, "engine": "a" * 64}, verdict="MATCH",
                     weight_fingerprints={"trainer": "f" * 64, "engine": "f" * 64},
                     timings_s={"engine_start": 1.0, "sampling": 0.5, "scoring": 0.25})  # fmt: skip
    stock = arm_result("stock", "n/a (stock arm)", train, train + 1e-6, token_temps)
    assert iso.by_temperature["0.7"].tokens == 1 and iso.by_temperature["1"].tokens == 5
    assert stock.bitwise_equal == 0 and stock.stats is not None and stock.stats.kl_k3 > 0
    with pytest.raises(ValueError, match="token temperatures"):
        arm_result("stock", "-", train, train, token_temps[:2])

    table = format_table("tiny", "float32", [iso, stock])
    assert "   0.7" in table and "KL k3" in table and "verdict MATCH" in table
    path = write_results(tmp_path, "tiny", "float32", [iso, stock])
    doc = json.loads(path.read_text())
    assert doc["model"] == "tiny" and [a["arm"] for a in doc["arms"]] == ["isoexec", "stock"]
    assert doc["sampling"] == {}  # no truncation
    cut = {"top_k": 20, "top_p": 0.95, "min_p": 0.0}
    assert json.loads(write_results(tmp_path, "t", "f", [iso], cut).read_text())["sampling"] == cut
    path = write_results(tmp_path, "tiny", "float32", [iso, stock])
    arm = doc["arms"][0]
    assert arm["stats"]["equal_fraction"] == 1.0 and "abs_diffs" not in arm
    assert set(arm["by_temperature"]) == {"0.7", "1"}
    assert arm["timings_s"]["engine_start"] == 1.0 and arm["verdict"] == "MATCH"
    plot = write_plot(tmp_path, "tiny", "float32", [iso, stock])
    assert plot is not None and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_results_json_is_strict_when_an_arm_has_no_tokens(tmp_path: Path) -> None:
    """An arm that scored no tokens has no statistics (NaN in memory): results.json writes
    them as null, never the non-JSON `NaN` that strict readers reject."""
    empty = torch.tensor([])
    arm = arm_result("stock", "n/a (stock arm)", empty, empty, [])
    assert arm.stats is not None and math.isnan(arm.stats.max_abs_diff)
    text = write_results(tmp_path, "tiny", "float32", [arm]).read_text()
    assert "NaN" not in text

    def strict(token: str) -> None:
        raise ValueError(token)

    doc = json.loads(text, parse_constant=strict)
    assert doc["arms"][0]["stats"]["max_abs_diff"] is None


def test_full_vocab_stats_count_bitwise_rows_and_the_worst_entry() -> None:
    """-inf on both sides (outside the kept set) is equal; on one side only, an infinite
    difference; one flipped last bit makes its row not bitwise."""
    from isoexec.tools.pair_report import FullVocabStats

    inf = float("-inf")
    train = torch.tensor([[-1.0, -2.0, inf], [-0.5, -1.5, -3.0], [-0.1, inf, inf]])
    same = FullVocabStats.of(train, train.clone())
    assert (same.rows, same.rows_bitwise, same.max_abs_diff) == (3, 3, 0.0)
    engine = train.clone()
    engine[1, 2] = torch.nextafter(engine[1, 2], torch.tensor(0.0))
    one_bit = FullVocabStats.of(train, engine)
    assert one_bit.rows_bitwise == 2 and 0 < one_bit.max_abs_diff < 1e-5
    engine[2, 1] = -4.0  # kept on the engine, not on the trainer
    assert FullVocabStats.of(train, engine).max_abs_diff == float("inf")
    with pytest.raises(ValueError, match="rows"):
        FullVocabStats.of(train, train[:2])


def test_the_table_shows_the_full_vocab_line() -> None:
    from isoexec.tools.pair_report import FullVocabStats, arm_result, format_table

    lp = torch.tensor([-1.0, -2.0])
    r = arm_result("isoexec", "MATCH abc", lp, lp.clone(), [1.0, 1.0],
                   full_vocab=FullVocabStats(2, 2, 0.0))  # fmt: skip
    table = format_table("m", "float32", [r], {"top_k": 20, "top_p": 0.95, "full_vocab": True})
    assert "full vocab: 2/2 rows bitwise (100.0%), max |Δ| over all entries 0.000e+00" in table
    assert "dtype float32, sampling top_k=20 top_p=0.95 full_vocab=True" in table
    assert r.to_json()["full_vocab"] == {"rows": 2, "rows_bitwise": 2, "max_abs_diff": 0.0}
