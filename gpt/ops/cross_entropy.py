"""Mean next-token cross-entropy with a one-pass backward.

The loss is computed in float32 whatever the logits' dtype. Plain autodiff of `logsumexp` and
`take_along_axis` materialises a float32 copy of the [B, T, V] logits for the backward, writes a
float32 gradient, scatters into it for the targets and converts the result to the matmul's dtype:
four passes over the largest array of the step (GPT-2 at batch 16 x 1024: 824M entries; the GPU
figures are in BENCHMARKS.md). The custom backward keeps the logits as they came (bf16
from a bf16 head) and the per-row logsumexp, and writes softmax - one-hot in the logits' dtype in one
elementwise pass. The forward's logsumexp is a max pass then a sum-of-exp pass over the logits, or
with `one_pass` a single reduction of (max, rescaled sum) pairs: on a GPU it reads the [B, T, V]
logits once instead of twice (GPT-2 at batch 64 x 1024: 6.6 GB less per step), while on XLA:CPU,
whose variadic reductions are not vectorised, it was slower (`gpt.runtime.Runtime.lse_one_pass`
decides; figures in BENCHMARKS.md).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def cross_entropy_reference(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """The reference: plain float32 formulas differentiated by JAX."""
    logits_BTV = logits_BTV.astype(jnp.float32)
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return jnp.mean(lse_BT - target_BT)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array, one_pass: bool = False) -> jax.Array:
    """Mean cross-entropy of `logits_BTV` [..., V] (any float dtype; entries that are -inf, such as
    a padded vocabulary's, get probability 0; a row that is all -inf gives NaN, as the reference
    does) against integer `targets_BT` [...]. `one_pass`: the logsumexp as one reduction (a static
    choice, `Runtime.lse_one_pass`). Reverse-mode only (a custom VJP)."""
    return _fwd(logits_BTV, targets_BT, one_pass)[0]


def _lse(logits_BTV: jax.Array) -> jax.Array:
    """Per-row logsumexp in float32, reading the logits in their own dtype: a max, then a sum."""
    m_BT = jnp.max(logits_BTV, axis=-1).astype(jnp.float32)
    m_BT = jnp.where(jnp.isfinite(m_BT), m_BT, 0.0)
    s_BT = jnp.sum(jnp.exp(logits_BTV.astype(jnp.float32) - m_BT[..., None]), axis=-1)
    return m_BT + jnp.log(s_BT)


def _max_and_sum(a, b):
    """Two (max, sum of exp(x - max)) pairs as one: the smaller max's sum rescaled by one exp.
    Equal maxima (infinite ones too: exp(inf - inf) would be NaN) add their sums, so the combiner
    is commutative with (-inf, 0) as its identity, as XLA's reductions need."""
    (ma, sa), (mb, sb) = a, b
    e = jnp.where(ma == mb, 1.0, jnp.exp(jnp.minimum(ma, mb) - jnp.maximum(ma, mb)))
    return jnp.maximum(ma, mb), jnp.where(ma >= mb, sa + sb * e, sa * e + sb)


def _lse_one_pass(logits_BTV: jax.Array) -> jax.Array:
    """`_lse` as one reduction over the logits: each entry x starts as the pair (x, 1). The max is
    never subtracted from anything afterwards, so an infinite one needs no guard: an all -inf row
    gives -inf, a row with +inf gives +inf, as the reference does. First-order reverse mode only
    (the variadic reduce has no second derivative in JAX)."""
    x = logits_BTV.astype(jnp.float32)
    init = (jnp.float32(-jnp.inf), jnp.float32(0.0))
    m_BT, s_BT = jax.lax.reduce((x, jnp.ones_like(x)), init, _max_and_sum, (x.ndim - 1,))
    return m_BT + jnp.log(s_BT)


def _fwd(logits_BTV, targets_BT, one_pass):
    lse_BT = (_lse_one_pass if one_pass else _lse)(logits_BTV)
    target_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    loss = jnp.mean(lse_BT - target_BT.astype(jnp.float32))
    return loss, (logits_BTV, targets_BT, lse_BT)


def _bwd(one_pass, res, g):
    logits_BTV, targets_BT, lse_BT = res
    V = logits_BTV.shape[-1]
    scale = g / targets_BT.size
    p_BTV = jnp.exp(logits_BTV.astype(jnp.float32) - lse_BT[..., None])
    onehot_BTV = jnp.arange(V, dtype=jnp.int32) == targets_BT[..., None]
    d_BTV = ((p_BTV - onehot_BTV) * scale).astype(logits_BTV.dtype)
    return d_BTV, None


cross_entropy.defvjp(_fwd, _bwd)
