"""IsoExec vs native overhead: moved into the package as `isoexec bench` (isoexec.tools.bench).

    python benchmarks/overhead.py ARGS   is   isoexec bench ARGS

(`--out` is now a folder: DIR/bench.json and DIR/bench.png; `isoexec bench --help`.)
"""

import sys

from isoexec.tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
