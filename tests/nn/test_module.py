"""Module base: registration, names, state dicts, accumulation, the per-call cache stack, no_grad."""
import numpy as np
import pytest

from npformer import nn
from npformer.errors import CallOrderError, InputTypeError, RangeError
from npformer.nn import Linear, Module, ModuleList, Parameter, StateDictError, no_grad


class Pair(Module):
    def __init__(self):
        super().__init__()
        self.a = Linear(3, 4, rng=0, dtype="float64")
        self.b = Linear(4, 2, bias=False, rng=1, dtype="float64")

    def forward(self, x):
        return self.b(self.a(x))

    def backward(self, d):
        return self.a.backward(self.b.backward(d))


def test_names_follow_attribute_paths_as_in_pytorch():
    m = Pair()
    assert [n for n, _ in m.named_parameters()] == ["a.weight", "a.bias", "b.weight"]
    assert list(m.state_dict()) == ["a.weight", "a.bias", "b.weight"]
    lst = ModuleList([Linear(2, 2, rng=0), Linear(2, 2, rng=1)])
    assert [n for n, _ in lst.named_parameters()] == ["0.weight", "0.bias", "1.weight", "1.bias"]


def test_load_state_dict_round_trip_and_errors():
    m, other = Pair(), Pair()
    other.load_state_dict({k: v * 2 for k, v in m.state_dict().items()})
    np.testing.assert_array_equal(other.a.weight.data, m.a.weight.data * 2)
    before = other.a.weight.data.copy()
    with pytest.raises(StateDictError, match=r"missing keys: \['b.weight'\]"):
        other.load_state_dict({"a.weight": np.zeros((4, 3)), "a.bias": np.zeros(4)})
    with pytest.raises(StateDictError, match=r"unexpected keys: \['c'\]"):
        other.load_state_dict({**m.state_dict(), "c": np.zeros(1)})
    with pytest.raises(StateDictError, match=r"a.weight: expected shape \(4, 3\), got \(3, 4\)"):
        other.load_state_dict({**m.state_dict(), "a.weight": np.zeros((3, 4))})
    np.testing.assert_array_equal(other.a.weight.data, before)     # nothing written on failure
    other.load_state_dict({"a.weight": np.zeros((4, 3))}, strict=False)
    assert not other.a.weight.data.any()



def test_load_state_dict_refuses_values_its_dtypes_cannot_hold():
    # Found by fuzzing: 1e39 became inf in a float32 weight (a numpy RuntimeWarning only), a complex
    # value lost its imaginary part, and strings, ragged lists and dicts raised numpy's own errors.
    lin = Linear(2, 2, rng=0)
    before = lin.weight.data.copy()
    cases = [({"weight": np.full((2, 2), 1e39), "bias": np.zeros(2)},
              r"weight: 4 of 4 values \(float64\) cannot be held by the parameter's dtype float32 "
              r"\(e.g. 1e\+39 would become inf\)"),
             ({"weight": np.ones((2, 2)) * (1 + 1j), "bias": np.array(["a", "b"])},
              r"weight: not a real numeric array \(dtype complex128\); bias: not a real numeric array \(dtype <U1\)"),
             ({"weight": [[1.0, 2.0], [3.0]], "bias": {"a": 1}},
              r"weight: not a real numeric array \(list.*; bias: not a real numeric array \(dtype object\)"),
             ({"weight": np.full((2, 2), np.nan), "bias": np.array([2**25 + 1, 0])},
              r"weight: not finite \(4 NaN or infinite values of 4\); bias: 1 of 2 values \(int64\) cannot "
              r"be held .* \(e.g. 33554433 would become 33554432.0\)")]
    for state, message in cases:
        with pytest.raises(StateDictError, match=message):
            lin.load_state_dict(state)
        np.testing.assert_array_equal(lin.weight.data, before)     # nothing written on failure
    lin.load_state_dict({"weight": np.ones((2, 2), np.int32), "bias": np.array([True, False])})
    np.testing.assert_array_equal(lin.bias.data, [1.0, 0.0])       # exact ints and bools load
    lin.load_state_dict({"weight": np.full((2, 2), 1e-3), "bias": np.zeros(2)})
    assert lin.weight.data.dtype == np.float32                     # a float rounds to a narrower one
    lin.load_state_dict({"weight": np.full((2, 2), np.inf), "bias": np.zeros(2)}, allow_nonfinite=True)
    assert np.isinf(lin.weight.data).all()

