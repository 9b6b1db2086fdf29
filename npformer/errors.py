"""The exceptions npformer raises for a mistake in what it was given: one type per kind of mistake.

Each is also the built-in exception Python code expects for that kind (``TypeError`` or
``ValueError``), so ``except ValueError`` keeps working, and all share :class:`NpformerError`:

=========================  ===========================  ============================================
exception                  also a                       the mistake
=========================  ===========================  ============================================
:class:`InputTypeError`    ``TypeError``                a value of the wrong type: not an array, an
                                                        integer dtype where floats are needed, two
                                                        dtypes mixed, a string where a number goes
:class:`BackendMismatchError`  ``TypeError``            NumPy and CuPy arrays mixed in one call
:class:`ShapeError`        ``ValueError``               a wrong rank, shape, or sizes that do not
                                                        fit each other (an empty axis included)
:class:`RangeError`        ``ValueError``               a value outside what it may be: a size below
                                                        1, a probability outside [0, 1], a token id
                                                        beyond the vocabulary, a non-finite number,
                                                        a name that is not one of the choices
:class:`NonFiniteError`    ``FloatingPointError``       an op produced NaN or inf (inside
                                                        ``npformer.detect_anomaly()``), or bfloat16
                                                        training's gradients are not finite
:class:`StateDictError`    ``KeyError``, ``ValueError``  a state dict that does not fit a module
:class:`BackendUnavailableError`  ``RuntimeError``      the backend asked for cannot run here
:class:`CaptureError`      ``RuntimeError``             a step that CUDA cannot capture in a graph (a
                                                        host sync inside it)
:class:`CheckpointError`   ``ValueError``               a checkpoint that cannot be read (not a zip,
                                                        damaged, missing members or meta keys, sizes
                                                        or dtypes that do not fit, non-finite
                                                        weights) or a path it cannot be written to
:class:`WriteError`        ``OSError``                  an output file that could not be written (a
                                                        full disk, no permission); the earlier file
                                                        is kept (:mod:`npformer.files`)
:class:`DistributedError`  ``RuntimeError``             a data-parallel run that cannot go on: mpi4py,
                                                        MPI or NCCL missing, ranks whose configs
                                                        differ, a checkpoint of another rank count
:class:`CallOrderError`    ``RuntimeError``             methods called out of order: a module's
                                                        ``backward`` with no forward call left to
                                                        back-propagate
=========================  ===========================  ============================================

Every message names what was expected and what came (:mod:`npformer.checks` writes them).
"""
from __future__ import annotations

__all__ = ["NpformerError", "InputTypeError", "BackendMismatchError", "ShapeError", "RangeError",
           "NonFiniteError", "StateDictError", "BackendUnavailableError", "CheckpointError", "WriteError",
           "CaptureError", "DistributedError", "MissingExtraError", "CallOrderError"]


class NpformerError(Exception):
    """The base of every exception npformer raises for a mistake in its input or set-up."""


class InputTypeError(NpformerError, TypeError):
    """A value of the wrong type or dtype."""


class BackendMismatchError(InputTypeError):
    """Arrays of two backends (NumPy and CuPy) in one call; transfers are always explicit."""


class ShapeError(NpformerError, ValueError):
    """A wrong rank or shape, or sizes that do not fit each other."""


class RangeError(NpformerError, ValueError):
    """A value outside the values it may take (sizes, probabilities, ids, finite numbers, choices)."""


class NonFiniteError(NpformerError, FloatingPointError):
    """An op returned NaN, or an infinity its inputs did not hold, under ``npformer.detect_anomaly()``;
    or a bfloat16 mixed-precision step's gradients are not finite (it has no loss scale to lower)."""


class StateDictError(NpformerError, KeyError, ValueError):
    """A state dict that does not fit the module: missing or unexpected keys, or wrong shapes."""

    def __str__(self) -> str:       # KeyError would quote the message; show it as written
        return str(self.args[0]) if self.args else ""


class BackendUnavailableError(NpformerError, RuntimeError):
    """The backend that was asked for cannot run here (CuPy not installed, or no GPU visible)."""


class MissingExtraError(NpformerError, ImportError):
    """An optional package a feature needs is not installed; the message says how to install it."""


class CheckpointError(NpformerError, ValueError):
    """A checkpoint file that cannot be read or written; the message names the file and what is wrong."""


class WriteError(NpformerError, OSError):
    """An output file that could not be written; the message names the path, the reason and what
    was kept (the earlier file, or nothing half-written): see :mod:`npformer.files`."""


class CaptureError(NpformerError, RuntimeError):
    """A step that cannot be captured in a CUDA graph: it reads device data on the host inside
    (``float(loss)``, ``.item()``, a data-dependent shape); see :mod:`npformer.training.cuda_graph`."""


class DistributedError(NpformerError, RuntimeError):
    """A data-parallel run that cannot start or go on (:mod:`npformer.distributed`): the communication
    library is missing, or the ranks disagree (configs, the rank count of a checkpoint)."""


class CallOrderError(NpformerError, RuntimeError):
    """Methods called out of order: a ``backward`` without a matching ``forward`` (each forward call
    is back-propagated once, newest first), found before any saved state is used up."""
