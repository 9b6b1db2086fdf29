"""The recall task: its labels (a copy from period - 1 back, fresh before that), the fixed split,
the loss floor, and bad arguments."""
import math

import numpy as np
import pytest

from npformer.data.long_range import RecallTask


def test_labels_repeat_the_token_period_minus_one_back():
    task = RecallTask(period=5, length=17, n_symbols=4, n_train=30, n_valid=10, seed=3)
    for split in ("train", "valid"):
        x, y = task.inputs_targets(split)
        assert x.shape == y.shape == (len(task.split(split)), 17) and x.dtype == np.int64
        np.testing.assert_array_equal(y[:, :-1], x[:, 1:])                 # y is x shifted by one
        for t in range(17):
            if t + 1 >= 5:
                np.testing.assert_array_equal(y[:, t], x[:, t + 1 - 5])    # recallable: period - 1 back
        assert x.min() >= 0 and x.max() < 4
    np.testing.assert_array_equal(task.recallable(), np.arange(1, 18) >= 5)
    assert task.recallable().sum() == 17 - 4


def test_the_first_block_is_uniform_and_fresh():
    task = RecallTask(period=6, length=6, n_symbols=5, n_train=4000, n_valid=10, seed=0)
    first = task.train[:, :6]                                              # the block itself
    freq = np.bincount(first.ravel(), minlength=5) / first.size
    np.testing.assert_allclose(freq, 0.2, atol=0.01)
    # neighbours in the block are independent draws: a token repeats its predecessor 1/5 of the time
    assert abs((first[:, 1:] == first[:, :-1]).mean() - 0.2) < 0.01


def test_split_is_fixed_seeded_and_disjoint():
    a = RecallTask(period=8, length=20, n_train=50, n_valid=20, seed=1)
    b = RecallTask(period=8, length=20, n_train=80, n_valid=20, seed=1)
    np.testing.assert_array_equal(a.valid, b.valid)                        # more training leaves valid alone
    np.testing.assert_array_equal(a.train, b.train[:50])
    blocks = {r.tobytes() for r in np.concatenate([b.train, b.valid])[:, :8]}
    assert len(blocks) == 100                                              # every block distinct
    assert not np.array_equal(a.valid, RecallTask(period=8, length=20, n_train=50, n_valid=20, seed=2).valid)
    with pytest.raises(ValueError, match="read-only"):
        a.train[0, 0] = 1


def test_floor_loss_and_rows():
    task = RecallTask(period=4, length=12, n_symbols=8, n_train=5, n_valid=3)
    assert task.floor_loss() == pytest.approx(3 / 12 * math.log(8))
    x, y = task.inputs_targets("train", rows=[2, 0])
    np.testing.assert_array_equal(x, task.train[[2, 0], :-1])
    x[...] = 0                                                             # a copy: the task is unchanged
    assert task.train.any()


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"length \+ 1 = 4 must exceed period = 4"):
        RecallTask(period=4, length=3)
    with pytest.raises(ValueError, match="period: expected an int >= 2"):
        RecallTask(period=1, length=3)
    with pytest.raises(TypeError, match="n_symbols: expected an int, got float"):
        RecallTask(period=3, length=8, n_symbols=2.0)
    with pytest.raises(ValueError, match="distinct blocks cannot be drawn from 2"):
        RecallTask(period=3, length=8, n_symbols=2, n_train=4, n_valid=1)
    with pytest.raises(ValueError, match="split must be one of"):
        RecallTask(period=3, length=8, n_train=10, n_valid=5).split("test")
