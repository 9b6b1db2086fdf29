"""A whole training step on the CPU fast paths gives the same bits however timing cut its work: at
a given thread count (1 or 2), with the wall-clock window of npformer.kernels.cpu.threads (no
cutting while BLAS's workers are awake) held open or shut for the whole step, left to the clock
on a quiet machine, and left to the clock with the machine busy (a CPU hog on every core beside
the test). The window is decided by the clock, so any difference here would make a result depend
on timing. (Another thread count is another setting, not timing: BLAS at another thread count may
add a product's terms in another order, tests/kernels/cpu/test_threads.py.)"""
import contextlib
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from npformer import kernels
from npformer.kernels import numba_cpu
from npformer.kernels.cpu import threads
from npformer.models.gpt import GPT, GPTConfig
from npformer.nn.flat import flatten_parameters
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from npformer.training import AdamW, clip_grad_norm

# large enough that the element-wise work, the rows and the products are cut for two threads
CFG = GPTConfig(vocab_size=512, block_size=128, n_layer=2, n_head=4, d_model=256, dim_feedforward=1024,
                dropout=0.1)


def _two_steps() -> list[np.ndarray]:
    model = GPT(CFG, dtype="float32", backend="numpy", rng=0)
    flatten_parameters(model)
    opt = AdamW(model.named_parameters(), lr=1e-3, weight_decay=0.1)
    r = np.random.default_rng(1)
    for step in range(2):
        model.manual_seed((0, step))
        x, y = r.integers(0, 512, (8, 128)), r.integers(0, 512, (8, 128))
        model.zero_grad()
        loss, cache = cross_entropy_forward(model(x), y)
        model.backward(cross_entropy_backward(np.ones((), np.float32), cache))
        clip_grad_norm(model.parameters(), 1.0)
        opt.step()
    return [np.array(p.data) for p in model.parameters()] + [np.asarray(loss)]


@pytest.fixture
def hog():
    """Start a busy loop on every core; returns a function that stops them."""
    def start():
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                 for _ in range(len(os.sched_getaffinity(0)))]

        def stop():
            for p in procs:
                p.kill()
                p.wait()
        return stop
    return start


@pytest.mark.parametrize("compiled", [False, True], ids=["numpy-paths", "numba-paths"])
def test_a_step_has_the_same_bits_however_its_work_was_cut(monkeypatch, hog, compiled):
    if compiled and not numba_cpu.AVAILABLE:
        pytest.skip("numba not installed: the compiled CPU paths are off")
    before = threads.get_num_threads()
    results = {}
    try:
        with kernels.disabled("numba") if not compiled else contextlib.nullcontext():
            for count in (1, 2):
                threads.set_num_threads(count, blas=False)
                for window in ("open", "shut"):          # open: BLAS awake, nothing is cut
                    held = math.inf if window == "open" else 0.0     # the window held, whatever products run
                    monkeypatch.setattr(threads, "BLAS_AWAKE_SECONDS", held)
                    monkeypatch.setitem(threads._state, "blas_awake_until", held)
                    assert threads.blas_awake() == (window == "open")
                    results[(count, window, "quiet")] = _two_steps()
                    assert threads.blas_awake() == (window == "open")
                monkeypatch.undo()
                stop = hog()
                try:
                    results[(count, "clock", "busy")] = _two_steps()
                finally:
                    stop()
                results[(count, "clock", "quiet")] = _two_steps()
    finally:
        threads.set_num_threads(before, blas=False)
    for count in (1, 2):
        want = results[(count, "open", "quiet")]
        for key in [k for k in results if k[0] == count]:
            for g, w in zip(results[key], want):
                assert g.tobytes() == w.tobytes(), f"{key} differs from {(count, 'open', 'quiet')}"
