"""ALBERT: whole-model float64 gradient checks for every sharing mode with and without the factorised
embedding; shared gradients against the sum over an unshared copy's layers; BERT as the special case;
parameter counts against the closed form."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.models.albert import SHARE_MODES, ALBERT, ALBERTConfig, parameter_count
from npformer.models.bert import BERT, BERTConfig
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from npformer.tools.gradcheck import gradcheck_module
from npformer.training.optim import AdamW
from tests.helpers import assert_gradcheck, host, randn, seeds

PAD, IGNORE = 0, -100


def _ids(xp, shape, vocab, seed, pad_tail=0):
    a = np.random.default_rng(seed).integers(1, vocab, size=shape)
    if pad_tail:
        a[-1, -pad_tail:] = PAD
    return xp.asarray(a)


def _config(share, e, h, heads, layers, mlm, dropout=0.1, vocab=9):
    return ALBERTConfig(vocab_size=vocab, embedding_size=e, hidden_size=h, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=h + 2, max_position_embeddings=8,
                        dropout=dropout, share=share, mlm_head=mlm)


def _mixed_loss(xp, ids, t, h, seed, mlm):
    """A scalar using every output: weighted hidden and pooled sums, and the masked-LM cross-entropy
    on a few positions (the others ignored). Padded positions are left out: the padding row of the
    word table gets no gradient by definition."""
    keep = (ids != PAD)[..., None].astype(xp.float64)                              # (B, T, 1)
    w_h, w_p = randn(xp, (2, t, h), seed + 3) * keep, randn(xp, (2, h), seed + 4)
    targets = np.where(np.random.default_rng(seed + 5).random((2, t)) < 0.5, host(ids), IGNORE)
    targets[0, 0] = host(ids)[0, 0]                                                # at least one
    targets = xp.asarray(np.where(host(ids) == PAD, IGNORE, targets))
    saved = {}

    def forward(m, ids):
        hidden, pooled = m(ids)
        total = (hidden * w_h).sum() + (pooled * w_p).sum()
        if mlm:
            loss, saved["ce"] = cross_entropy_forward(m.mlm_logits(hidden), targets, ignore_index=IGNORE)
            total = total + loss
        return total

    def backward(m, d):
        dml = cross_entropy_backward(d, saved["ce"]) if mlm else None
        m.backward(dhidden=w_h * d, dpooled=w_p * d, dmlm_logits=dml)
        return ()
    return forward, backward


@pytest.mark.parametrize("factorised", [True, False], ids=["factorised", "unfactorised"])
@pytest.mark.parametrize("share", SHARE_MODES)
@given(seed=seeds, heads=st.integers(1, 2), hs=st.integers(2, 3), layers=st.integers(1, 3),
       t=st.integers(2, 5), e=st.integers(2, 5), mlm=st.booleans())
def test_albert_gradcheck(xp, share, factorised, seed, heads, hs, layers, t, e, mlm):
    h = heads * hs
    cfg = _config(share, e if factorised else None, h, heads, layers, mlm)
    model = ALBERT(cfg, dtype="float64", backend=xp.__name__, rng=seed)
    rng = np.random.default_rng(seed)
    # tables N(0, 1): at std 0.02 the LayerNorm right after them bends on a 1e-3 scale, where
    # eps = 1e-4 is not small (see tests/models/test_models.py)
    for name, p in model.named_parameters():
        if name.startswith("embeddings.") and "LayerNorm" not in name:
            p.data = xp.asarray(rng.standard_normal(p.shape))
    ids = _ids(xp, (2, t), 9, seed, pad_tail=1)
    fwd, bwd = _mixed_loss(xp, ids, t, h, seed, mlm)
    report = gradcheck_module(model, {"ids": ids}, forward=fwd, backward=bwd, dropout_seed=seed,
                              seed=seed, mode="direction")
    assert_gradcheck(report)


def _forward_backward(model, ids, dh, dp, dl, seed):
    model.manual_seed(seed)
    model.zero_grad()
    hidden, pooled = model(ids)
    logits = model.mlm_logits(hidden)
    model.backward(dhidden=dh, dpooled=dp, dmlm_logits=dl)
    return hidden, pooled, logits


@pytest.mark.parametrize("factorised", [True, False], ids=["factorised", "unfactorised"])
@pytest.mark.parametrize("share", ["all", "attention", "ffn"])
def test_shared_gradient_is_the_sum_over_an_unshared_copy(xp, share, factorised):
    layers, h, t = 3, 6, 5
    shared = ALBERT(_config(share, 4 if factorised else None, h, 2, layers, mlm=True),
                    dtype="float64", backend=xp.__name__, rng=1)
    unshared = ALBERT(_config("none", 4 if factorised else None, h, 2, layers, mlm=True),
                      dtype="float64", backend=xp.__name__, rng=2)
    unshared.load_state_dict(shared.state_dict())     # the shared weights copied into every layer
    ids = _ids(xp, (2, t), 9, 3, pad_tail=1)
    dh, dp, dl = randn(xp, (2, t, h), 4), randn(xp, (2, h), 5), randn(xp, (2, t, 9), 6)
    out_s = _forward_backward(shared, ids, dh, dp, dl, seed=7)       # dropout on, same masks
    out_u = _forward_backward(unshared, ids, dh, dp, dl, seed=7)
    for a, b in zip(out_s, out_u):
        np.testing.assert_array_equal(host(a), host(b))
    g_u = unshared.grads()
    every_name = list(shared.named_parameters(remove_duplicate=False))
    n_shared = 0
    for name, g in shared.grads().items():
        p = _param(shared, name)
        uses = [n for n, q in every_name if q is p and n.startswith("layers.")] or [name]   # each layer's name
        assert len(uses) in (1, layers)
        n_shared += len(uses) == layers
        expected = sum(host(g_u[u]) for u in reversed(uses))     # the order backward adds them
        np.testing.assert_allclose(host(g), expected, rtol=1e-12, atol=1e-15, err_msg=name)
    want = {"all": 12, "attention": 4, "ffn": 4}[share]  # weights and biases of the shared modules
    assert n_shared == want


def _param(model, dotted):
    return dict(model.named_parameters(remove_duplicate=False))[dotted]


def test_sharing_is_one_object_used_by_every_layer():
    for share, parts in [("all", None), ("attention", ["self_attn"]), ("ffn", ["linear1", "linear2"])]:
        m = ALBERT(_config(share, 4, 6, 2, 4, mlm=False), rng=0)
        for i in range(1, 4):
            if parts is None:
                assert m.layers[i] is m.layers[0]
            else:
                for part in parts:
                    assert getattr(m.layers[i], part) is getattr(m.layers[0], part)
                other = {"self_attn", "linear1", "linear2"} - set(parts)
                for part in other | {"norm1", "norm2"}:
                    assert getattr(m.layers[i], part) is not getattr(m.layers[0], part)
        names = [n for n, _ in m.named_parameters()]
        assert len(names) == len(set(id(p) for p in m.parameters()))
        assert all(n.startswith("layers.0.") for n in names if ".self_attn." in n) == (share != "ffn")
        # the state dict names every use, as PyTorch's; loading it back is consistent
        assert "layers.3.self_attn.in_proj_weight" in m.state_dict()
        m.load_state_dict(m.state_dict())


def test_adamw_updates_a_shared_weight_once_with_the_summed_gradient():
    m = ALBERT(_config("all", 4, 6, 2, 3, mlm=False, dropout=0.0), dtype="float64", rng=0)
    opt = AdamW(m.named_parameters(), lr=1e-2, weight_decay=0.0)
    ids = _ids(np, (2, 4), 9, 1)
    w = m.layers[0].linear1.weight
    before = w.data.copy()
    hidden, pooled = m(ids)
    m.backward(dhidden=randn(np, hidden.shape, 2), dpooled=randn(np, pooled.shape, 3))
    g = w.grad.copy()
    opt.step()
    # Adam's first step moves every element by lr * sign(g) (|g| >> eps): once, not L times
    np.testing.assert_allclose(w.data - before, -1e-2 * np.sign(g), rtol=1e-6, atol=1e-12)
    assert m.layers[2].linear1.weight is w


def test_unfactorised_unshared_albert_is_bert(xp):
    cfg = _config("none", None, 8, 2, 2, mlm=True)
    albert = ALBERT(cfg, dtype="float64", backend=xp.__name__, rng=0)
    bert = BERT(cfg.as_bert(), dtype="float64", backend=xp.__name__, rng=1)
    assert list(albert.state_dict()) == list(bert.state_dict())      # same names, same order
    bert.load_state_dict(albert.state_dict())
    ids = _ids(xp, (2, 6), 9, 3, pad_tail=2)
    dh, dp, dl = randn(xp, (2, 6, 8), 4), randn(xp, (2, 8), 5), randn(xp, (2, 6, 9), 6)
    for a, b in zip(_forward_backward(albert, ids, dh, dp, dl, 1), _forward_backward(bert, ids, dh, dp, dl, 1)):
        np.testing.assert_array_equal(host(a), host(b))
    gb = bert.grads()          # equal up to the order the three outputs' gradients are added in
    for name, g in albert.grads().items():
        np.testing.assert_allclose(host(g), host(gb[name]), rtol=1e-12, atol=1e-13, err_msg=name)


def _closed_form(v, p, s, e, h, f, n, share, factorised, mlm):
    """Written out here independently of parameter_count, layer by layer."""
    emb_dim = e if factorised else h
    total = v * emb_dim + p * emb_dim + s * emb_dim + 2 * emb_dim         # tables + their LayerNorm
    total += (emb_dim * h + h) if factorised else 0                       # E -> H mapping
    attention = 3 * h * h + 3 * h + h * h + h                             # in_proj, out_proj
    ffn = h * f + f + f * h + h                                           # linear1, linear2
    norms = 2 * (h + h)                                                   # norm1, norm2
    for layer in range(n):
        first = layer == 0
        total += attention if first or share not in ("all", "attention") else 0
        total += ffn if first or share not in ("all", "ffn") else 0
        total += norms if first or share != "all" else 0
    total += h * h + h                                                    # pooler
    if mlm:
        total += h * emb_dim + emb_dim + 2 * emb_dim + v                  # dense, LayerNorm, decoder bias
    return total


@given(v=st.integers(5, 40), e=st.integers(1, 9), heads=st.integers(1, 3), hs=st.integers(1, 4),
       f=st.integers(1, 20), n=st.integers(1, 5), share=st.sampled_from(SHARE_MODES),
       factorised=st.booleans(), mlm=st.booleans())
def test_parameter_counts_equal_the_closed_form(v, e, heads, hs, f, n, share, factorised, mlm):
    h = heads * hs
    cfg = ALBERTConfig(vocab_size=v, embedding_size=e if factorised else None, hidden_size=h,
                       num_hidden_layers=n, num_attention_heads=heads, intermediate_size=f,
                       max_position_embeddings=12, share=share, mlm_head=mlm)
    want = _closed_form(v, 12, 2, e, h, f, n, share, factorised, mlm)
    assert ALBERT(cfg, rng=0).num_parameters() == want == parameter_count(cfg)["total"]
    bert_cfg = cfg.as_bert()
    want_bert = _closed_form(v, 12, 2, h, h, f, n, "none", False, mlm)
    assert BERT(bert_cfg, rng=0).num_parameters() == want_bert == parameter_count(bert_cfg)["total"]
    if share == "all" and n > 1:
        assert want < want_bert


def test_albert_base_has_about_twelve_million_parameters():
    # ALBERT-base (Lan et al. 2019, Table 1: 12M): V=30000, E=128, H=768, L=12, all shared
    cfg = ALBERTConfig(vocab_size=30000, embedding_size=128, hidden_size=768, num_hidden_layers=12,
                       num_attention_heads=12, intermediate_size=3072, share="all")
    assert 11.5e6 < parameter_count(cfg)["total"] < 12.5e6
    assert 108e6 < parameter_count(cfg.as_bert())["total"] < 110e6    # BERT-base: 108M (Table 1)


def test_float32_in_float32_out_and_dropout_off_in_eval(xp):
    m = ALBERT(_config("attention", 4, 6, 2, 2, mlm=True), backend=xp.__name__, rng=0)
    ids = _ids(xp, (2, 5), 9, 1)
    m.eval()
    h1, p1 = m(ids)
    h2, _ = m(ids)
    m.clear_saved()
    assert h1.dtype == p1.dtype == m.mlm_logits(h1).dtype == xp.float32
    np.testing.assert_array_equal(host(h1), host(h2))                 # no dropout in eval
    assert bool(xp.isfinite(h1).all())


def test_bad_configs_and_inputs_are_clear_errors():
    with pytest.raises(ValueError, match=r"share: expected one of .* got 'some'"):
        _config("some", 4, 6, 2, 2, mlm=False)
    with pytest.raises(ValueError, match=r"embedding_size \(None: no factorisation\): expected an int >= 1, got 0"):
        _config("all", 0, 6, 2, 2, mlm=False)
    m = ALBERT(_config("all", 4, 6, 2, 2, mlm=False, dropout=0.0), rng=0)
    with pytest.raises(ValueError, match="no masked-LM head"):
        m.mlm_logits(np.zeros((1, 2, 6)))
    with pytest.raises(ValueError, match="at least one of dhidden, dpooled, dmlm_logits"):
        m.backward()
    with pytest.raises(TypeError, match="input_ids: expected an integer array"):
        m(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=8"):
        m(np.ones((1, 9), dtype=np.int64))


def test_bert_config_shape_matches():
    cfg = _config("ffn", 3, 6, 2, 2, mlm=True)
    b = cfg.as_bert()
    assert isinstance(b, BERTConfig) and b.hidden_size == 6 and b.mlm_head and b.vocab_size == 9
