"""gpt/ops/decode_kernels.py against its float64 references from the same weights, in Pallas's
interpreter (and, marked `gpu`, as Triton kernels on a GPU: `pytest -m gpu`), over a model-shaped
cache (several layers' heads as rows) whose slots are not a multiple of the block of positions:
a left-padded start, a window, a ring that has wrapped. Their speed is a GPU's (bench/decode_layer.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt.ops import decode_kernels as dk

D, F, H, S = 64, 256, 4, 40  # K = 16; S = 40 is not a multiple of BS = 16
K = D // H
KERNELS = dk.Kernels(BF=16, BK=32, BQ=8, BS=16)
FORMS = {"one": dict(attention="one"), "split": dict(attention="split", out_split=1),  # the attention's forms
         "split, out 2": dict(attention="split", out_split=2)}  # w_o's rows in 2 programs a head
ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")]
WHERE = [pytest.param(True, id="interpreter"), pytest.param(False, id="triton", marks=ON_GPU)]


def _params(key, cls, shapes, dtype="float32"):
    ks = jax.random.split(key, len(shapes))
    return cls(*((1.0 + 0.1 * jax.random.normal(k, s)) if i == 0 else
                 (0.3 * jax.random.normal(k, s)).astype(dtype if len(s) == 2 else "float32")
                 for i, (k, s) in enumerate(zip(ks, shapes))))


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("interpret", WHERE)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mlp_block_matches_float64(dtype, interpret):
    x = jax.random.normal(jax.random.key(0), (D,))
    p = _params(jax.random.key(1), dk.MLPParams, [(D,), (D,), (F, D), (F,), (F, D), (D,)], dtype)
    k = KERNELS._replace(dtype=dtype, interpret=interpret)
    want = dk.reference_mlp(x, p) - np.asarray(x)
    flow = dk.Flow(x, jnp.zeros(D), jnp.ones(D))  # a spare buffer that is not zeros: cleared
    out = jax.jit(lambda f: dk.atomic_mlp(f, p, k))(flow)
    rows = jax.jit(lambda f: dk.mlp_block(f, p, k))(flow)  # k.mlp "rows"
    tol = 1e-5 if dtype == "float32" else 2e-2
    for got in (out.x, rows.x):
        assert _rel(np.asarray(got) - np.asarray(x), want) < tol
    assert not np.any(np.asarray(out.zero)) and np.array_equal(out.spare, x)  # the rotation (`Flow`)
    assert not np.any(np.asarray(rows.zero)) and np.all(np.asarray(rows.spare) == 1)  # rows: left alone


def _cache(key, index: int, lo: int):
    """A two-layer cache (8 rows of heads), NaN in every slot of layer 1 that token `index` must
    not see (tokens before lo, slots never written): a read of one would show."""
    keys = jax.random.normal(key, (2 * H, K, S))
    values = jax.random.normal(jax.random.fold_in(key, 1), (2 * H, S, K))
    pos = index % S
    held = index - (pos - np.arange(S)) % S
    unseen_S = jnp.asarray((held < max(lo, 0)) & (np.arange(S) != pos))
    unseen = unseen_S & (jnp.arange(2 * H) >= H)[:, None, None]
    return jnp.where(unseen, jnp.nan, keys), jnp.where(jnp.swapaxes(unseen, 1, 2), jnp.nan, values)


CASES = [(37, 0), (20, 5), (0, 0), (39, 33), (15, 15), (7, -3),  # (index, lo) before the ring wraps
         (45, 10), (85, 50), (41, 0)]  # past S: the window, a start


@pytest.mark.parametrize("interpret", WHERE)
@pytest.mark.parametrize("form", list(FORMS))
def test_attention_block_matches_float64(form, interpret):
    """Layer 1 of the two-layer cache (rows 4-7), for each (index, lo) of CASES: token `index`
    written at slot index mod S and nowhere else (layer 0 untouched), attending to itself and
    tokens lo..index-1 as the cache holds them, whatever the other slots hold. One compilation
    for all the cases (index and lo are run-time values, as in the sampler)."""
    k = KERNELS._replace(dtype="float32", interpret=interpret, **FORMS[form])
    run = jax.jit(lambda f, p, kk, vv, i, lo: dk.attention_block(f, p, kk, vv, i, lo, k, H))
    for index, lo in CASES:
        kx, kp, kc = jax.random.split(jax.random.key(index * 100 + lo), 3)
        x = jax.random.normal(kx, (D,))
        p = _params(kp, dk.AttentionParams, [(D,), (D,), (3 * D, D), (3 * D,), (D, D), (D,)])
        keys, values = _cache(kc, index, lo)
        out, new_k, new_v = run(dk.Flow(x, jnp.zeros(D), jnp.ones(D)), p, keys, values, index, lo)
        x64, pos = np.asarray(x, np.float64), index % S
        want = dk.reference_attention(x, p, keys[H:], values[H:], index, lo) - x64
        assert _rel(np.asarray(out.x, np.float64) - x64, want) < 1e-5, (form, index, lo)
        assert not np.any(np.asarray(out.zero))
        for new, old, axis in ((new_k, keys, 2), (new_v, values, 1)):
            np.testing.assert_array_equal(*(np.delete(np.asarray(a), pos, axis) for a in (new, old)))
        p64 = [np.asarray(a, np.float64) for a in p]
        xn = (x64 - x64.mean()) / np.sqrt(x64.var() + 1e-5) * p64[0] + p64[1]
        qkv = p64[2] @ xn + p64[3]
        written = (np.asarray(new_k)[H:, :, pos], np.asarray(new_v)[H:, pos])  # this token's, per head
        for new, want in zip(written, (qkv[D:2 * D], qkv[2 * D:])):
            np.testing.assert_allclose(new, want.reshape(H, K), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interpret", WHERE)
@pytest.mark.parametrize("form", list(FORMS))
def test_attention_block_in_bf16(form, interpret):
    """bf16 weights and cache, as the sampler holds them on a GPU: bf16's precision against
    float64, the key and value written rounded to the cache's dtype."""
    kx, kp, kc = jax.random.split(jax.random.key(9), 3)
    x = jax.random.normal(kx, (D,))
    p = _params(kp, dk.AttentionParams, [(D,), (D,), (3 * D, D), (3 * D,), (D, D), (D,)], "bfloat16")
    keys, values = (a.astype(jnp.bfloat16) for a in _cache(kc, 30, 0))
    k = KERNELS._replace(interpret=interpret, **FORMS[form])
    block = lambda f: dk.attention_block(f, p, keys, values, jnp.int32(30), jnp.int32(0), k, H)  # noqa: E731
    out, new_k, _ = jax.jit(block)(dk.Flow(x, jnp.zeros(D), jnp.zeros(D)))
    x64 = np.asarray(x, np.float64)
    want = dk.reference_attention(x, p, keys[H:], values[H:], 30, 0) - x64
    assert _rel(np.asarray(out.x, np.float64) - x64, want) < 2e-2 and new_k.dtype == jnp.bfloat16


