"""gpt/ops/norm_kernel.py against float64, in Pallas's interpreter (and, marked `gpu`, as a Triton
kernel: `pytest -m gpu`): LayerNorm with and without a bias and RMSNorm, the stream's gradient
added or not, tiles fitted to shapes they do not divide, bf16 inputs. Its speed is a GPU's
(bench/train.py --runtime=norm_kernel=triton)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt.ops import norm_kernel as nk
from gpt.ops.norm import layer_norm, layer_norm_reference, rms_norm_reference

ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")]
WHERE = [pytest.param(True, id="interpreter"), pytest.param(False, id="triton", marks=ON_GPU)]
KINDS = ["layernorm", "layernorm-nobias", "rmsnorm"]


def _f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _reference(x, scale, bias, g, gx, centre: bool):
    """float64 norm of x, and the gradients of sum(g * norm(x)) + sum(gx * x) for x, scale, bias."""
    x, scale, g = _f64(x), _f64(scale), _f64(g)
    xc = x - x.mean(-1, keepdims=True) if centre else x
    rstd = 1.0 / np.sqrt(np.square(xc).mean(-1, keepdims=True) + 1e-5)
    xhat = xc * rstd
    y = xhat * scale + (0.0 if bias is None else _f64(bias))
    gs = g * scale
    d = gs - gs.mean(-1, keepdims=True) if centre else gs
    dx = rstd * (d - xhat * (gs * xhat).mean(-1, keepdims=True)) + _f64(gx)
    D = x.shape[-1]
    return y, dx, (g * xhat).reshape(-1, D).sum(0), g.reshape(-1, D).sum(0)


def _inputs(shape, dtype, kind):
    k = jax.random.split(jax.random.key(sum(shape)), 5)
    x = (3.0 + 2.0 * jax.random.normal(k[0], shape)).astype(dtype)  # rows off zero, as trained streams are
    scale = 1.0 + 0.1 * jax.random.normal(k[1], shape[-1:])
    bias = None if kind != "layernorm" else 0.1 * jax.random.normal(k[2], shape[-1:])
    g = jax.random.normal(k[3], shape).astype(dtype)
    gx = jax.random.normal(k[4], shape).astype(dtype)
    return x, scale, bias, g, gx


@pytest.mark.parametrize("interpret", WHERE)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape,tiles", [((2, 12, 96), (8, 4, 256)), ((4, 16, 64), (2, 2, 16))],
                         ids=["fitted", "tiled"])  # tiles larger than the shape: shrunk to divide it
def test_norm_stream_matches_float64(shape, tiles, kind, dtype, interpret):
    x, scale, bias, g, gx = _inputs(shape, dtype, kind)
    centre = kind != "rmsnorm"
    t = nk.Tiles(*tiles, interpret=interpret)
    (x_out, y), vjp = jax.vjp(lambda a, s, b: nk.norm_stream(a, s, b, 1e-5, centre, jnp.dtype(dtype), t),
                              x, scale, bias)
    dx, ds, db = vjp((gx, g))
    want = _reference(x, scale, bias, g, gx, centre)
    assert x_out is x or np.array_equal(np.asarray(x_out), np.asarray(x))
    assert y.dtype == dx.dtype == x.dtype and ds.dtype == scale.dtype and (db is None) == (bias is None)
    tol = 1e-5 if dtype == "float32" else 2e-2  # bf16: one rounding of the result
    for got, ref in ((y, want[0]), (dx, want[1])):
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(ds), want[2], rtol=1e-5, atol=1e-4)  # float32 sums
    if bias is not None:
        np.testing.assert_allclose(np.asarray(db), want[3], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("interpret", WHERE)
@pytest.mark.parametrize("kind", KINDS)
def test_norm_equals_the_references_and_their_gradients(kind, interpret):
    """`norm` (no stream) against autodiff of gpt/ops/norm.py's references, in float32."""
    x, scale, bias, g, _ = _inputs((3, 8, 128), "float32", kind)
    centre = kind != "rmsnorm"
    t = nk.Tiles(interpret=interpret)

    def ref(a, s, b):
        return layer_norm_reference(a, s, b) if centre else rms_norm_reference(a, s)

    got = jax.vjp(lambda a, s, b: nk.norm(a, s, b, 1e-5, centre, jnp.dtype("float32"), t), x, scale, bias)
    want = jax.vjp(ref, x, scale, bias)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
    for a, b in zip(got[1](g), want[1](g)):
        if b is not None:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_constant_rows_as_xla_computes_them():
    """Constant rows (variance 0, 1/std = 1/sqrt(eps)) beside ordinary ones: the norm and every
    gradient equal XLA's path (`gpt.ops.norm.layer_norm`), finite."""
    k = jax.random.split(jax.random.key(3), 3)
    x = jnp.full((2, 4, 64), 3.0).at[0, 0].set(jnp.arange(64.0)).at[1, 2].set(jax.random.normal(k[0], (64,)))
    scale, bias = 1.0 + jax.random.normal(k[1], (64,)), jnp.zeros(64)
    g = jax.random.normal(k[2], x.shape)
    got = jax.vjp(lambda a, s, b: nk.norm(a, s, b, 1e-5, True, jnp.dtype("float32"), nk.Tiles(interpret=True)),
                  x, scale, bias)
    want = jax.vjp(lambda a, s, b: layer_norm(a, s, b, 1e-5), x, scale, bias)
    for a, b in zip((got[0], *got[1](g)), (want[0], *want[1](g)), strict=True):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-3)


def test_tiles_fit_the_array_and_bound_the_registers():
    """Tiles divide [R, D] (SUB any divisor: an odd R still gets programs of several rows), and
    wider rows take more warps and fewer rows a tile (ptxas spilled at 4,096 wide before)."""
    assert nk.fit(nk.Tiles(), 65536, 768)[:4] == (2, 16, 256, 8)  # GPT-2: the defaults
    assert nk.fit(nk.Tiles(), 24, 96)[:4] == (2, 12, 32, 8)
    assert nk.fit(nk.Tiles(), 15, 100)[:4] == (1, 15, 4, 8)
    assert nk.fit(nk.Tiles(), 65536, 1600)[:4] == (1, 16, 64, 8)  # GPT-2 XL
    assert nk.fit(nk.Tiles(), 7, 4096)[:4] == (1, 7, 1024, 16)
    for R, D in ((65536, 768), (24, 96), (15, 100), (65536, 1600), (7, 4096), (8, 8192)):
        t = nk.fit(nk.Tiles(), R, D)
        assert R % (t.BR * t.SUB) == 0 and D % t.BD == 0 and t.BR * D <= nk.PER_THREAD * 32 * t.warps


def test_widths_of_many_chunks_keep_xlas_norms():
    """The kernel unrolls a row's chunks: widths of at most MAX_CHUNKS chunks take it (GPT-2's,
    Llama's, Qwen's), GPT-2 XL's 1,600 (25 of 64) and odd widths keep XLA's norms, and so does
    the model (`gpt.model.uses_norm_kernel`)."""
    from gpt.model import uses_norm_kernel
    from helpers import tiny_model_config, tiny_runtime
    assert all(nk.fits(D) for D in (32, 96, 768, 1024, 1280, 2048, 3584, 4096, 5120, 8192))
    assert not any(nk.fits(D) for D in (1600, 99, 100, 4100))
    rt = tiny_runtime(tiny_model_config(), norm_kernel="interpret")
    assert uses_norm_kernel(rt, tiny_model_config(n_embd=96, n_head=2), cached=False)
    assert not uses_norm_kernel(rt, tiny_model_config(n_embd=100, n_head=2), cached=False)
