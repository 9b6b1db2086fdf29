"""The benchmark suite's one command (issue 5)::

    python benchmarks/run.py [--quick] [--backends numpy,cupy,torch] [--out benchmarks/results]

All the work is in ``benchmarks/bench.py``; see ``benchmarks/README.md`` for the columns.
"""
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.bench import main
    sys.exit(main(sys.argv[1:]))
