import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_model_config
from gpt import model as M
from gpt.config import PRESETS, ModelConfig


def make(cfg, seed=0):
    return M.GPT(cfg, rngs=nnx.Rngs(seed))


def tokens(B, T, V, seed=1):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, V)


@pytest.mark.parametrize("pos", ["learned", "sinusoidal"])
def test_shapes_and_padded_vocab(pos):
    cfg = tiny_model_config(vocab_size=70, pos_embedding=pos)
    assert cfg.padded_vocab_size == 128
    logits, cache = make(cfg)(tokens(3, 16, 70))
    assert logits.shape == (3, 16, 128) and logits.dtype == jnp.float32 and cache is None
    assert bool(jnp.all(jnp.isneginf(logits[..., 70:])))  # padded entries are never scored
    assert bool(jnp.all(jnp.isfinite(logits[..., :70])))


@pytest.mark.parametrize("attention", ["xla", "einsum"])
def test_causality(attention):
    cfg = tiny_model_config(attention=attention)
    model = make(cfg)
    x = tokens(2, 16, 65)
    t = 9
    x2 = x.at[:, t + 1].set((x[:, t + 1] + 1) % 65)
    a, _ = model(x)
    b, _ = model(x2)
    np.testing.assert_array_equal(np.asarray(a[:, :t + 1, :65]), np.asarray(b[:, :t + 1, :65]))
    assert float(jnp.abs(a[:, t + 1:, :65] - b[:, t + 1:, :65]).max()) > 0


def test_gpt2_parameter_count():
    cfg = ModelConfig(**{k: v for k, v in PRESETS["gpt2"].items() if k in ModelConfig.__dataclass_fields__})
    assert M.num_params(cfg) == 124_439_808
    # The built model has exactly that many parameters plus the vocabulary padding rows.
    shapes = nnx.state(nnx.eval_shape(lambda: M.GPT(cfg, rngs=nnx.Rngs(0))))
    total = sum(x.size for x in jax.tree.leaves(shapes))
    assert total == 124_439_808 + (cfg.padded_vocab_size - cfg.vocab_size) * cfg.n_embd
    # FLOPs: 6N (no position embeddings) + 12*L*T*D.
    n = 124_439_808 - 1024 * 768
    assert M.flops_per_token(cfg) == 6 * n + 12 * 12 * 1024 * 768


@pytest.mark.parametrize("rate", [0.001, 0.2, 0.5])
def test_dropout_mask_rate_and_scale(rate):
    """16-bit masks: the kept fraction is 1 - rate (to sampling error), the mean is preserved,
    odd trailing sizes work, and the same key gives the same mask."""
    key = jax.random.key(4)
    keep = M.keep_mask(key, rate, (8, 3, 40001))
    assert keep.shape == (8, 3, 40001) and keep.dtype == jnp.bool_
    n = keep.size
    kept = float(keep.mean())
    assert abs(kept - (1 - rate)) < 5 * (rate * (1 - rate) / n) ** 0.5 + 1e-5, kept
    assert abs(M.drop_rate(rate) - rate) <= 2 ** -17
    y = M.dropout(jnp.ones((8, 3, 40001)), rate, key)
    assert abs(float(y.mean()) - 1.0) < 5 * (rate / (1 - rate) / n) ** 0.5 + 1e-5
    assert bool(jnp.all(M.keep_mask(key, rate, (8, 3, 40001)) == keep))
    assert not bool(jnp.all(M.keep_mask(jax.random.key(5), rate, (8, 3, 40001)) == keep))
    assert M.keep_mask(None, rate, (4,)).ndim == 0 and M.keep_mask(key, 0.0, (4,)).ndim == 0


