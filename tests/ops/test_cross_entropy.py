"""gpt.ops.cross_entropy: the one-pass backward against plain autodiff of the float32 formulas."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt.ops.cross_entropy import cross_entropy, cross_entropy_reference


def _logits(dtype, shape=(3, 7, 37), valid=31):
    """Random logits with a padded vocabulary (entries >= valid are -inf), and targets."""
    k1, k2 = jax.random.split(jax.random.key(0))
    logits = (4 * jax.random.normal(k1, shape)).astype(dtype)
    logits = jnp.where(jnp.arange(shape[-1]) < valid, logits, -jnp.inf)
    return logits, jax.random.randint(k2, shape[:-1], 0, valid)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("bfloat16", 1e-6)])
def test_value_and_gradient_match_reference(dtype, tol):
    logits, targets = _logits(jnp.dtype(dtype))
    f = jax.jit(jax.value_and_grad(cross_entropy))
    (a, ga), (b, gb) = f(logits, targets), jax.value_and_grad(cross_entropy_reference)(logits, targets)
    assert a.dtype == jnp.float32 and ga.dtype == logits.dtype
    np.testing.assert_allclose(float(a), float(b), rtol=1e-6)
    ga, gb = np.asarray(ga, np.float32), np.asarray(gb, np.float32)
    assert np.all(ga[..., 31:] == 0) and np.all(np.isfinite(ga))  # padded entries: no gradient
    assert np.max(np.abs(ga - gb)) <= tol * 10 + 1e-2 * np.max(np.abs(gb)) * (dtype == "bfloat16")
    np.testing.assert_allclose(ga.sum(-1), 0, atol=1e-3 if dtype == "bfloat16" else 1e-7)


def test_is_the_mean_negative_log_likelihood():
    logits, targets = _logits(jnp.float32, (2, 4, 5), 5)
    logp = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
    nll = -np.take_along_axis(np.asarray(logp), np.asarray(targets)[..., None], -1).mean()
    np.testing.assert_allclose(float(cross_entropy(logits, targets)), nll, rtol=1e-6)
    g = jax.grad(cross_entropy)(logits, targets) * targets.size  # softmax - one-hot per row
    np.testing.assert_allclose(np.asarray(g), np.exp(logp) - np.eye(5)[np.asarray(targets)], atol=1e-6)


def test_huge_logits_stay_finite():
    logits = jnp.array([[[1e30, -1e30, 0.0], [-jnp.inf, 50.0, 50.0]]], jnp.float32)
    targets = jnp.array([[0, 2]])
    loss, g = jax.value_and_grad(cross_entropy)(logits, targets)
    np.testing.assert_allclose(float(loss), np.log(2) / 2, rtol=1e-5)
    assert np.all(np.isfinite(np.asarray(g)))


def test_cotangent_scales_and_targets_on_padding():
    """A loss scaled by g scales the gradient by g; a target on a padded (-inf) entry gives an
    infinite loss, as the reference does (never a silent finite number)."""
    logits, targets = _logits(jnp.float32)
    g1 = jax.grad(lambda l: 3.0 * cross_entropy(l, targets))(logits)
    g2 = jax.grad(lambda l: 3.0 * cross_entropy_reference(l, targets))(logits)
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), atol=1e-7)
    bad = targets.at[0, 0].set(35)
    assert float(cross_entropy(logits, bad)) == float(cross_entropy_reference(logits, bad)) == np.inf


def test_training_loss_takes_it():
    from flax import nnx

    from helpers import tiny_model_config
    from gpt.model import GPT
    from gpt.train import loss_fn
    cfg = tiny_model_config()
    gd, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)))
    x = jnp.zeros((1, 8), jnp.int32)
    jaxpr = str(jax.make_jaxpr(lambda p: loss_fn(gd, p, x, x))(params))
    assert "name=cross_entropy" in jaxpr
