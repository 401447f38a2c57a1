"""Plan building against torch.tensor(list), timed in the same run.

python benchmarks/bench_plan.py
"""

from mstar.bench import format_table
from mstar.bench.plan import run

if __name__ == "__main__":
    print(format_table(run()))
