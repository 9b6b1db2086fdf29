"""Benchmark scripts of the source checkout, and the PyTorch reference of the benchmark suite
(``torch_reference.py``), kept here because it imports PyTorch; the suite itself is
:mod:`npformer.bench`. ``python benchmarks/run.py`` runs the suite with PyTorch's columns and parity,
``npformer bench`` without them."""
