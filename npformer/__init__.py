"""npformer: a Transformer written from scratch with hand-written forward and backward passes.

Every op is a pure ``<op>_forward`` / ``<op>_backward`` pair in :mod:`npformer.ops`, running on
NumPy or CuPy through :mod:`npformer.backend`; faster implementations of some of them live apart in
:mod:`npformer.kernels` (``npformer.kernels.disabled()`` runs the reference ops alone); every
backward is checked by :func:`gradcheck`.

The layers, bottom-up: ``errors``, ``backend``, ``checks``, ``dispatch``, ``ops``, ``kernels``,
``nn``, ``models``, ``data``, ``training``, ``tools``, ``study``, ``pretrained``, ``bench``, ``cli``.
"""
from npformer import backend, kernels, ops
from npformer.dispatch import detect_anomaly
from npformer.kernels.cpu.threads import get_num_threads, set_num_threads
from npformer.tools.gradcheck import GradcheckError, GradcheckReport, gradcheck
from npformer.version import __version__

__all__ = ["backend", "kernels", "ops", "detect_anomaly", "gradcheck", "GradcheckReport", "GradcheckError",
           "set_num_threads", "get_num_threads", "__version__"]
