"""gpt.ops.norm: LayerNorm/RMSNorm values and gradients against plain autodiff of the formulas."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt.ops.norm import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference


def _inputs(shape, dtype):
    kx, ks, kb, kg = jax.random.split(jax.random.key(0), 4)
    x = (3 * jax.random.normal(kx, shape) + 1.5).astype(dtype)  # off-centre: the mean matters
    D = shape[-1]
    return (x, 1 + 0.3 * jax.random.normal(ks, (D,)), 0.1 * jax.random.normal(kb, (D,)),
            jax.random.normal(kg, shape))


def _check(fast, ref, args, g, x_dtype, tol):
    """Values, and the gradients of <g, f(args)> for every argument, match the reference."""
    np.testing.assert_allclose(np.asarray(fast(*args)), np.asarray(ref(*args)), rtol=tol, atol=tol)
    loss = lambda f: (lambda *a: jnp.sum(f(*a) * g))
    got = jax.jit(jax.grad(loss(fast), argnums=tuple(range(len(args)))))(*args)
    want = jax.grad(loss(ref), argnums=tuple(range(len(args))))(*args)
    assert got[0].dtype == x_dtype
    for a, b in zip(got, want, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.max(np.abs(a - b)) <= tol * (1 + np.max(np.abs(b))), np.max(np.abs(a - b))


@pytest.mark.parametrize("shape", [(2, 5, 16), (3, 4, 2, 8), (7, 128)])
@pytest.mark.parametrize("dtype,tol", [("float32", 2e-5), ("bfloat16", 2e-2)])
def test_layer_norm_matches_reference(shape, dtype, tol):
    x, scale, bias, g = _inputs(shape, jnp.dtype(dtype))
    _check(lambda x, s, b: layer_norm(x, s, b, 1e-5), lambda x, s, b: layer_norm_reference(x, s, b, 1e-5),
           (x, scale, bias), g, x.dtype, tol)
    _check(lambda x, s: layer_norm(x, s, None), lambda x, s: layer_norm_reference(x, s, None),
           (x, scale), g, x.dtype, tol)


@pytest.mark.parametrize("shape", [(2, 5, 16), (3, 4, 2, 8)])
@pytest.mark.parametrize("dtype,tol", [("float32", 2e-5), ("bfloat16", 2e-2)])
def test_rms_norm_matches_reference(shape, dtype, tol):
    x, scale, _, g = _inputs(shape, jnp.dtype(dtype))
    _check(lambda x, s: rms_norm(x, s, 1e-6), lambda x, s: rms_norm_reference(x, s, 1e-6),
           (x, scale), g, x.dtype, tol)


def test_layer_norm_is_the_textbook_formula():
    x = np.random.default_rng(0).normal(2.0, 3.0, (4, 10))
    y = np.asarray(layer_norm(jnp.asarray(x, jnp.float32), jnp.ones(10), None))
    want = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y, want, atol=1e-5)


def test_constant_rows_stay_finite():
    """A row with zero variance normalises to 0 (eps keeps 1/std finite), with finite gradients."""
    x = jnp.full((2, 8), 3.0)
    y, grads = jax.value_and_grad(lambda x, s: jnp.sum(layer_norm(x, s, None) ** 2 + layer_norm(x, s, None)),
                                  argnums=(0, 1))(x, jnp.ones(8))
    assert np.isfinite(float(y)) and all(np.all(np.isfinite(np.asarray(a))) for a in grads)
