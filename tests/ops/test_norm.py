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
    assert fast(*args).dtype == jnp.float32 and got[0].dtype == x_dtype
    assert all(a.dtype == b.dtype for a, b in zip(got[1:], args[1:]))  # parameters: their own dtype
    for a, b in zip(got, want, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.max(np.abs(a - b)) <= tol * (1 + np.max(np.abs(b))), np.max(np.abs(a - b))


@pytest.mark.parametrize("shape", [(3, 4, 2, 8), (7, 128)])
@pytest.mark.parametrize("dtype,tol", [("float32", 2e-5), ("bfloat16", 2e-2)])
def test_layer_norm_matches_reference(shape, dtype, tol):
    x, scale, bias, g = _inputs(shape, jnp.dtype(dtype))
    _check(lambda x, s, b: layer_norm(x, s, b, 1e-5), lambda x, s, b: layer_norm_reference(x, s, b, 1e-5),
           (x, scale, bias), g, x.dtype, tol)
    _check(lambda x, s: layer_norm(x, s, None), lambda x, s: layer_norm_reference(x, s, None),
           (x, scale), g, x.dtype, tol)
    _check(lambda x, s, b: layer_norm(x, s, b), lambda x, s, b: layer_norm_reference(x, s, b),
           (x, scale, bias.astype(jnp.bfloat16)), g, x.dtype, max(tol, 2e-2))  # a bf16 bias
    with pytest.raises(ValueError, match="must match"):  # the custom VJP's bias gradient is [D]
        layer_norm(x, scale, bias[None])


@pytest.mark.parametrize("shape", [(3, 4, 2, 8), (7, 128)])
@pytest.mark.parametrize("dtype,tol", [("float32", 2e-5), ("bfloat16", 2e-2)])
def test_rms_norm_matches_reference(shape, dtype, tol):
    x, scale, _, g = _inputs(shape, jnp.dtype(dtype))
    _check(lambda x, s: rms_norm(x, s, 1e-6), lambda x, s: rms_norm_reference(x, s, 1e-6),
           (x, scale), g, x.dtype, tol)
    _check(lambda x, s: rms_norm(x, s, 1e-6), lambda x, s: rms_norm_reference(x, s, 1e-6),
           (x, scale.astype(jnp.bfloat16)), g, x.dtype, max(tol, 2e-2))  # a bf16 scale


def test_under_remat_and_scan_match_reference():
    """Through jax.checkpoint (both of the model's remat policies) inside a lax.scan over layers, as
    the model runs its blocks."""
    from gpt.model import REMAT_POLICIES
    x, scale, bias, g = _inputs((2, 6, 16), jnp.float32)
    scales = jnp.stack([scale, 2 * scale, scale + 1])
    biases = jnp.stack([bias, -bias, 2 * bias])

    def stack(ln, rms, policy):
        def layer(h, sb):
            return jax.checkpoint(lambda h, s, b: rms(ln(h, s, b) @ jnp.eye(16), s) + h,
                                  policy=policy)(h, *sb), None
        return lambda x, scales, biases: jnp.sum(jax.lax.scan(layer, x, (scales, biases))[0] * g)
    for policy in REMAT_POLICIES.values():
        got = jax.jit(jax.grad(stack(layer_norm, rms_norm, policy), argnums=(0, 1, 2)))(x, scales, biases)
        want = jax.grad(stack(layer_norm_reference, rms_norm_reference, policy),
                        argnums=(0, 1, 2))(x, scales, biases)
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mean,std,outlier", [(2.0, 3.0, None), (3e4, 1.0, None), (-50.0, 1e-2, None),
                                              (0.0, 1.0, 0), (0.0, 1.0, 1), (3e4, 1.0, 2)])
def test_layer_norm_is_the_textbook_formula(mean, std, outlier):
    """Against float64, also for rows whose mean is far from zero next to their spread (the one-pass
    statistics shift each row by a value within it, so they stay exact there; the two-pass formula
    was off by 3e-3 at a mean of 3e4), and for rows with one huge entry among the first three (the
    shift is their median, not the outlier: shifted by it, the error was 3e-3)."""
    x = np.asarray(np.random.default_rng(0).normal(mean, std, (4, 768)), np.float32)
    if outlier is not None:
        x[:, outlier] += 3000.0
    y = np.asarray(layer_norm(jnp.asarray(x), jnp.ones(768), None))
    x = x.astype(np.float64)
    want = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y, want, atol=2e-5)


@pytest.mark.parametrize("fast,ref,value", [(layer_norm, layer_norm_reference, 3.0),
                                            (rms_norm, rms_norm_reference, 0.0)])
def test_constant_rows_normalise_to_zero(fast, ref, value):
    """A row with zero variance (LayerNorm) or all zeros (RMSNorm) normalises to 0: eps keeps 1/std
    finite, and the gradients are finite and equal the reference's."""
    x, scale = jnp.full((2, 8), value), jnp.ones(8)
    args = (x, scale, None) if fast is layer_norm else (x, scale)
    np.testing.assert_array_equal(np.asarray(fast(*args)), 0.0)
    f = lambda norm: (lambda x, s: jnp.sum(norm(x, s, *args[2:]) * jnp.arange(8.0)))
    got, want = jax.grad(f(fast), argnums=(0, 1))(x, scale), jax.grad(f(ref), argnums=(0, 1))(x, scale)
    for a, b in zip(got, want):
        assert np.all(np.isfinite(np.asarray(a)))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_sharded_scale_gradient_needs_no_gather():
    """With the batch and the heads sharded (q/k norms under tensor parallelism), the scale's
    gradient (and a LayerNorm's scale and bias gradients, one stacked reduction) is reduced where
    the shards are: no all-gather of the [B, T, H, K] array."""
    from helpers import run_on_4_cpu_devices
    out = run_on_4_cpu_devices("""
import json, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from gpt.ops.norm import layer_norm, rms_norm
mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
x = jax.device_put(jnp.ones((4, 8, 4, 16)), NamedSharding(mesh, P("data", None, "tensor", None)))
f = jax.jit(jax.grad(lambda x, s: jnp.sum(rms_norm(x, s, 1e-6) ** 2), argnums=(0, 1)))
ln = jax.jit(jax.grad(lambda x, s, b: jnp.sum(layer_norm(x, s, b) ** 2), argnums=(0, 1, 2)))
print(json.dumps({"hlo_gathers": "all-gather" in f.lower(x, jnp.ones(16)).compile().as_text(),
                  "ln_gathers": "all-gather" in ln.lower(x, jnp.ones(16), jnp.ones(16)).compile().as_text()}))
""")
    assert out == {"hlo_gathers": False, "ln_gathers": False}
