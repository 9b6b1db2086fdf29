"""Gradient buckets (plan, pack, unpack) and the rank's rows of a global batch, in one process."""
import numpy as np
import pytest

from npformer.distributed import Buckets, plan_buckets, shard_rows, take_shard
from npformer.distributed.buckets import pack, unpack
from npformer.distributed.communicator import Communicator
from npformer.errors import InputTypeError, RangeError


def _arrays():
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s).astype(d) for s, d in
            [((4, 3), np.float32), ((5,), np.float32), ((2, 2), np.float64), ((100,), np.float32), ((3,), np.float32)]]


def test_buckets_keep_order_split_by_dtype_and_size():
    arrays = _arrays()
    plan = plan_buckets(arrays, bucket_bytes=80)
    # 12 + 5 float32 (68 bytes) | 4 float64 | 100 float32 (400 bytes: alone, larger than a bucket) | 3
    assert [b.members for b in plan] == [(0, 1), (2,), (3,), (4,)]
    assert [b.offsets for b in plan] == [(0, 12), (0,), (0,), (0,)]
    assert [(b.dtype, b.size) for b in plan] == [("float32", 17), ("float64", 4), ("float32", 100), ("float32", 3)]
    assert [b.members for b in plan_buckets(arrays)] == [(0, 1), (2,), (3, 4)]      # default 4 MiB


def test_pack_then_unpack_round_trips_and_scales():
    arrays = _arrays()
    copies = [a.copy() for a in arrays]
    for bucket in plan_buckets(arrays, bucket_bytes=80):
        flat = np.empty(bucket.size, dtype=bucket.dtype)
        pack(bucket, arrays, flat, scale=0.5)
        assert flat[:arrays[bucket.members[0]].size].tolist() == (
            0.5 * arrays[bucket.members[0]].reshape(-1)).tolist()
        unpack(bucket, flat, arrays)
    for a, c in zip(arrays, copies):
        np.testing.assert_array_equal(a, 0.5 * c)


def test_buckets_refuse_arrays_they_were_not_planned_for():
    arrays = _arrays()
    buckets = Buckets(arrays)
    assert buckets.nbytes == sum(a.nbytes for a in arrays)
    with pytest.raises(InputTypeError, match="buckets planned for 5 arrays got 4"):
        buckets.all_reduce(None, arrays[:4])


def test_the_ranks_shards_joined_are_the_global_batch():
    x, y = np.arange(24).reshape(8, 3), np.arange(8)
    shards = [take_shard((x, y), r, 4) for r in range(4)]
    np.testing.assert_array_equal(np.concatenate([s[0] for s in shards]), x)
    np.testing.assert_array_equal(np.concatenate([s[1] for s in shards]), y)
    assert shard_rows(8, 3, 4) == slice(6, 8)


def test_a_batch_the_ranks_do_not_divide_is_refused():
    with pytest.raises(RangeError, match=r"batch size \(--batch-size\) 10 is not divisible by the 4 ranks.*"
                                         "give a multiple of 4, such as 8"):
        shard_rows(10, 0, 4)
    with pytest.raises(RangeError, match="rank: expected 0 .. 3 for 4 ranks, got 4"):
        shard_rows(8, 4, 4)


class _Recording(Communicator):
    """One rank that records the arrays handed to all_reduce (the sum over one rank is the array)."""
    rank, size, backend = 0, 1, "numpy"

    def __init__(self):
        self.reduced = []

    def all_reduce(self, array, op="sum"):
        self.reduced.append(array)
        return array

    def broadcast(self, array, root=0):
        return array

    def barrier(self):
        pass


@pytest.mark.parametrize("flatten", [True, False])
def test_a_flattened_model_s_gradients_are_reduced_in_its_buffer_without_packing(flatten):
    from npformer.distributed import DataParallel
    from npformer.models import GPT, GPTConfig
    from npformer.nn.flat import flat_gradients, flatten_parameters
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, d_model=8, dropout=0.0), rng=0)
    if flatten:
        flatten_parameters(model)
    comm = _Recording()
    dp = DataParallel(model, comm, bucket_bytes=256)
    logits = model(np.arange(16).reshape(2, 8) % 11)
    model.backward(np.ones_like(logits))
    before = {n: p.grad.copy() for n, p in model.named_parameters()}
    comm.reduced.clear()
    dp.reduce_gradients(1.0, 16)                        # one rank: the weight is 1, the gradients stay
    for n, p in model.named_parameters():
        np.testing.assert_array_equal(p.grad, before[n], err_msg=n)
    buffers = [buf for _, buf in flat_gradients(model)]
    grads = comm.reduced[1:]                            # after the step's five float64 numbers
    in_buffer = [any(np.shares_memory(a, buf) for buf in buffers) for a in grads]
    assert grads and (all(in_buffer) if flatten else not any(in_buffer))
    if flatten:                                         # slices of the buffer, each at most bucket_bytes
        assert all(a.nbytes <= 256 for a in grads) and sum(a.size for a in grads) == sum(b.size for b in buffers)
    assert (dp._grad_buckets == {}) == flatten          # buckets are planned only for a model not flattened
