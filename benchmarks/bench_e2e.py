"""Engine.generate against HF generate and generate_batch on SmolLM2 chat prompts.

python benchmarks/bench_e2e.py [--quick]
"""

import sys

from mstar.bench.e2e import format_e2e, run_e2e

if __name__ == "__main__":
    print(format_e2e(run_e2e(quick="--quick" in sys.argv[1:])))