def test_gradients_accumulate_over_calls_and_zero_grad_resets():
    m = Pair()
    x = np.random.default_rng(0).standard_normal((5, 3))
    d = np.random.default_rng(1).standard_normal((5, 2))
    m(x)
    m.backward(d)
    once = m.a.weight.grad.copy()
    m(x)
    m(x)
    m.backward(d)
    m.backward(d)
    np.testing.assert_allclose(m.a.weight.grad, 3 * once, rtol=1e-14)
    m.zero_grad()
    assert all(p.grad is None for p in m.parameters())


def test_backward_without_forward_is_a_clear_error_and_no_grad_saves_nothing():
    m = Pair()
    with pytest.raises(CallOrderError, match="backward called more times than forward") as info:
        m.backward(np.zeros((1, 2)))
    assert isinstance(info.value, RuntimeError)          # what callers caught before
    with no_grad():
        m(np.zeros((2, 3)))
    assert all(len(mod._saved) == 0 for mod in m.modules())


def test_no_grad_is_per_thread_and_restored_on_errors():
    """One thread evaluating under no_grad leaves another thread's forward keeping its caches (the
    fast-path switch of npformer.dispatch is per thread too), and an exception inside restores it."""
    import threading
    from npformer.nn import is_grad_enabled
    inside, go_on, seen = threading.Event(), threading.Event(), {}

    def evaluate():
        with no_grad():
            inside.set()
            go_on.wait(10)
            seen["evaluator"] = is_grad_enabled()
    t = threading.Thread(target=evaluate)
    t.start()
    assert inside.wait(10)
    m = Pair()
    m(np.zeros((2, 3)))                                   # while the other thread is inside no_grad
    seen["trainer"] = is_grad_enabled()
    go_on.set()
    t.join(10)
    assert seen == {"evaluator": False, "trainer": True} and any(mod._saved for mod in m.modules())
    with pytest.raises(ZeroDivisionError):
        with no_grad():
            1 / 0
    assert is_grad_enabled()


def test_shared_parameter_gets_the_sum_of_its_uses():
    """A parameter used by two modules gets the sum of both contributions (what tying relies on)."""
    shared = Linear(3, 3, rng=0, dtype="float64")
    m = Module()
    m.first, m.second = shared, Linear(3, 3, rng=1, dtype="float64")
    m.second.weight = shared.weight                       # tie
    assert len(list(m.named_parameters())) == 3          # listed once
    assert "second.weight" in m.state_dict()             # but every name is in the state dict
    x = np.random.default_rng(2).standard_normal((4, 3))
    d = np.random.default_rng(3).standard_normal((4, 3))
    h = m.first(x)
    m.second(h)
    m.first.backward(m.second.backward(d))
    # the same computation with an untied copy: the shared gradient is the sum over the two uses
    a, b = Linear(3, 3, rng=0, dtype="float64"), Linear(3, 3, rng=1, dtype="float64")
    b.weight.data = a.weight.data.copy()
    b(a(x))
    a.backward(b.backward(d))
    np.testing.assert_allclose(shared.weight.grad, a.weight.grad + b.weight.grad, rtol=1e-13)


def test_to_casts_parameters_and_train_eval_propagate():
    m = Pair().to(dtype="float32")
    assert all(p.dtype == np.float32 for p in m.parameters())
    m.eval()
    assert not any(mod.training for mod in m.modules())
    m.train()
    assert all(mod.training for mod in m.modules())


def test_parameters_and_modes_must_be_of_their_types():
    """register_parameter set an array as a plain attribute (left out of state_dict, never trained);
    Parameter of a list or a string failed later with an AttributeError; train("False") trained."""
    m = Linear(2, 2, rng=0)
    with pytest.raises(InputTypeError, match="register_parameter 'w': expected a Parameter or None, got numpy "
                                             "float64 array of shape \\(2,\\); wrap an array as Parameter"):
        m.register_parameter("w", np.zeros(2))
    assert not hasattr(m, "w") and list(m.state_dict()) == ["weight", "bias"]
    m.register_parameter("w", Parameter(np.zeros(2)))
    m.register_parameter("bias", None)
    assert list(m.state_dict()) == ["weight", "w"]
    for bad, shown in [([1.0, 2.0], "list"), ("abc", "str"), (np.zeros(2, np.int64), "numpy int64 array"),
                       (np.float32(1.0), "the NumPy scalar")]:
        with pytest.raises(InputTypeError, match=f"Parameter data: expected a .*, got {shown}"):
            Parameter(bad)
    for bad in ("False", 0, None):
        with pytest.raises(InputTypeError, match="mode: expected true or false, got"):
            m.train(bad)
    assert m.training is True and m.eval().training is False and m.train().training is True


