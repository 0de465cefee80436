"""The checked-in generated code is exactly what scripts/gen_proto.py produces now."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "packages/isoexec-contract/src/isoexec/handshake/_gen"


def _gen_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts/gen_proto.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_code_is_not_stale(tmp_path: Path) -> None:
    written = _gen_module().generate(tmp_path)
    assert {p.name for p in written} == {p.name for p in GEN.glob("*.py*")}
    for p in written:
        assert p.read_bytes() == (GEN / p.name).read_bytes(), (
            f"{p.name} is stale: run `python scripts/gen_proto.py` and commit the result"
        )


def test_generated_imports_point_into_the_package() -> None:
    text = (GEN / "handshake_pb2_grpc.py").read_text()
    assert "from isoexec.handshake._gen import handshake_pb2" in text
    assert "isoexec.v1 import" not in text
    from isoexec.handshake._gen import handshake_pb2, handshake_pb2_grpc

    assert handshake_pb2.DESCRIPTOR.package == "isoexec.v1"
    assert hasattr(handshake_pb2_grpc, "ContractExchangeStub")
    assert "isoexec.v1" not in sys.modules
