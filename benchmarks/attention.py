"""The attention kernel benchmark of `paro bench`, run from the source checkout. The code lives in
`paroattn/bench.py` (installed with the package); this entry point keeps the commands of
BENCHMARKS.md working and takes the same options:

    python benchmarks/attention.py [--shapes cogvideox-5b,flux.1-dev] [--sweep] [--rope] [--graph] [--out DIR]
    python benchmarks/attention.py --table RESULTS.json [...] [--summary]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paroattn.bench import *  # noqa: E402,F403 -- the benchmark's names, for scripts that import this file
from paroattn.bench import main  # noqa: E402

if __name__ == "__main__":
    main()
