"""Steady-state decode through KVManager against a Python-list manager,
timed in the same run, with a bare copy of the indices as the floor.

    python benchmarks/bench_manager.py
"""

from mstar.bench import format_table
from mstar.bench.manager import run

if __name__ == "__main__":
    print(format_table(run()))
