"""Tools that show and check the math: gradient checks (and, later, attention maps and plots)."""
from npformer.tools.gradcheck import GradcheckError, GradcheckReport, check_gradients, gradcheck

__all__ = ["GradcheckError", "GradcheckReport", "check_gradients", "gradcheck"]
