"""Plan building against torch.tensor(list), and the prefix cache's match
against a hashlib digest per page, timed in the same run.

OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_plan.py
"""

from mstar.bench import format_table
from mstar.bench import plan as bench_plan
from mstar.bench import prefix as bench_prefix

if __name__ == "__main__":
    print(format_table(bench_plan.run()))
    print()
    print(format_table(bench_prefix.run()))
