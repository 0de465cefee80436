"""IsoExec on Ray."""
