"""gpt.ops.cross_entropy: the one-pass backward, with either logsumexp (two passes, or one
reduction: `one_pass`), against plain autodiff of the float32 formulas."""
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


@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("bfloat16", 1e-6)])
def test_value_and_gradient_match_reference(dtype, tol, one_pass):
    logits, targets = _logits(jnp.dtype(dtype))
    f = jax.jit(jax.value_and_grad(lambda l, t: cross_entropy(l, t, one_pass)))
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


@pytest.mark.parametrize("one_pass", [False, True])
def test_huge_logits_stay_finite(one_pass):
    logits = jnp.array([[[1e30, -1e30, 0.0], [-jnp.inf, 50.0, 50.0]]], jnp.float32)
    targets = jnp.array([[0, 2]])
    loss, g = jax.value_and_grad(cross_entropy)(logits, targets, one_pass)
    np.testing.assert_allclose(float(loss), np.log(2) / 2, rtol=1e-5)
    assert np.all(np.isfinite(np.asarray(g)))


def test_one_pass_logsumexp_is_the_two_pass_one():
    """The one-reduction logsumexp (a tree of (max, rescaled sum) pairs, in whatever order XLA
    combines them) equals the max-then-sum one: wide rows over a large range, rows with -inf
    entries first, last or throughout, a row of equal entries, and an all -inf row (NaN loss
    either way, as the reference)."""
    from gpt.ops.cross_entropy import _lse, _lse_one_pass
    k = jax.random.key(3)
    rows = 30 * jax.random.normal(k, (5, 50304))
    rows = rows.at[1, :40000].set(-jnp.inf).at[2, 10:].set(-jnp.inf).at[3].set(7.0)
    rows = jnp.concatenate([rows, jnp.full((1, 50304), -jnp.inf)])
    for dtype in (jnp.float32, jnp.bfloat16):
        x = rows.astype(dtype)
        a, b = jax.jit(_lse_one_pass)(x), jax.jit(_lse)(x)
        np.testing.assert_allclose(np.asarray(a[:5]), np.asarray(b[:5]), rtol=1e-6)
        assert float(a[5]) == float(b[5]) == -np.inf
    targets = jnp.zeros((6,), jnp.int32)
    assert all(np.isnan(float(cross_entropy(rows[5:], targets[5:], p))) for p in (False, True))


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


def test_training_takes_the_runtimes_logsumexp():
    """The training and evaluation losses pass the Runtime's choice on: one reduction (a variadic
    reduce) on a GPU, a max and a sum on CPU."""
    from flax import nnx

    from helpers import tiny_model_config, tiny_runtime
    from gpt.model import GPT
    from gpt.train import loss_fn
    cfg = tiny_model_config()
    x = jnp.zeros((1, 8), jnp.int32)
    for backend, one_pass in (("cpu", False), ("gpu", True)):
        rt = tiny_runtime(cfg, backend, attention="reference")
        assert rt.lse_one_pass == one_pass
        gd, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0), runtime=rt))
        jaxpr = str(jax.make_jaxpr(lambda p: loss_fn(gd, p, x, x))(params))
        assert ("reduce[" in jaxpr) == one_pass, backend  # a variadic reduce: the pairs
