"""IsoExec's tools: what a user runs to check, measure and debug a pairing (`isoexec pair`,
`isoexec bench`, `isoexec locate`, `isoexec contract`, the tiny models and adapters the tests and
presets make). The one layer that imports both sides (lazily, after naming a missing one).
"""