def test_parameter_accumulate_checks_shape():
    p = Parameter(np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"gradient of shape \(3, 2\) for a parameter of shape \(2, 3\)"):
        p.accumulate(np.zeros((3, 2)))


def test_a_seeded_model_draws_the_same_dropout_masks_whatever_else_runs():
    """Generators are owned: a model built with rng=0 draws its own stream, not a process-wide one."""
    from npformer.models.gpt import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=8, dropout=0.5)
    idx = np.array([[1, 2, 3, 4, 5]])
    alone = GPT(cfg, rng=0, dtype="float64")
    ref = [alone(idx) for _ in range(3)]
    busy, other = GPT(cfg, rng=0, dtype="float64"), GPT(cfg, rng=1, dtype="float64")
    got = []
    for _ in range(3):
        other(idx)                                       # another model draws in between
        nn.Dropout(0.5)(np.ones(7))                      # and a module nobody seeded
        got.append(busy(idx))
    for r, g in zip(ref, got):
        np.testing.assert_array_equal(r, g)
    assert not np.array_equal(ref[0], ref[1])            # the stream moves on from call to call
    busy.manual_seed(5)
    first = busy(idx)
    busy.manual_seed(5)
    np.testing.assert_array_equal(first, busy(idx))      # reseeding restarts it


def test_manual_seed_takes_an_int_ints_or_none_and_refuses_the_rest():
    """-1, "a" and 1.5 were taken, and the next dropout forward raised NumPy's own errors."""
    d = nn.Dropout(0.5)
    for bad, error, message in [(-1, RangeError, "seed: expected an int >= 0, got -1"),
                                ("a", InputTypeError, "seed: expected an int >= 0, a sequence of them such as "
                                                      "\\(seed, step\\), or None \\(OS entropy\\), got str 'a'"),
                                (1.5, InputTypeError, "seed: expected an int >= 0, a sequence"),
                                (True, InputTypeError, "seed: expected an int >= 0, a sequence"),
                                ((3, -2), RangeError, "seed\\[1\\]: expected an int >= 0, got -2"),
                                ((3, None), InputTypeError, "seed\\[1\\]: expected an int, got None")]:
        with pytest.raises(error, match=message):
            d.manual_seed(bad)
    for good in (0, np.int64(7), (7, 3), [7, 3, 1], None):
        assert d.manual_seed(good)(np.ones((2, 3))).shape == (2, 3)


def test_the_layers_of_an_encoder_share_one_stream_not_equal_copies():
    layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.5, rng=0)
    encoder = nn.TransformerEncoder(layer, 2)
    streams = {id(m.random_stream) for m in encoder.modules()}
    assert len(streams) == 1 and encoder.layers[0].random_stream is layer.random_stream


def test_stream_seed_leaves_the_weights_stream_alone():
    from npformer.nn import init
    a, b = np.random.default_rng(3), np.random.default_rng(3)
    s1, s2 = init.stream_seed(a), init.stream_seed(a)
    assert s1 != s2 and isinstance(s1, int)              # spawned children differ
    np.testing.assert_array_equal(a.standard_normal(4), b.standard_normal(4))
    assert init.stream_seed(7) == init.stream_seed(7) and init.stream_seed(None) is None


def test_calling_a_module_calls_its_forward_as_plain_python_does():
    """``module(x)`` is ``Module.__call__`` calling ``self.forward`` (PyTorch's shape, without hooks):
    a forward assigned to one instance is found first, as any attribute is, until it is deleted; the
    instance keeps its class, and the module pickles and deep-copies as any object."""
    import copy
    import pickle
    lin, other = Linear(3, 2, rng=0), Linear(3, 2, rng=1)
    x = np.ones((1, 3), np.float32)
    assert "__call__" not in Linear.__dict__ and Linear.__call__ is Module.__call__
    seen = []
    lin.forward = lambda x: seen.append(x.shape) or "patched"
    assert lin(x) == "patched" and seen == [(1, 3)]
    assert type(lin) is Linear and list(lin.state_dict()) == ["weight", "bias"]
    assert other(x).shape == (1, 2)                     # other instances keep the class's forward
    del lin.forward
    assert type(lin) is Linear and lin(x).shape == (1, 2)
    for twin in (pickle.loads(pickle.dumps(lin)), copy.deepcopy(lin)):
        assert type(twin) is Linear
        np.testing.assert_array_equal(twin(x), lin(x))
