"""IsoExec trainer side: canonical ops installed into Megatron-core models."""
