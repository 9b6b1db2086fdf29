"""The benchmark suite and its tools; kept out of the installed package because it imports PyTorch
as the reference (``torch_reference.py``). Run it with ``npformer bench`` or ``python benchmarks/run.py``."""