@pytest.mark.parametrize("cpu_layouts", [True, False])  # False: the GPU/TPU form, on the CPU
@pytest.mark.parametrize("block", [M.ATTENTION_BLOCK, 8, 5])
@pytest.mark.parametrize("rate", [0.0, 0.3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocked_attention_matches_einsum(rate, dtype, block, cpu_layouts, monkeypatch):
    """The hand-written attention backward (the training path) against autodiff of the reference,
    with the same dropout mask: equal forward, gradients equal up to bf16 rounding; in one query
    block and in several (the causal blocks skipped), including a ragged last block."""
    monkeypatch.setattr(M, "_cpu_layouts", lambda: cpu_layouts)
    B, T, H, K = 2, 16, 2, 8
    ks = jax.random.split(jax.random.key(0), 5)
    q, k, v = (jax.random.normal(ks[i], (B, T, H, K)) for i in range(3))
    key = ks[3] if rate else None
    keep = M.attention_keep_masks(key, rate, B, H, T, block)
    full = M.keep_mask(key, rate, (B, H, T, T))
    for (t0, t1), blk in zip(M.causal_blocks(T, block), keep, strict=True):  # the full mask's blocks
        assert bool(jnp.all(blk == (full[:, :, t0:t1, :t1] if full.ndim else full)))
    dt = jnp.dtype(dtype)
    cast = lambda *a: [x.astype(dt) for x in a]
    y1, vjp1 = jax.vjp(lambda *a: M.attention_blocked(*cast(*a), keep, M.drop_rate(rate), block),
                       q, k, v)
    y2, vjp2 = jax.vjp(lambda *a: M.attention_einsum(*cast(*a), M.causal_mask(T), rate, key), q, k, v)
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y2), atol=1e-6)
    g = jax.random.normal(ks[4], y1.shape)
    for a, b in zip(vjp1(g), vjp2(g)):
        err = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        assert err < (1e-5 if dtype == "float32" else 2e-2), err


def test_blocked_attention_is_the_training_path(monkeypatch):
    """A model with dropout trains through `attention_blocked` in either dtype (`--attention=einsum`
    keeps the reference); its loss gradient matches the reference's: to float32 rounding in
    float32, to bf16 accuracy in bfloat16 (with two query blocks)."""
    monkeypatch.setattr(M, "ATTENTION_BLOCK", 8)
    cfg = tiny_model_config(dropout=0.1)
    model = make(cfg)
    gd, params = nnx.split(model)
    x = tokens(2, 16, 65)

    def loss(p, dtype, attention="auto"):
        m = nnx.merge(gd, p)
        m.cfg = dataclasses.replace(cfg, dtype=dtype, attention=attention)
        logits, _ = m(x, dropout_key=jax.random.key(3))
        return jnp.mean(jax.nn.logsumexp(logits, -1))

    uses = lambda *a: "name=attention_blocked" in str(jax.make_jaxpr(lambda p: loss(p, *a))(params))
    assert uses("bfloat16") and uses("float32") and uses("bfloat16", "xla")
    assert not uses("float32", "einsum") and not uses("bfloat16", "einsum")
    ref = jax.grad(loss)(params, "float32", "einsum")
    for dtype, tol in (("float32", 1e-5), ("bfloat16", 5e-2)):
        for a, b in zip(jax.tree.leaves(jax.grad(loss)(params, dtype)), jax.tree.leaves(ref)):
            assert float(jnp.max(jnp.abs(a - b))) / (float(jnp.max(jnp.abs(b))) or 1.0) < tol


def test_einsum_reference_matches_dot_product_attention():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(k1, (2, 8, 4, 16))
    k = jax.random.normal(k2, (2, 8, 4, 16))
    v = jax.random.normal(k3, (2, 8, 4, 16))
    ref = M.attention_einsum(q, k, v, M.causal_mask(8))
    fused = M.attention_fused(q, k, v, None, "xla")
    np.testing.assert_allclose(np.asarray(fused), np.asarray(ref), atol=1e-5)
    # With an explicit mask (the cache path) too.
    mask = jnp.broadcast_to(M.causal_mask(8), (2, 8, 8)).at[1, :, :3].set(False)
    np.testing.assert_allclose(np.asarray(M.attention_fused(q, k, v, mask, "xla")),
                               np.asarray(M.attention_einsum(q, k, v, mask)), atol=1e-5)
    cfg = tiny_model_config()
    model = make(cfg)
    x = tokens(2, 16, 65)
    a, _ = model(x)
    model.cfg = dataclasses.replace(cfg, attention="einsum")
    b, _ = model(x)
    np.testing.assert_allclose(np.asarray(a[..., :65]), np.asarray(b[..., :65]), atol=1e-5)


def test_init_statistics():
    cfg = tiny_model_config(n_layer=4, n_embd=64)
    state = nnx.to_pure_dict(nnx.state(make(cfg)))
    assert abs(float(state["wte"].std()) - 0.02) < 0.002
    proj_std = 0.02 / np.sqrt(2 * cfg.n_layer)
    assert abs(float(state["blocks"]["w_proj"].std()) - proj_std) < 0.15 * proj_std
    assert float(jnp.abs(state["blocks"]["b_fc"]).max()) == 0.0
    assert float(state["blocks"]["ln1_scale"].min()) == 1.0


