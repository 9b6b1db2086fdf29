"""The opt-in anomaly mode: off by default (NaN in gives NaN out), and inside npformer.detect_anomaly()
the first op, forward or backward, whose result holds a NaN or a new infinity raises, naming it."""
import numpy as np
import pytest

import npformer
from npformer.errors import NonFiniteError
from npformer.models.gpt import GPT, GPTConfig
from npformer.ops.activations import gelu_backward, gelu_forward
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from npformer.ops.linear import linear_forward
from npformer.ops.softmax import log_softmax_forward, softmax_forward


def _gpt():
    return GPT(GPTConfig(vocab_size=7, block_size=6, n_layer=1, n_head=2, d_model=4, dropout=0.0),
               dtype="float64", rng=0)


def test_off_by_default_nan_in_gives_nan_out():
    model = _gpt()
    model.wte.weight.data[3] = np.nan
    logits = model(np.array([[1, 3, 2]]))
    assert np.isnan(logits).any() and not npformer.dispatch.anomaly_detection_enabled()


def test_a_nan_weight_is_named_at_the_first_op_that_meets_it():
    model = _gpt()
    model.wte.weight.data[3] = np.nan
    with npformer.detect_anomaly(), pytest.raises(NonFiniteError, match=r"embedding_forward returned NaN in "
                                                  r"output 0 .* its inputs already held NaN"):
        model(np.array([[1, 3, 2]]))
    model(np.array([[1, 3, 2]]))                          # off again after the block


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_an_overflow_is_named_at_the_op_that_produced_it():
    x = np.full((2, 3), 300.0, np.float16)
    w = np.full((4, 3), 100.0, np.float16)
    with npformer.detect_anomaly(), pytest.raises(NonFiniteError, match=r"ops\.linear\.linear_forward returned "
                                                  r"an infinity .* this op produced it"):
        linear_forward(x, w)


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_a_gradient_is_checked_too():
    x = np.full((2, 3), 2.0, np.float16)
    _, cache = gelu_forward(x)
    with npformer.detect_anomaly(), pytest.raises(NonFiniteError, match="gelu_backward returned an infinity"):
        gelu_backward(np.full((2, 3), 65000.0, np.float16), cache)   # gelu'(2) = 1.085: 70,500 > 65,504


def test_masking_infinities_are_not_anomalies():
    """-inf in masked scores and in the log-probabilities of masked classes is by design."""
    z = np.array([[0.0, -np.inf, 1.0]])
    with npformer.detect_anomaly():
        p, _ = softmax_forward(z)
        logp, _ = log_softmax_forward(z)
        loss, cache = cross_entropy_forward(np.array([[0.0, 1.0, 2.0]]), np.array([2]))
        cross_entropy_backward(np.ones(()), cache)
        model = _gpt()
        model.backward(cross_entropy_backward(np.ones(()), cross_entropy_forward(
            model(np.array([[1, 2, 3]])), np.array([[2, 3, 4]]))[1]))
    assert np.isneginf(logp[0, 1]) and p[0, 1] == 0
