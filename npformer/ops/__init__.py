"""Pure forward/backward pairs: ``out, cache = <op>_forward(...)``, ``grads = <op>_backward(dout, cache)``."""
