"""A whole training step on the CPU fast paths gives the same bits however its element-wise work was
cut and however busy the machine: at a given thread count (1 or 2), with the element-wise work and
attention's rows cut for the threads or left whole (as threads.machine_busy() leaves them), on a
quiet machine and beside a CPU hog on every core (where a worker may be set aside mid-step and the
caller runs its part). Only the number of element-wise parts follows the load, and this holds the
results to not following it. (Another thread count is another setting: a product cut into more parts is
computed by other BLAS calls, tests/kernels/cpu/test_threads.py.)"""
import contextlib
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
                results[(count, "cut", "quiet")] = _two_steps()
                with monkeypatch.context() as m:
                    m.setattr(threads, "machine_busy", lambda: True)   # element-wise work whole
                    results[(count, "whole", "quiet")] = _two_steps()
                stop = hog()
                try:
                    results[(count, "cut", "busy")] = _two_steps()
                finally:
                    stop()
    finally:
        threads.set_num_threads(before, blas=False)
    for count in (1, 2):
        want = results[(count, "cut", "quiet")]
        for key in [k for k in results if k[0] == count]:
            for g, w in zip(results[key], want):
                assert g.tobytes() == w.tobytes(), f"{key} differs from {(count, 'cut', 'quiet')}"
