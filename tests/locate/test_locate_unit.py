"""Trace format, digests, alignment and `isoexec locate` on synthetic traces (no engine).

The traces mimic a real run: every site of a 2-layer Qwen3 model, two sequences; a fault is
a one-ulp change at one (site, position) that then spreads to every later site and position,
as a real rounding change does. `locate` must name the origin, not a consequence.
"""

from __future__ import annotations

import copy
import dataclasses
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from isoexec.contract.trace import Trace, TraceFormatError, digest_rows, make_rows, site_layer
from isoexec.tools.cli import main
from isoexec.tools.locate import format_result, locate

ISOEXEC = Path(sys.executable).parent / "isoexec"
CMD = [str(ISOEXEC)] if ISOEXEC.exists() else [sys.executable, "-m", "isoexec.tools.cli"]
HF = {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 2, "vocab_size": 64}
SEQS = {0: list(range(3, 15)), 1: list(range(20, 29))}
WIDTH = 8


def isoexec(*args: str) -> subprocess.CompletedProcess[str]:
    """The real console script, in a subprocess (slow: used once)."""
    return subprocess.run([*CMD, *args], capture_output=True, text=True, timeout=120)


def locate_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`isoexec locate ARGS` through the dispatcher, in this process: (exit code, out, err)."""
    rc = main(["locate", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def make_trace(side: str, seed: int = 0, *, skip: tuple[str, ...] = ()) -> Trace:
    t = Trace.for_model(side, HF, "float32")
    for seq, toks in SEQS.items():
        t.begin_sequence(seq, toks)
        for i, site in enumerate(t.site_names()):
            if site in skip:
                continue
            g = torch.Generator().manual_seed(seed * 10_000 + seq * 100 + i)
            rows = torch.randn(len(toks), WIDTH, generator=g)
            t.record(seq, site, range(len(toks)), rows)
    for s in skip:
        t.untraced[s] = "not recorded in this test"
    return t


def one_ulp(t: Trace, site: str, pos: int, seq: int) -> None:
    """Change one element of one row by one ulp, then every later (site, pos) of that
    sequence arbitrarily (the downstream consequences)."""
    names = t.site_names()
    start = names.index(site)
    assert (seq, site, pos) in t.rows
    for (s, name, p), row in list(t.rows.items()):
        if s != seq:
            continue
        later = names.index(name) > start and p >= pos
        if (name, p) == (site, pos) or later:
            v = row.floats()
            assert v is not None
            v = v.clone()
            if later:
                v += 1.0
            else:
                v[3] = torch.nextafter(v[3], torch.tensor(float("inf")))
            (t.rows[(s, name, p)],) = make_rows(v.reshape(1, -1), store_values=True)


def test_digest_is_exact_bits() -> None:
    x = torch.randn(4, 32)
    y = x.clone()
    y[2, 7] = torch.nextafter(y[2, 7], torch.tensor(float("inf")))
    dx, dy = digest_rows(x), digest_rows(y)
    assert dx[:2] == dy[:2] and dx[3] == dy[3] and dx[2] != dy[2]
    assert all(len(d) == 16 for d in dx)
    z = torch.zeros(1, 4)
    assert digest_rows(z) != digest_rows(-z)  # -0.0 is other bits
    b = torch.randn(3, 16).bfloat16()
    assert digest_rows(b) == digest_rows(b.float())  # bf16 upcast is exact
    assert digest_rows(x.reshape(4, 2, 16).reshape(4, -1)) == dx  # layout-free per row


def test_round_trip_json_and_gzip(tmp_path: Path) -> None:
    t = make_trace("trainer")
    for name in ("t.json", "t.json.gz"):
        path = t.write(tmp_path / name)
        back = Trace.read(path)
        assert back.to_dict() == t.to_dict()
    assert gzip.decompress((tmp_path / "t.json.gz").read_bytes()).startswith(b"{")
    assert site_layer("layers.12.mlp.act") == 12 and site_layer("lm_head") is None


def test_equal_traces_no_divergence() -> None:
    r = locate(make_trace("trainer"), make_trace("engine"))
    assert not r.diverged and r.sites_compared == len(make_trace("x").sites)
    assert r.rows_compared == r.sites_compared * sum(map(len, SEQS.values()))
    assert "no divergence" in format_result(r)


@pytest.mark.parametrize(
    ("site", "pos", "seq"),
    [
        ("layers.1.self_attn.core", 5, 1),
        ("layers.0.input_norm", 11, 0),
        ("lm_head", 0, 1),
        ("layers.0.mlp.act", 8, 0),
    ],
)
def test_one_ulp_fault_is_located_exactly(site: str, pos: int, seq: int) -> None:
    a, b = make_trace("trainer"), make_trace("engine")
    one_ulp(b, site, pos, seq)
    r = locate(a, b)
    assert r.first is not None
    d = r.first
    assert (d.site, d.pos, d.seq, d.layer) == (site, pos, seq, site_layer(site))
    assert d.differing == 1
    assert d.max_abs_diff is not None and 0 < d.max_abs_diff < 1e-5
    assert r.divergent_sites[0] == site
    assert r.sites_equal_before == a.site_names().index(site)
    text = format_result(r)
    assert text.splitlines()[0].startswith("first divergence:") and site in text.splitlines()[0]
    assert f"token position {pos}" in text and "1 of 8 elements" in text


def test_site_order_beats_position() -> None:
    """An earlier site at a later position is the first divergence, not a later site at an
    earlier position: execution order is layer, then site, then position."""
    a, b = make_trace("trainer"), make_trace("engine")
    one_ulp(b, "layers.1.self_attn.core", 2, 1)
    one_ulp(b, "layers.0.self_attn.o_proj", 9, 0)
    r = locate(a, b)
    assert r.first is not None and (r.first.site, r.first.pos) == ("layers.0.self_attn.o_proj", 9)


def test_one_sided_sites_are_listed_not_compared() -> None:
    skip = ("layers.0.self_attn.rope", "layers.1.mlp.act")
    a, b = make_trace("trainer"), make_trace("engine", skip=skip)
    one_ulp(a, "layers.0.self_attn.rope", 2, 0)  # invisible: the engine did not record it
    one_ulp(b, "layers.0.self_attn.core", 4, 0)
    r = locate(a, b)
    assert set(r.one_sided) == set(skip)
    assert "only trainer recorded it" in r.one_sided[skip[0]]
    assert "not recorded in this test" in r.one_sided[skip[0]]
    assert r.first is not None and r.first.site == "layers.0.self_attn.core"
    assert "not compared (2 site(s))" in format_result(r)


def test_without_values_size_comes_from_statistics() -> None:
    a, b = make_trace("trainer"), make_trace("engine")
    one_ulp(b, "layers.1.mlp.down_proj", 3, 0)
    for t in (a, b):
        t.rows = {k: dataclasses.replace(r, values=None) for k, r in t.rows.items()}
    r = locate(a, b)
    assert r.first is not None and r.first.max_abs_diff is None
    assert "values not stored" in format_result(r)


# ---- the CLI ---------------------------------------------------------------------------------
def test_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = make_trace("trainer").write(tmp_path / "a.json")
    b = make_trace("engine").write(tmp_path / "b.json")
    bad = make_trace("engine")
    one_ulp(bad, "layers.1.self_attn.core", 5, 1)
    c = bad.write(tmp_path / "c.json.gz")
    rc, out, _ = locate_cli(capsys, str(a), str(b))
    assert rc == 0 and out.startswith("no divergence")
    rc, out, _ = locate_cli(capsys, str(a), str(c))
    assert rc == 1
    assert out.splitlines()[0] == (
        "first divergence: layer 1, site layers.1.self_attn.core (attention), "
        "token position 5, sequence 1"
    )
    rc, out, _ = locate_cli(capsys, "--json", str(a), str(c))
    assert rc == 1 and json.loads(out)["first"]["site"] == "layers.1.self_attn.core"


def test_console_script(tmp_path: Path) -> None:
    """The installed `isoexec` lists `locate` and returns its exit code."""
    a = make_trace("trainer").write(tmp_path / "a.json")
    bad = make_trace("engine")
    one_ulp(bad, "layers.0.mlp.down_proj", 2, 0)
    r = isoexec("locate", str(a), str(bad.write(tmp_path / "b.json")))
    assert r.returncode == 1 and "site layers.0.mlp.down_proj" in r.stdout, r
    assert "locate" in isoexec("--help").stdout


def _mutate(d: dict, how: str) -> object:
    if how == "format":
        d["format"] = "something-else"
    elif how == "version":
        d["version"] = 99
    elif how == "unknown-site":
        d["rows"][3]["site"] = "layers.7.self_attn.core"
    elif how == "digest":
        d["rows"][0]["digest"] = "xyz"
    elif how == "values":
        d["rows"][0]["values"] = d["rows"][0]["values"][:8]
    elif how == "position":
        d["rows"][0]["pos"] = 10_000
    elif how == "missing":
        del d["rows"][0]["max_abs"]
    elif how == "list":
        return [1, 2, 3]
    return d


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("format", "not a trace"),
        ("version", "version 99 is not supported"),
        ("unknown-site", "rows[3]: site 'layers.7.self_attn.core' is not a site of this model"),
        ("digest", "rows[0]: digest must be 16 lowercase hex digits"),
        ("values", "rows[0]: values hold 1 floats, width is 8"),
        ("position", "rows[0]: pos 10000 outside sequence"),
        ("missing", "rows[0]: missing field 'max_abs'"),
        ("list", "top level is not an object"),
    ],
)
def test_malformed_trace_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str, message: str
) -> None:
    good = make_trace("trainer").write(tmp_path / "good.json")
    data = _mutate(json.loads(good.read_text()), how)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TraceFormatError, match=r"bad\.json"):
        Trace.read(path)
    rc, out, err = locate_cli(capsys, str(good), str(path))
    assert rc == 2 and out == ""
    assert err.startswith(f"isoexec locate: error: {path}: ") and message in err, err


def test_unreadable_or_unalignable_input_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = make_trace("trainer").write(tmp_path / "good.json")
    (tmp_path / "junk.json").write_text("{not json")
    rc, _, err = locate_cli(capsys, str(good), str(tmp_path / "junk.json"))
    assert rc == 2 and "not JSON" in err
    rc, _, err = locate_cli(capsys, str(good), str(tmp_path / "missing.json"))
    assert rc == 2 and "cannot read" in err

    other = copy.deepcopy(make_trace("engine"))
    other.sequences[1] = [*other.sequences[1][:-1], 63]
    rc, _, err = locate_cli(capsys, str(good), str(other.write(tmp_path / "other.json")))
    assert rc == 2 and "sequence 1 has different tokens" in err

    deeper = Trace.for_model("engine", {**HF, "num_hidden_layers": 3}, "float32")
    deeper.begin_sequence(0, SEQS[0])
    rc, _, err = locate_cli(capsys, str(good), str(deeper.write(tmp_path / "deeper.json")))
    assert rc == 2 and "different models" in err

    disjoint = Trace.for_model("engine", HF, "float32")
    disjoint.begin_sequence(5, SEQS[0])
    rc, _, err = locate_cli(capsys, str(good), str(disjoint.write(tmp_path / "disjoint.json")))
    assert rc == 2 and "no sequence in common" in err


def test_pair_has_the_locate_option() -> None:
    from isoexec.tools.cli import build_parser
    from isoexec.tools.pair import ArmResult

    args = build_parser("pair").parse_args(["pair", "--locate", "--arms", "isoexec"])
    assert args.locate is True
    assert build_parser("pair").parse_args(["pair"]).locate is False
    assert ArmResult("isoexec", "MATCH", 1, 1, 0.0, 0.0).locate is None  # results.json field
