"""Progress of long commands (``npformer train``, ``study``, ``bench``): a tqdm bar with its ETA on a
user's terminal, plain lines with the ETA everywhere else.

"A user's terminal" is standard output connected to a terminal that reports a width, in a process
no MPI launcher started: Open MPI's ``mpirun`` forwards rank 0's output through a pseudo-terminal
even when its own output goes to a file, so under a launcher a bar would be drawn into the log
(MPICH forwards a pipe). A terminal that reports 0 columns (some CI runners, ``script`` sessions)
cannot show a bar either. Host-side code: it reads the launcher's environment through
:func:`npformer.launcher.launched_by_mpi`, the one place that does.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, TextIO

from tqdm import tqdm

from npformer.launcher import launched_by_mpi

__all__ = ["interactive", "Progress", "TIMES"]

TIMES = "{elapsed} elapsed, ETA {remaining}"    # tqdm's fields that end a plain progress line


def interactive(stream: TextIO | None = None) -> bool:
    """Whether a progress bar may be drawn on ``stream`` (default standard output): see the module."""
    stream = sys.stdout if stream is None else stream
    try:
        if not stream.isatty() or launched_by_mpi():
            return False
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, ValueError, OSError):        # replaced streams, closed files, no terminal
        return False


class Progress:
    """``total`` units of work (steps, configurations, cases) named ``what``: on a user's terminal a
    tqdm bar, whose :meth:`write` prints above it; elsewhere ``log`` gets a plain line at every quarter
    of the way (the last at the end) with the elapsed time and tqdm's ETA. Use as a context manager::

        with Progress(300, "layers post-norm", unit="step") as progress:
            for step in range(300):
                ...
                progress.update()
    """

    def __init__(self, total: int, what: str, *, unit: str = "step", log: Callable[[str], Any] = print,
                 stream: TextIO | None = None):
        self.total, self.what, self.unit, self.log = int(total), what, unit, log
        self.done, self.start = 0, time.perf_counter()
        self.tty = log is print and interactive(stream)
        self.bar = tqdm(total=self.total, desc=what, unit=unit, file=stream or sys.stdout, disable=not self.tty,
                        dynamic_ncols=True, leave=False)
        self._quarters = 0                                  # quarters of the way reported so far

    def update(self, n: int = 1, note: Callable[[], str] | None = None) -> None:
        """``n`` more units done; ``note()`` (a figure such as the running loss) is shown beside the
        bar, or in the line (called only then)."""
        self.done += n
        reached = min(4, self.done * 4 // max(self.total, 1))
        if self.tty:
            if note is not None:
                self.bar.set_postfix_str(note(), refresh=False)
            self.bar.update(n)
            return
        if reached <= self._quarters:
            return
        self._quarters = reached
        elapsed = time.perf_counter() - self.start
        self.log(f"  {self.what}: {self.unit} {self.done}/{self.total}  " + (f"{note()}  " if note else "")
                 + tqdm.format_meter(self.done, self.total, elapsed, bar_format=TIMES))

    def write(self, line: str) -> None:
        """``line`` to the log, above the bar on a terminal."""
        (tqdm.write if self.tty else self.log)(line)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
