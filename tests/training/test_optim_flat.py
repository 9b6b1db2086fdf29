"""The optimisers over flat buffers (npformer.nn.flat) against the per-parameter loop: the same
parameters step after step (weight decay, clipping, param groups, parameters without a grad, lr
changes), a few update calls per step, the same state dicts loading either way, mixed precision
with a skipped step, the reference loop inside kernels.disabled(), and the trainers on the flat path."""
import math

import numpy as np
import pytest

from npformer import kernels
from npformer.models.gpt import GPT, GPTConfig
from npformer.nn.flat import flat_parameters, flatten_parameters
from npformer.nn.module import Parameter
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from npformer.training import SGD, Adam, AdamW, clip_grad_norm
from npformer.training import amp as amp_module
from npformer.training import optim as optim_module
from npformer.training.amp import MixedPrecision
from tests.helpers import host

CFG = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=16, dropout=0.1)
FACTORIES = {
    "adamw": lambda ps: AdamW(ps, lr=3e-2, weight_decay=0.1),
    "adamw-all": lambda ps: AdamW(ps, lr=3e-2, weight_decay=0.1, decay_filter=None),
    "adam-l2": lambda ps: Adam(ps, lr=3e-2, weight_decay=0.05),
    "sgd": lambda ps: SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd-nesterov": lambda ps: SGD(ps, lr=0.1, momentum=0.8, nesterov=True),
    "sgd-plain": lambda ps: SGD(ps, lr=0.1),
}


def _backend(xp):
    return "numpy" if xp.__name__ == "numpy" else "cupy"


def _models(xp, dtype="float64"):
    """Two copies of one GPT: separate arrays, and flattened."""
    plain, flat = (GPT(CFG, dtype=dtype, backend=_backend(xp), rng=0) for _ in range(2))
    flatten_parameters(flat)
    return plain, flat


def _grads(model, step, skip=()):
    """Seeded host gradients per parameter name (None for the names in ``skip``)."""
    r = np.random.default_rng(step)
    return {n: None if n in skip else r.standard_normal(p.shape) for n, p in model.named_parameters()}


def _give(xp, model, grads, dtype):
    model.zero_grad()
    for n, p in model.named_parameters():
        if grads[n] is not None:
            p.accumulate(xp.asarray(grads[n].astype(dtype)))


def _same(a_model, b_model, exact=True):
    for (n, a), b in zip(a_model.named_parameters(), b_model.parameters()):
        if exact:
            np.testing.assert_array_equal(host(a.data), host(b.data), err_msg=n)
        else:
            np.testing.assert_allclose(host(b.data), host(a.data), rtol=1e-15, atol=1e-15, err_msg=n)


@pytest.fixture
def calls(monkeypatch):
    """Counts of the update ops' calls by the optimisers (one call = one kernel launch on CuPy)."""
    counts = {"adam_update": 0, "sgd_update": 0, "sum_of_squares": 0}
    for home, name in [(optim_module, n) for n in counts] + [(amp_module, "sum_of_squares")]:
        real = getattr(home, name)
        monkeypatch.setattr(home, name, lambda *a, _n=name, _f=real, **k: (
            counts.__setitem__(_n, counts[_n] + 1), _f(*a, **k))[1])
    return counts


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_flat_steps_equal_the_per_parameter_loop(xp, name, calls):
    """Float64, 6 steps with clipping: the update is element-wise, so the parameters are equal bit for
    bit except through the clip's norm (its float64 sum is added in another order: 1e-15)."""
    plain, flat = _models(xp)
    opts = [FACTORIES[name](m.named_parameters()) for m in (plain, flat)]
    for step in range(6):
        grads = _grads(plain, step)
        norms = []
        for model, opt in zip((plain, flat), opts):
            _give(xp, model, grads, "float64")
            norms.append(clip_grad_norm(model.parameters(), 40.0 if step % 2 else 1e9))
            opt.step()
        assert norms[1] == pytest.approx(norms[0], rel=2e-12)       # another order of additions: n eps
        _same(plain, flat, exact=False)
    per_step = {k: v / 6 for k, v in calls.items()}
    n = len(list(plain.parameters()))
    update = "sgd_update" if name.startswith("sgd") else "adam_update"
    runs = 2 if name == "adamw" else 1             # AdamW decays the weights only: two runs of the buffer
    assert per_step[update] == n + runs and per_step["sum_of_squares"] == n + 1


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_without_clipping_the_parameters_are_equal_bit_for_bit(xp, name):
    plain, flat = _models(xp, "float32")
    opts = [FACTORIES[name](m.named_parameters()) for m in (plain, flat)]
    for step in range(5):
        grads = _grads(plain, step)
        for model, opt in zip((plain, flat), opts):
            _give(xp, model, grads, "float32")
            opt.step()
    _same(plain, flat)
    assert set(opts[0].state_dict()) == set(opts[1].state_dict())


