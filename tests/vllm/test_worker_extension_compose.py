"""`compose`: one worker extension class from IsoExec's and a framework's, refusing clashes."""

from __future__ import annotations

import pytest

from isoexec.vllm.worker_extension import (
    IsoWorkerExtension,
    compose,
    require_isoexec_extension,
)


class Framework:
    def update_weights(self) -> str:
        return "framework"


class Other:
    def ping(self) -> str:
        return "pong"


def test_composed_class_has_both_method_sets() -> None:
    cls = compose(Framework, Other)
    assert issubclass(cls, IsoWorkerExtension) and issubclass(cls, Framework)
    obj = cls()
    assert obj.update_weights() == "framework" and obj.ping() == "pong"
    assert callable(obj.isoexec_commit_weights)


def test_name_clashes_are_refused() -> None:
    class Shadow:
        def isoexec_load_weights(self) -> None: ...

    with pytest.raises(ValueError, match="clash on 'isoexec_load_weights'"):
        compose(Shadow)

    class Twin:
        def update_weights(self) -> str:
            return "twin"

    with pytest.raises(ValueError, match=r"clash on 'update_weights'.*Framework.*Twin"):
        compose(Framework, Twin)
    with pytest.raises(ValueError, match="at least one"):
        compose()
    with pytest.raises(TypeError, match="takes classes"):
        compose(Framework())  # type: ignore[arg-type]


def test_an_extension_without_isoexec_is_refused() -> None:
    with pytest.raises(ValueError, match="does not include IsoExec's"):
        require_isoexec_extension(f"{__name__}.Framework")
    with pytest.raises(ValueError, match="cannot be imported"):
        require_isoexec_extension("no_such_module.Extension")
    assert require_isoexec_extension(
        "isoexec.vllm.worker_extension.IsoWorkerExtension") is IsoWorkerExtension  # fmt: skip
