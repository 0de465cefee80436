"""IsoExec shared core: canonical ops, op sites, the execution contract and the handshake.

Both sides (trainer and engine) import the numerics from here, so there is exactly one
implementation of every canonical op.
"""