def test_missing_grads_groups_and_lr_changes_split_the_runs(xp, calls):
    """A parameter without a grad is skipped (its step count stays behind, which splits runs later);
    two groups with their own lr; lr changed between steps: still the per-parameter numbers."""
    plain, flat = _models(xp)
    names = [n for n, _ in plain.named_parameters()]
    skip = {names[1], names[5]}

    def groups(model):
        ps = list(model.named_parameters())
        return [{"params": ps[:4], "lr": 0.01}, {"params": ps[4:]}]
    opts = [AdamW(groups(m), lr=3e-2, weight_decay=0.1) for m in (plain, flat)]
    for step in range(6):
        grads = _grads(plain, step, skip=skip if step < 3 else ())
        for model, opt in zip((plain, flat), opts):
            _give(xp, model, grads, "float64")
            opt.param_groups[1]["lr"] = 0.03 / (1 + step)
            opt.step()
        _same(plain, flat)
    steps = {i: st["step"] for i, st in opts[1].state.items()}
    assert steps[1] == steps[5] == 3 and steps[0] == 6
    assert calls["adam_update"] > 6 * 2 + len(names) * 6 / 2        # more, smaller runs than two a step


def test_state_dicts_are_the_same_and_load_either_way(xp):
    """A flat optimiser's state dict equals the per-parameter one's; each loads into the other and the
    runs continue identically (checkpoints and --resume do not see the flat buffers)."""
    plain, flat = _models(xp)
    opts = [AdamW(m.named_parameters(), lr=3e-2) for m in (plain, flat)]
    for step in range(3):
        grads = _grads(plain, step)
        for model, opt in zip((plain, flat), opts):
            _give(xp, model, grads, "float64")
            opt.step()
    sds = [opt.state_dict() for opt in opts]
    assert list(sds[0]) == list(sds[1])
    for k in sds[0]:
        np.testing.assert_array_equal(host(sds[0][k]), host(sds[1][k]), err_msg=k)
    # swap: the per-parameter weights and state into a flat model, and the other way round
    swapped_plain, swapped_flat = _models(xp)
    swapped_plain.load_state_dict(flat.state_dict())
    swapped_flat.load_state_dict(plain.state_dict())
    assert flat_parameters(swapped_flat) is not None
    new = [AdamW(m.named_parameters(), lr=3e-2) for m in (swapped_plain, swapped_flat)]
    new[0].load_state_dict(sds[1])
    new[1].load_state_dict(sds[0])
    for step in range(3, 6):
        grads = _grads(plain, step)
        for model, opt in zip((plain, flat, swapped_plain, swapped_flat), opts + new):
            _give(xp, model, grads, "float64")
            opt.step()
    for other in (flat, swapped_plain, swapped_flat):
        _same(plain, other)


