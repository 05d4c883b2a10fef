"""Run coda's benchmarks and write the results file into benchmarks/results/.

    python benchmarks/run.py [--only mlp ...]   # same as: python -m coda.bench --out benchmarks/results

The cases, baselines and timing method are in python/coda/bench/.
"""

import os
import sys

from coda.bench import main

if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.exit(main(sys.argv[1:] + ["--out", os.path.join(here, "results")]))