def test_kv_cache_matches_full_forward():
    cfg = tiny_model_config()
    model = make(cfg)
    x = tokens(2, 20, 65)
    full, _ = model(x)
    cache = M.init_cache(cfg, 2, 32)
    out, cache = model(x[:, :7], cache=cache)
    parts = [out]
    for t in range(7, 20):
        o, cache = model(x[:, t:t + 1], cache=cache)
        parts.append(o)
    assert int(cache.index) == 20
    got = jnp.concatenate(parts, axis=1)
    assert float(jnp.abs(got[..., :65] - full[..., :65]).max()) < 1e-4


def test_left_padded_cache_rows_match_unpadded():
    """A left-padded row gives the same logits as the same prompt alone (positions count from 0)."""
    cfg = tiny_model_config()
    model = make(cfg)
    x = tokens(1, 10, 65)
    alone, _ = model(x)
    padded = jnp.concatenate([jnp.zeros((1, 4), jnp.int32), x], axis=1)
    cache = M.init_cache(cfg, 1, 32, start_B=jnp.array([4]))
    out, _ = model(padded, cache=cache)
    assert float(jnp.abs(out[:, 4:, :65] - alone[..., :65]).max()) < 1e-4


@pytest.mark.parametrize("remat,scan", [("block", False), ("dots", True), ("none", True)])
def test_remat_and_scan_give_same_loss_and_grads(remat, scan):
    cfg = tiny_model_config()
    x = tokens(2, 16, 65)

    def loss(model):
        logits, _ = model(x[:, :-1])
        return -jnp.mean(jax.nn.log_softmax(logits[..., :65])[..., 0])

    base = make(cfg)
    other = make(dataclasses.replace(cfg, remat=remat, scan_layers=scan))
    l1, g1 = nnx.value_and_grad(loss)(base)
    l2, g2 = nnx.value_and_grad(loss)(other)
    assert abs(float(l1) - float(l2)) < 1e-6
    for a, b in zip(jax.tree.leaves(nnx.state(g1)), jax.tree.leaves(nnx.state(g2))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_bfloat16_compute_keeps_float32_params_and_logits():
    cfg = tiny_model_config(dtype="bfloat16")
    model = make(cfg)
    logits, _ = model(tokens(2, 8, 65))
    assert logits.dtype == jnp.float32
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model)))
    ref, _ = make(tiny_model_config())(tokens(2, 8, 65))
    assert float(jnp.abs(logits[..., :65] - ref[..., :65]).max()) < 0.1


def test_dropout_is_active_only_with_a_key():
    cfg = tiny_model_config(dropout=0.5)
    model = make(cfg)
    x = tokens(2, 8, 65)
    a, _ = model(x)
    b, _ = model(x)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    c, _ = model(x, dropout_key=jax.random.key(0))
    assert float(jnp.abs(c[..., :65] - a[..., :65]).max()) > 0


def test_auto_attention_takes_cudnn_for_bf16_training():
    """--attention=auto resolves to cuDNN on the causal bf16 path (XLA's own choice materialises
    the scores) and to XLA where cuDNN does not apply."""
    from gpt.model import fused_implementation
    assert fused_implementation("auto", True, jnp.bfloat16, 64, "gpu") == "cudnn"
    assert fused_implementation("auto", True, jnp.float32, 64, "gpu") == "xla"
    assert fused_implementation("auto", False, jnp.bfloat16, 64, "gpu") == "xla"
    assert fused_implementation("auto", True, jnp.bfloat16, 64, "cpu") == "xla"


def test_weights_held_in_bf16_run_with_and_without_cache():
    """Sampling may hold the parameters in the compute dtype: the residual stream stays float32
    (the layer scan's carry) and the logits match float32-held weights in bf16 compute."""
    from gpt.model import GPT, init_cache
    cfg = tiny_model_config(dtype="bfloat16")
    model = GPT(cfg, rngs=nnx.Rngs(0))
    gd, params = nnx.split(model)
    half = nnx.merge(gd, jax.tree.map(lambda p: p.astype(jnp.bfloat16), params))
    idx = jnp.array([[1, 2, 3, 4, 5, 6]], jnp.int32)
    full, _ = model(idx)
    got, _ = half(idx)
    cached, _ = half(idx, cache=init_cache(cfg, 1, 8))
    assert float(jnp.abs(got - full)[..., :65].max()) < 0.1
    assert float(jnp.abs(cached - got)[..., :65].max()) < 0.05
