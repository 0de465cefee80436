"""The `vllm.general_plugins` entry point. vLLM calls `register()` in every process it starts."""

from __future__ import annotations


def register() -> None:
    """Install IsoExec into this vLLM process when `ISOEXEC=1`; leave vLLM untouched otherwise."""
    from isoexec.contract.switch import isoexec_enabled

    if not isoexec_enabled():
        return
    from isoexec.vllm.install import install_plugin

    install_plugin()