def test_disabled_fast_paths_run_the_per_parameter_loop(xp, calls):
    plain, flat = _models(xp)
    opts = [AdamW(m.named_parameters(), lr=3e-2) for m in (plain, flat)]
    n = len(list(plain.parameters()))
    for step in range(3):
        grads = _grads(plain, step)
        _give(xp, plain, grads, "float64")
        clip_grad_norm(plain.parameters(), 1.0)
        opts[0].step()
        _give(xp, flat, grads, "float64")
        with kernels.disabled():
            clip_grad_norm(flat.parameters(), 1.0)
            opts[1].step()
        _same(plain, flat)                                          # the same loop: the same bits
    assert calls["adam_update"] == 2 * 3 * n and calls["sum_of_squares"] == 2 * 3 * n


def _amp_model(xp, flat, precision="float16"):
    """A GPT (flattened or not) under MixedPrecision in ``precision``, and AdamW over its masters."""
    model = GPT(CFG, dtype="float32", backend=_backend(xp), rng=0)
    if flat:
        flatten_parameters(model)
    amp = MixedPrecision(model, precision)
    return model, amp, AdamW(amp.named_parameters(), lr=1e-2, weight_decay=0.1)


def _amp_backward(xp, model, amp, step):
    """Step ``step``'s seeded batch forward, float32 cross-entropy, and backward from S; returns the loss."""
    model.manual_seed((0, step))
    r = np.random.default_rng(step)
    x, y = xp.asarray(r.integers(0, 11, (4, 8))), xp.asarray(r.integers(0, 11, (4, 8)))
    logits = model(x)
    loss, cache = cross_entropy_forward(logits.astype(xp.float32), y)
    model.backward(cross_entropy_backward(amp.scaled_dloss(), cache).astype(amp.dtype))
    return loss


def _amp_run(xp, flat, steps, inf_at=None):
    """Mixed-precision GPT training (float16 model, float32 masters, clip 1.0); an inf in one gradient
    at step ``inf_at`` (the step is skipped and the scale halves)."""
    model, amp, opt = _amp_model(xp, flat)
    results = []
    for step in range(steps):
        loss = _amp_backward(xp, model, amp, step)
        if step == inf_at:
            model.wpe.weight.grad[0, 0] = xp.inf
        results.append((float(loss), amp.step(opt, max_norm=1.0)))
    return model, amp, opt, results


def test_mixed_precision_flat_equals_per_parameter_with_a_skipped_step(xp, calls):
    plain = _amp_run(xp, False, 6, inf_at=2)
    n_calls = dict(calls)
    flat = _amp_run(xp, True, 6, inf_at=2)
    flat_calls = {k: calls[k] - n_calls[k] for k in calls}
    for (loss_a, res_a), (loss_b, res_b) in zip(plain[3], flat[3]):
        assert loss_a == loss_b and res_a.stepped == res_b.stepped and res_a.scale == res_b.scale
        # the norm's float64 sum in another order: within n eps (n ~ 1e4 squares), 2e-12
        if res_a.stepped:
            assert res_a.grad_norm == pytest.approx(res_b.grad_norm, rel=2e-12)
        else:                                                       # the skipped step's norm: not finite
            assert res_a.grad_norm == res_b.grad_norm == float("inf")
    assert [r.stepped for _, r in flat[3]] == [True, True, False, True, True, True]
    assert flat[1].scaler.skipped == 1 and flat[1].scaler.scale == 2.0 ** 15
    _same(plain[0], flat[0])                                        # the float16 model weights
    for a, b in zip(plain[1].parameters(), flat[1].parameters()):   # the float32 masters
        np.testing.assert_array_equal(host(a.data), host(b.data))
    for _, p, m in flat[1]._pairs:                                  # the model is its masters, rounded
        np.testing.assert_array_equal(host(p.data), host(m.data).astype(np.float16))
    # a stepped step: two AdamW runs and one sum of squares (the finite check, whose sum is also the clip's
    # norm); the skipped one: the check
    assert flat_calls["adam_update"] == 5 * 2 and flat_calls["sum_of_squares"] == 6
    assert flat_parameters(flat[0]) is not None and flat[1]._flat.intact()
    for master_buffer in flat[1]._flat.buffers:
        assert master_buffer.mirror is None                         # set for the step only


