"""Tools that check the math: the finite-difference gradient checker (:mod:`~npformer.tools.gradcheck`)
and the table of checks behind ``npformer gradcheck`` (:mod:`~npformer.tools.gradcheck_suite`). The
plots of the experiments live in :mod:`npformer.study`, the benchmark suite in :mod:`npformer.bench`."""
from npformer.tools.gradcheck import GradcheckError, GradcheckReport, check_gradients, gradcheck

__all__ = ["GradcheckError", "GradcheckReport", "check_gradients", "gradcheck"]
