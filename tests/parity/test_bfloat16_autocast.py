"""A bfloat16 GPT step on NumPy (MixedPrecision: a bfloat16 model, float32 masters, no loss scaler)
against PyTorch's ``torch.autocast("cpu", dtype=torch.bfloat16)`` step of the same GPT-2 (pre-norm,
tanh GELU, tied head; built here from torch.nn layers, which share npformer's parameter names): the
loss and every parameter's gradient within bfloat16's rounding, the two float32 steps first agreeing
to float32's.

The bound. Each bfloat16 rounding perturbs a tensor by at most u = 2^-8 of it (``ml_dtypes.finfo``'s
eps / 2), uniformly distributed in practice (variance u^2 / 3). npformer rounds every activation,
PyTorch's autocast those of its bfloat16 ops; on the longest path of this 2-layer model (a gradient of
the first layer) there are R = 50 of them: 11 a layer forward (norm1, q/k/v, P, the heads, out_proj,
the residual, norm2, linear1, GELU, linear2, the residual), the embeddings' sum, ln_f and the logits,
and as many back. Independent roundings add in quadrature, so each step's normwise relative error is
about u sqrt(R / 3), the difference of the two sqrt(2) times that, and the bound is twice that:

    ||npformer - torch|| / ||torch|| <= 2 sqrt(2 R / 3) u  (11.5 u = 0.045)

for the loss and each gradient (measured over two seeds: 0.04 u for the loss, 1.1 to 6.0 u for the
gradients; each step's own distance from float32: npformer's up to 4.1 u, PyTorch's 3.2 u). A wrong
term in a backward moves a gradient by its own size, far beyond it.
"""
import math

import numpy as np
import pytest

from tests.helpers import NO_TORCH

torch = pytest.importorskip("torch", reason=NO_TORCH)
pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes (pip install 'npformer[bfloat16]')")
F = torch.nn.functional

from npformer.models.gpt import GPT, GPTConfig  # noqa: E402
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward  # noqa: E402
from npformer.training.amp import MixedPrecision  # noqa: E402

pytestmark = pytest.mark.torch
V, T, B, C, H, L = 40, 16, 4, 32, 2, 2
CONFIG = GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, d_model=C, dropout=0.0)
U = 2.0 ** -8
ROUNDINGS = 50
BOUND = 2 * math.sqrt(2 * ROUNDINGS / 3) * U
FLOAT32_BOUND = 1e-5                     # the float32 steps: the same math, another order of additions


class TorchGPT(torch.nn.Module):
    """npformer's GPT in torch.nn layers: wte + wpe, pre-norm encoder layers with a causal mask, ln_f,
    the head tied to wte. Parameter names are npformer's (but the tied head.weight)."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(V, C), torch.nn.Embedding(T, C)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(C, H, 4 * C, 0.0, activation=lambda x: F.gelu(x, approximate="tanh"),
                                             batch_first=True, norm_first=True) for _ in range(L))
        self.ln_f = torch.nn.LayerNorm(C)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(t)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return F.linear(self.ln_f(x), self.wte.weight)


def weights(seed):
    """GPT's initialisation, every tensor moved by N(0, 0.1^2) (biases and gains are not 0 and 1)."""
    sd = GPT(CONFIG, rng=seed).state_dict()
    r = np.random.default_rng(seed)
    sd = {k: v + (0.1 * r.standard_normal(v.shape)).astype(np.float32) for k, v in sd.items()}
    sd["head.weight"] = sd["wte.weight"]                                   # tied
    return sd


def npformer_step(sd, x, y, precision):
    model = GPT(CONFIG, rng=0).load_state_dict(sd)
    amp = MixedPrecision(model, precision) if precision else None
    logits = model(x)                                                      # (B, T, V)
    loss, cache = cross_entropy_forward(logits.astype(np.float32), y)
    dloss = amp.scaled_dloss() if amp else np.ones((), np.float32)
    model.backward(cross_entropy_backward(dloss, cache).astype(logits.dtype))
    return float(loss), {n: p.grad.astype(np.float32) for n, p in model.named_parameters() if n != "head.weight"}


def torch_step(sd, x, y, autocast):
    model = TorchGPT()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items() if k != "head.weight"}, strict=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(torch.from_numpy(x))
    loss = F.cross_entropy(logits.float().reshape(-1, V), torch.from_numpy(y).reshape(-1))
    loss.backward()
    return float(loss.detach()), {n: p.grad.numpy() for n, p in model.named_parameters()}


def relative(a, b):
    return float(np.linalg.norm(np.subtract(a, b)) / np.linalg.norm(b))


@pytest.mark.parametrize("seed", [0, 1])
def test_bfloat16_gpt_step_matches_torch_autocast_bfloat16_within_its_rounding(seed):
    sd = weights(seed)
    r = np.random.default_rng(seed + 10)
    x, y = r.integers(0, V, (B, T)), r.integers(0, V, (B, T))
    for precision, autocast, bound in ((None, False, FLOAT32_BOUND), ("bfloat16", True, BOUND)):
        loss, grads = npformer_step(sd, x, y, precision)
        their_loss, theirs = torch_step(sd, x, y, autocast)
        assert set(grads) == set(theirs)
        assert abs(loss - their_loss) <= bound * abs(their_loss), (precision, loss, their_loss, bound)
        worst = max(grads, key=lambda n: relative(grads[n], theirs[n]))
        assert relative(grads[worst], theirs[worst]) <= bound, (
            f"{precision or 'float32'}: {worst} differs from torch's by {relative(grads[worst], theirs[worst]):.3g} "
            f"of its norm, bound {bound:.3g}")


def test_the_bound_is_bfloat16s_rounding_over_the_path():
    """11.5 u, from ml_dtypes' eps: a gradient off by a tenth of itself is outside it."""
    import ml_dtypes                                     # (the module skips without it)
    assert U == float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps) / 2
    assert 11 * U < BOUND < 12 * U and BOUND < 0.1