def test_the_trainers_flatten_their_model_and_step_flat(monkeypatch):
    """The trainers' default: a flattened model, AdamW over whole runs of the buffers (two a step),
    under mixed precision too (its masters flat in the model's layout)."""
    from npformer.training.config import make_config
    from npformer.training.registry import make_trainer
    seen = []
    real = optim_module.adam_update
    monkeypatch.setattr(optim_module, "adam_update", lambda p, *a, **k: (seen.append(p.ndim), real(p, *a, **k))[1])
    for precision in ("float32", "float16"):
        seen.clear()
        trainer = make_trainer(make_config(dict(task="charlm", model="gpt2", d_model=16, heads=2, layers=1,
                                                ff=32, block_size=16, batch_size=4, steps=3,
                                                warmup=1, eval_every=0, precision=precision)), log=lambda _: None)
        trainer.train_step()
        assert flat_parameters(trainer.model) is not None
        assert seen == [1, 1]                                       # two 1-d runs: decayed weights, the rest
        if precision == "float16":
            assert trainer.amp._flat is not None and trainer.amp._flat.intact()


@pytest.mark.parametrize("flat", [False, True], ids=["per-parameter", "flat"])
@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_mixed_precision_steps_as_if_the_gradients_were_unscaled_and_clipped_in_float32(xp, flat, precision):
    """The masters step with the model's 16-bit gradients times c / S: the bits of the float32 copy of the
    gradients divided by S, then clipped (the update as it was before 2026-11-29), which this test makes
    by hand and steps with the same optimiser rules; the norm is the same float too."""
    if precision == "bfloat16":
        pytest.importorskip("ml_dtypes", reason="bfloat16 is ml_dtypes' dtype (the bfloat16 extra)")
    model, amp, opt = _amp_model(xp, flat, precision)
    hand = [Parameter(m.data.copy(), decay=m.decay) for m in amp.parameters()]   # the masters, stepped by hand
    hand_opt = AdamW(hand, lr=1e-2, weight_decay=0.1)
    for step, max_norm in enumerate([0.05, None, 1e6]):             # clipped, not asked, not reached
        _amp_backward(xp, model, amp, step)
        S = amp._scale()
        g32 = [p.grad.astype(xp.float32) * (1.0 / S) for _, p, _ in amp._pairs]   # exact: S a power of two
        norm = math.sqrt(sum(float((g.astype(xp.float64) ** 2).sum()) for g in g32))
        for p, g in zip(hand, g32):
            p.grad = g
        with kernels.disabled():
            if max_norm is not None:
                clip_grad_norm(hand, max_norm)
            hand_opt.step()
        result = amp.step(opt, max_norm=max_norm)
        assert result.stepped and (result.grad_norm is None) == (max_norm is None)
        if max_norm is not None:
            assert result.grad_norm == pytest.approx(norm, rel=1e-12)
        for m, h in zip(amp.parameters(), hand):
            np.testing.assert_array_equal(host(m.data), host(h.data))


def test_mixed_precision_keeps_no_float32_copy_of_the_gradients(xp):
    """The flat masters' gradient buffer is the model's 16-bit one: model weights, model gradients and
    float32 masters are 8 bytes a parameter (AdamW's moments, 8 more, come with its first step)."""
    model, amp, _ = _amp_model(xp, True)
    (master,), (model_buffer,) = amp._flat.buffers, flat_parameters(model).buffers
    assert master.grad is model_buffer.grad and master.grad.dtype == np.float16
    held = {id(a): a.nbytes for b in (master, model_buffer) for a in (b.data, b.grad)}
    assert sum(held.values()) == 8 * master.size
