"""Mean next-token cross-entropy with a one-pass backward.

The loss is computed in float32 whatever the logits' dtype. Plain autodiff of `logsumexp` and
`take_along_axis` materialises a float32 copy of the [B, T, V] logits for the backward, writes a
float32 gradient, scatters into it for the targets and converts the result to the matmul's dtype:
four passes over the largest array of the step (GPT-2 at batch 16 x 1024: 824M entries; the GPU
figures are in BENCHMARKS.md). The custom backward keeps the logits as they came (bf16
from a bf16 head) and the per-row logsumexp, and writes softmax - one-hot in the logits' dtype in one
elementwise pass.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy_reference(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """The reference: plain float32 formulas differentiated by JAX."""
    logits_BTV = logits_BTV.astype(jnp.float32)
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return jnp.mean(lse_BT - target_BT)


@jax.custom_vjp
def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Mean cross-entropy of `logits_BTV` [..., V] (any float dtype; entries that are -inf, such as
    a padded vocabulary's, get probability 0; a row that is all -inf gives NaN, as the reference
    does) against integer `targets_BT` [...]. Reverse-mode only (a custom VJP)."""
    return _fwd(logits_BTV, targets_BT)[0]


def _lse(logits_BTV: jax.Array) -> jax.Array:
    """Per-row logsumexp in float32, reading the logits in their own dtype."""
    m_BT = jnp.max(logits_BTV, axis=-1).astype(jnp.float32)
    m_BT = jnp.where(jnp.isfinite(m_BT), m_BT, 0.0)
    s_BT = jnp.sum(jnp.exp(logits_BTV.astype(jnp.float32) - m_BT[..., None]), axis=-1)
    return m_BT + jnp.log(s_BT)


def _fwd(logits_BTV, targets_BT):
    lse_BT = _lse(logits_BTV)
    target_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    loss = jnp.mean(lse_BT - target_BT.astype(jnp.float32))
    return loss, (logits_BTV, targets_BT, lse_BT)


def _bwd(res, g):
    logits_BTV, targets_BT, lse_BT = res
    V = logits_BTV.shape[-1]
    scale = g / targets_BT.size
    p_BTV = jnp.exp(logits_BTV.astype(jnp.float32) - lse_BT[..., None])
    onehot_BTV = jnp.arange(V, dtype=jnp.int32) == targets_BT[..., None]
    d_BTV = ((p_BTV - onehot_BTV) * scale).astype(logits_BTV.dtype)
    return d_BTV, None


cross_entropy.defvjp(_fwd, _bwd)
