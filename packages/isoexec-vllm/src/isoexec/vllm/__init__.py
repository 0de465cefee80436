"""IsoExec engine side: a vLLM plugin that installs the canonical ops into vLLM."""
