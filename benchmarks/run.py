"""The benchmark suite's one command::

    python benchmarks/run.py [--quick] [--backends numpy,cupy,torch] [--paths fast,reference]
                             [--only CASES] [--skip-parity] [--out benchmarks/results] [--threads N]

It calls ``benchmarks.bench.main``; see ``benchmarks/README.md`` for the layout, the parity rule
and the columns.
"""
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.bench import main
    sys.exit(main(sys.argv[1:]))
