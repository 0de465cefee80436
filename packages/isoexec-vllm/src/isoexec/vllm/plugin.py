"""The `vllm.general_plugins` entry point. vLLM calls `register()` in every process it starts."""

from __future__ import annotations


def register() -> None:
    """Install IsoExec into this vLLM process when `ISOEXEC=1`; leave vLLM untouched otherwise,
    with one exception: where stock vLLM cannot import its Qwen3.5 classes (they need
    torchvision), the text-only ones are registered with stock layers, so that a stock engine
    serves these checkpoints at all (the stock arm of `isoexec pair`)."""
    from isoexec.contract.switch import isoexec_enabled

    if not isoexec_enabled():
        from isoexec.vllm.qwen3_5 import register_qwen3_5, stock_can_import_qwen3_5

        if not stock_can_import_qwen3_5():
            register_qwen3_5(isoexec=False)
        return
    from isoexec.vllm.install import install_plugin

    install_plugin()
