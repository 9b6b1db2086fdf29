"""npformer: a Transformer written from scratch with hand-written forward and backward passes.

Every op is a pure ``<op>_forward`` / ``<op>_backward`` pair in :mod:`npformer.ops`, running on
NumPy or CuPy through :mod:`npformer.backend`; every backward is checked by :func:`gradcheck`.
"""
from npformer import backend, ops
from npformer.tools.gradcheck import GradcheckError, GradcheckReport, gradcheck

__version__ = "0.1.0"
__all__ = ["backend", "ops", "gradcheck", "GradcheckReport", "GradcheckError", "__version__"]
