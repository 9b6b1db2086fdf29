"""The version of npformer: its one home, read by setup.cfg (``attr:``), ``npformer.__version__`` and
``npformer --version``; a module of its own so the command line reads it without importing the package's
top (the layers read bottom-up)."""
__version__ = "0.1.0"
