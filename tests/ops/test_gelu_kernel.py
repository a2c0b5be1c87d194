"""gpt/ops/gelu_kernel.py against float64, in Pallas's interpreter (and, marked `gpu`, as Triton
kernels: `pytest -m gpu`): the activation and both gradients, tiles fitted to shapes they do not
divide, bf16 products. Its speed is a GPU's (bench/train.py --runtime=gelu_kernel=triton)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt.ops import gelu_kernel as gk

ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")]
WHERE = [pytest.param(True, id="interpreter"), pytest.param(False, id="triton", marks=ON_GPU)]


def _reference(fc, b, g):
    """float64 gelu_tanh(fc + b) and the gradients of sum(g * it) for fc and b."""
    a = np.asarray(jnp.asarray(fc, jnp.float32), np.float64) + np.asarray(b, np.float64)
    c, k = np.sqrt(2.0 / np.pi), 0.044715
    t = np.tanh(c * (a + k * a ** 3))
    slope = 0.5 * (1 + t) + 0.5 * a * (1 - t * t) * c * (1 + 3 * k * a * a)
    d = np.asarray(jnp.asarray(g, jnp.float32), np.float64) * slope
    return 0.5 * a * (1 + t), d, d.reshape(-1, a.shape[-1]).sum(0)


@pytest.mark.parametrize("interpret", WHERE)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape,tiles", [((2, 24, 96), (16, 512)), ((4, 16, 256), (8, 64))],
                         ids=["fitted", "tiled"])  # tiles larger than the shape: shrunk to divide it
def test_activation_and_gradients_match_float64(shape, tiles, dtype, interpret):
    k = jax.random.split(jax.random.key(sum(shape)), 3)
    fc = (3.0 * jax.random.normal(k[0], shape)).astype(dtype)  # into GELU's curved part and its tails
    b = jax.random.normal(k[1], shape[-1:])
    g = jax.random.normal(k[2], shape).astype(dtype)
    t = gk.Tiles(BR=tiles[0], BF=tiles[1], interpret=interpret)
    y, vjp = jax.vjp(lambda f, bb: gk.gelu_bias(f, bb, t), fc, b)
    d_fc, d_b = vjp(g)
    want = _reference(fc, b, g)
    assert y.dtype == d_fc.dtype == fc.dtype and d_b.dtype == b.dtype
    tol = 1e-5 if dtype == "float32" else 1e-2  # bf16: one rounding of the result
    for got, ref in ((y, want[0]), (d_fc, want[1])):
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(d_b), want[2], rtol=1e-5, atol=1e-4)  # float32 sums of d


def test_tiles_fit_powers_of_two_that_divide():
    assert gk.fit(gk.Tiles(), 65536, 3072)[:2] == (32, 256)
    assert gk.fit(gk.Tiles(), 24, 96)[:2] == (8, 32)
    assert gk.fit(gk.Tiles(), 7, 6400)[:2] == (1, 256)


def test_tanh_saturates_without_nan():
    u = jnp.array([-1e30, -100.0, -1.0, 0.0, 1.0, 100.0, 1e30, jnp.inf, -jnp.inf])
    np.testing.assert_allclose(np.asarray(gk._tanh(u)), np.tanh(np.asarray(u)), atol=1e-7)


def test_narrow_tiles_keep_xlas_fusion():
    """An MLP whose width takes tiles under MIN_BF columns (few factors of two) keeps XLA's
    fusion, in the model too (`gpt.model.gelu_kernel_fits`)."""
    from gpt.model import gelu_kernel_fits
    from helpers import tiny_model_config
    assert gk.fits(3072) and gk.fits(384) and gk.fits(64) and not gk.fits(400) and not gk.fits(99)
    assert gelu_kernel_fits(tiny_model_config(n_embd=96, n_head=2))
    assert not gelu_kernel_fits(tiny_model_config(n_embd=100, n_head=2))
