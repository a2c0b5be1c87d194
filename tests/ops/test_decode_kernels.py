"""gpt/ops/decode_kernels.py in Pallas's interpreter: each block against float64 from the same
weights, over a model-shaped cache (several layers' heads as rows) whose slots are not a multiple
of the block of positions, with a left-padded start. Their speed is a GPU's (bench/decode_layer.py)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt.ops import decode_kernels as dk

D, F, H, S = 64, 256, 4, 40  # K = 16; S = 40 is not a multiple of BS = 16
K = D // H
KERNELS = dk.Kernels(BF=16, BK=32, BQ=8, BS=16, interpret=True)


def _params(key, cls, shapes):
    ks = jax.random.split(key, len(shapes))
    return cls(*(1.0 + 0.1 * jax.random.normal(k, s) if i == 0 else 0.3 * jax.random.normal(k, s)
                 for i, (k, s) in enumerate(zip(ks, shapes))))


def _ln64(x, p):
    return (x - x.mean()) / np.sqrt(x.var() + 1e-5) * np.float64(p.scale) + np.float64(p.bias)


def _f64(p):
    return type(p)(*(np.asarray(a, np.float64) for a in p))


def reference_mlp(x, p):
    p = _f64(p)
    a = p.w_fc @ _ln64(x, p) + p.b_fc
    return x + np.asarray(dk.gelu(jnp.asarray(a)), np.float64) @ p.w_proj + p.b_proj


def reference_attention(x, p, keys_KS, values_SK, pos, start):
    """One layer's block in float64: keys [H, K, S] and values [H, S, K] as held, the new
    position's unrounded; attending over [start, pos]."""
    p = _f64(p)
    q, k, v = (p.w_qkv @ _ln64(x, p) + p.b_qkv).reshape(3, H, K)
    keys, values = np.array(keys_KS, np.float64), np.array(values_SK, np.float64)
    keys[:, :, pos], values[:, pos] = k, v
    s = np.einsum("hk,hks->hs", q, keys[:, :, start:pos + 1]) / math.sqrt(K)
    e = np.exp(s - s.max(-1, keepdims=True))
    y = np.einsum("hs,hsk->hk", e / e.sum(-1, keepdims=True), values[:, start:pos + 1]).reshape(-1)
    return x + y @ p.w_o + p.b_o


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mlp_block_matches_float64(dtype):
    x = jax.random.normal(jax.random.key(0), (D,))
    p = _params(jax.random.key(1), dk.MLPParams, [(D,), (D,), (F, D), (F,), (F, D), (D,)])
    k = KERNELS._replace(dtype=dtype)
    want = reference_mlp(np.asarray(x, np.float64), p) - np.asarray(x)
    flow = dk.Flow(x, jnp.zeros(D), jnp.ones(D))  # a spare buffer that is not zeros: cleared
    out = jax.jit(lambda f: dk.mlp_block(f, p, k))(flow)
    rows = jax.jit(lambda x: dk.mlp_rows(x, p, k))(x)
    tol = 1e-5 if dtype == "float32" else 2e-2
    for got in (out.x, rows):
        assert _rel(np.asarray(got) - np.asarray(x), want) < tol
    assert not np.any(np.asarray(out.zero)) and np.array_equal(out.spare, x)  # the rotation (`Flow`)


@pytest.mark.parametrize("form", ["one", "split"])
@pytest.mark.parametrize("pos,start", [(37, 0), (20, 5), (0, 0), (39, 33), (15, 15)])
def test_attention_block_matches_float64(form, pos, start):
    """Layer 1 of a two-layer cache (rows 4-7 of 8): its keys and values at pos are written, no
    other entry changes (layer 0's included), and the output attends over [start, pos] only,
    whatever the other slots hold (NaN there included)."""
    kx, kp, kc = jax.random.split(jax.random.key(pos * 100 + start), 3)
    x = jax.random.normal(kx, (D,))
    p = _params(kp, dk.AttentionParams, [(D,), (D,), (3 * D, D), (3 * D,), (D, D), (D,)])
    keys = jax.random.normal(kc, (2 * H, K, S))
    values = jax.random.normal(jax.random.fold_in(kc, 1), (2 * H, S, K))
    outside = (jnp.arange(S) < start) | (jnp.arange(S) > pos)
    keys, values = jnp.where(outside, jnp.nan, keys), jnp.where(outside[:, None], jnp.nan, values)
    k = KERNELS._replace(attention=form, dtype="float32")
    run = jax.jit(lambda f, kk, vv: dk.attention_block(f, p, kk, vv, jnp.int32(pos), jnp.int32(start), k, H))
    out, new_k, new_v = run(dk.Flow(x, jnp.zeros(D), jnp.ones(D)), keys, values)
    x64 = np.asarray(x, np.float64)
    want = reference_attention(x64, p, keys[H:], values[H:], pos, start) - x64
    assert _rel(np.asarray(out.x, np.float64) - x64, want) < 1e-5, form
    assert not np.any(np.asarray(out.zero))
    for new, old, axis in ((new_k, keys, 2), (new_v, values, 1)):
        np.testing.assert_array_equal(*(np.delete(np.asarray(a), pos, axis) for a in (new, old)))
    qkv = np.asarray(p.w_qkv, np.float64) @ _ln64(x64, _f64(p)) + np.asarray(p.b_qkv, np.float64)
    np.testing.assert_allclose(np.asarray(new_k)[H:, :, pos], qkv[D:2 * D].reshape(H, K), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(new_v)[H:, pos], qkv[2 * D:].reshape(H, K), rtol=1e-5, atol=1e-5)


def test_fit_shrinks_blocks_to_a_model():
    k = dk.fit(dk.Kernels(), d=768, f=3072, head_dim=64, slots=272)
    assert (k.BK, k.BF, k.BQ, k.BS) == (256, 16, 16, 256)
    k = dk.fit(dk.Kernels(), d=96, f=384, head_dim=8, slots=5)
    assert (k.BK, k.BF, k.BQ, k.BS) == (32, 16, 8, 4)
