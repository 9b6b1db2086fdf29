"""The benchmark suite with PyTorch's columns and parity::

    python benchmarks/run.py [--quick] [--backends numpy,cupy,torch] [--paths fast,reference]
                             [--only CASES] [--skip-parity] [--out runs/bench] [--threads N]

It registers the PyTorch reference (``benchmarks/torch_reference.py``, kept out of the installed
package) where torch imports, then calls ``npformer.bench.main``, which ``npformer bench`` calls
without it; see ``benchmarks/README.md`` for the layout, the parity rule and the columns.
"""
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        import benchmarks.torch_reference  # noqa: F401 - registers "torch" with npformer.bench
    except ImportError as exc:
        if exc.name != "torch":
            raise
        print("note: torch: not importable; npformer's columns only, parity unchecked")
    from npformer.bench import main
    sys.exit(main(sys.argv[1:]))
