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
    entries first, last or scattered, a row of equal entries, a row at float32's limits; and as
    the reference at the edges: an all -inf row (-inf: a NaN loss either way), one or two +inf
    (+inf), a NaN (NaN)."""
    from gpt.ops.cross_entropy import _lse, _lse_one_pass
    k = jax.random.key(3)
    rows = 30 * jax.random.normal(k, (6, 50304))
    rows = rows.at[1, :40000].set(-jnp.inf).at[2, 10:].set(-jnp.inf).at[3].set(7.0)
    rows = rows.at[4, ::7].set(-jnp.inf).at[5, :2].set(jnp.array([3.4e38, -3.4e38]))
    for dtype in (jnp.float32, jnp.bfloat16):
        x = rows.astype(dtype)
        a, b = jax.jit(_lse_one_pass)(x), jax.jit(_lse)(x)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    inf, nan = jnp.inf, jnp.nan
    edges = jnp.array([[-inf, -inf, -inf], [0.0, inf, 1.0], [inf, 0.0, inf], [0.0, nan, 1.0]])
    got, ref = jax.jit(_lse_one_pass)(edges), jax.nn.logsumexp(edges, axis=-1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))  # -inf, inf, inf, nan
    targets = jnp.zeros((1,), jnp.int32)
    assert all(np.isnan(float(cross_entropy(edges[:1], targets, p))) for p in (False, True))


def test_max_and_sum_is_a_reduction_combiner():
    """XLA may combine the pairs in any order and start from the identity anywhere: the combiner
    is commutative, associative up to rounding, and (-inf, 0) leaves a pair as it is, -inf and
    +inf maxima included."""
    from gpt.ops.cross_entropy import _max_and_sum
    inf = np.inf
    pairs = [(-inf, 0.0), (-inf, 1.0), (-inf, 2.0), (0.0, 1.0), (3.0, 2.0), (inf, 1.0), (1e30, 1.0)]
    as_np = lambda p: tuple(float(np.float32(v)) for v in p)  # noqa: E731
    pairs = [as_np(p) for p in pairs]
    f = jax.jit(_max_and_sum)
    for a in pairs:
        assert as_np(f(a, (-inf, 0.0))) == as_np(f((-inf, 0.0), a)) == a
        for b in pairs:
            assert as_np(f(a, b)) == as_np(f(b, a)), (a, b)
            for c in pairs:
                ab_c, a_bc = as_np(f(f(a, b), c)), as_np(f(a, f(b, c)))
                assert ab_c[0] == a_bc[0] and np.isclose(ab_c[1], a_bc[1], rtol=1e-6), (a, b, c)


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


@pytest.mark.parametrize("caller", ["loss_fn", "objective"])
def test_training_takes_the_runtimes_logsumexp(caller):
    """The training step's objective and the evaluation loss pass the Runtime's choice on: one
    reduction (a variadic reduce) on a GPU, a max and a sum on CPU; and the training objective's
    value and gradient are the same either way."""
    from flax import nnx

    from helpers import tiny_model_config, tiny_runtime
    from gpt import train
    from gpt.model import GPT
    cfg = tiny_model_config(vocab_size=61)  # a padded vocabulary: -inf logits
    x = jax.random.randint(jax.random.key(0), (2, 8), 0, 61)
    results = {}
    for backend, one_pass in (("cpu", False), ("gpu", True)):
        rt = tiny_runtime(cfg, backend, attention="reference")
        assert rt.lse_one_pass == one_pass
        model = GPT(cfg, rngs=nnx.Rngs(0), runtime=rt)
        gd, params = nnx.split(model)
        fn = (lambda p: train.loss_fn(gd, p, x, x)) if caller == "loss_fn" else \
            (lambda p: train.objective(gd, p, x, x)[0])
        jaxpr = str(jax.make_jaxpr(fn)(params))
        assert ("reduce[" in jaxpr) == one_pass, backend  # a variadic reduce: the pairs
        results[backend] = jax.jit(jax.value_and_grad(fn))(params)
    if results:
        (la, ga), (lb, gb) = results["cpu"], results["gpu"]
        np.testing.assert_allclose(float(la), float(lb), rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), ga, gb)


@pytest.mark.parametrize("chunks", [1, 3, 7, 10])
@pytest.mark.parametrize("one_pass", [False, True])
def test_linear_cross_entropy_is_the_head_then_the_loss(chunks, one_pass):
    """linear_cross_entropy(h, w, y) == cross_entropy of the padded-vocabulary logits h @ w^T, in
    value and in both gradients, for any number of chunks of T (more than T too)."""
    from gpt.ops.cross_entropy import LinearCE, linear_cross_entropy
    k = jax.random.split(jax.random.key(3), 3)
    h, w = jax.random.normal(k[0], (3, 7, 16)), 0.5 * jax.random.normal(k[1], (40, 16))
    y = jax.random.randint(k[2], (3, 7), 0, 37)

    def reference(h, w):
        logits = jnp.where(jnp.arange(40) < 37, jnp.einsum("btd,vd->btv", h, w), -jnp.inf)
        return cross_entropy_reference(logits, y)
    s = LinearCE(chunks, 37, jnp.dtype("float32"), jnp.dtype("float32"), one_pass)
    fn = lambda h, w: linear_cross_entropy(h, w, y, s)  # noqa: E731
    value, grads = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(h, w)
    ref_value, ref_grads = jax.value_and_grad(reference, argnums=(0, 1))(h, w)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-6)
    np.testing.assert_allclose(float(jax.jit(fn)(h, w)), float(ref_value), rtol=1e-6)  # no gradient
    for g, ref in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), atol=1e-6)


def test_linear_cross_entropy_in_bf16():
    """Products in bf16 (float32 accumulation) and bf16 chunk logits, as on a GPU: within bf16's
    rounding of the float32 result; the gradients keep their inputs' dtypes."""
    from gpt.ops.cross_entropy import LinearCE, linear_cross_entropy
    k = jax.random.split(jax.random.key(4), 3)
    h, w = jax.random.normal(k[0], (2, 8, 32)).astype(jnp.bfloat16), 0.3 * jax.random.normal(k[1], (64, 32))
    y = jax.random.randint(k[2], (2, 8), 0, 64)
    f32, bf16 = jnp.dtype("float32"), jnp.dtype("bfloat16")
    exact = jax.value_and_grad(lambda h, w: linear_cross_entropy(h, w, y, LinearCE(2, 64, f32, f32)),
                               argnums=(0, 1))(h.astype(f32), w)
    s = LinearCE(2, 64, bf16, bf16)
    value, (gh, gw) = jax.value_and_grad(lambda h, w: linear_cross_entropy(h, w, y, s), argnums=(0, 1))(h, w)
    assert gh.dtype == jnp.bfloat16 and gw.dtype == jnp.float32
    np.testing.assert_allclose(float(value), float(exact[0]), rtol=2e-2)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(exact[1][1]), atol=2e-3)
    np.testing.assert_allclose(np.asarray(gh, np.float32), np.asarray(exact[1][0]), atol=2e-3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cross_entropy_rows_is_cross_entropy_of_the_masked_logits(dtype):
    """cross_entropy_rows over unmasked logits of a padded vocabulary == cross_entropy over the
    masked ones: the value without a gradient (XLA's path), the value and the gradient through
    the kernel (Pallas's interpreter), written in the logits' dtype, and a gradient scaled by an
    incoming one other than 1."""
    from gpt.ops.cross_entropy import cross_entropy_rows
    k = jax.random.split(jax.random.key(5), 2)
    logits = (3.0 * jax.random.normal(k[0], (2, 6, 40))).astype(dtype)
    y = jax.random.randint(k[1], (2, 6), 0, 37)
    masked = jnp.where(jnp.arange(40) < 37, logits, -jnp.inf)
    rows = lambda a: cross_entropy_rows(a, y, 37, False, True)  # noqa: E731
    want, want_grad = jax.value_and_grad(lambda a: 3.0 * cross_entropy(a, y))(masked)
    assert "pallas_call" not in str(jax.make_jaxpr(rows)(logits))  # evaluation: XLA's path
    assert "pallas_call" in str(jax.make_jaxpr(jax.grad(rows))(logits))
    np.testing.assert_allclose(float(rows(logits)), float(want) / 3, rtol=1e-6)
    value, grad = jax.value_and_grad(lambda a: 3.0 * rows(a))(logits)
    assert grad.dtype == logits.dtype and not np.any(np.asarray(grad)[..., 37:])
    np.testing.assert_allclose(float(value), float(want), rtol=1e-6)
    atol = 1e-6 if dtype == "float32" else 3e-3
    np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(want_grad, np.float32), atol=atol)