@pytest.mark.parametrize("d,h", [(768, 12), (1024, 16)], ids=["gpt2", "gpt2-medium"])
@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_blocks_at_gpt2_widths_on_gpu(d, h):
    """The Triton kernels at GPT-2's and GPT-2 medium's widths with the sampler's defaults
    (`Kernels()` fitted), bf16: they compile and run there, and match float64."""
    kd, f, s = d // h, 4 * d, 272
    k = dk.fit(dk.Kernels(), d, f, kd, s)
    x = jax.random.normal(jax.random.key(0), (d,))
    pm = _params(jax.random.key(1), dk.MLPParams, [(d,), (d,), (f, d), (f,), (f, d), (d,)], "bfloat16")
    pa = _params(jax.random.key(2), dk.AttentionParams, [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,)],
                 "bfloat16")
    keys = jax.random.normal(jax.random.key(3), (h, kd, s)).astype(jnp.bfloat16)
    values = jax.random.normal(jax.random.key(4), (h, s, kd)).astype(jnp.bfloat16)
    flow = dk.Flow(x, jnp.zeros(d), jnp.zeros(d))
    mlp = jax.jit(lambda f: dk.mlp_block(f, pm, k))(flow)
    att, _, _ = jax.jit(lambda f: dk.attention_block(f, pa, keys, values, 200, 0, k))(flow)
    x64 = np.asarray(x, np.float64)
    assert _rel(np.asarray(mlp.x, np.float64) - x64, dk.reference_mlp(x, pm) - x64) < 2e-2
    want = dk.reference_attention(x, pa, keys, values, 200) - x64
    assert _rel(np.asarray(att.x, np.float64) - x64, want) < 2e-2


def test_fit_shrinks_blocks_to_a_model():
    k = dk.fit(dk.Kernels(), d=768, f=3072, head_dim=64, slots=272)
    assert (k.BK, k.BF, k.BQ, k.BS) == (256, 16, 16, 256)
    k = dk.fit(dk.Kernels(), d=96, f=384, head_dim=8, slots=5)
    assert (k.BK, k.BF, k.BQ, k.BS) == (32, 16, 8, 4)
    # the MLP's two weights loaded first only where they fit a thread's registers (ptxas, offline)
    assert [dk.fit(dk.Kernels(), d, 4 * d, 64, 1024).early for d in (768, 1280, 2048)] == [True, True, False]
    # w_o's rows split into a number of programs that divides their tiles
    assert [dk.fit(dk.Kernels(), d, 4 * d, 64, 1024).out_split for d in (768, 1024)] == [3, 1]
