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
decides; figures in BENCHMARKS.md). `cross_entropy_rows` takes the logsumexp, the target's logit
and the gradient from one kernel instead (gpt/ops/xent_kernel.py), in the forward pass.
"""
from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gpt.ops.xent_kernel import xent_rows


def cross_entropy_reference(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """The reference: plain float32 formulas differentiated by JAX."""
    logits_BTV = logits_BTV.astype(jnp.float32)
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return jnp.mean(lse_BT - target_BT)


def mask_padded(logits_BTV: jax.Array, vocab: int) -> jax.Array:
    """The logits with the entries from `vocab` on (a padded vocabulary's) -inf: probability 0."""
    return jnp.where(jnp.arange(logits_BTV.shape[-1]) < vocab, logits_BTV, -jnp.inf)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array, one_pass: bool = False) -> jax.Array:
    """Mean cross-entropy of `logits_BTV` [..., V] (any float dtype; entries that are -inf, such as
    a padded vocabulary's, get probability 0; a row that is all -inf gives NaN, as the reference
    does) against integer `targets_BT` [...] in [0, V): there is no ignore id (the data has no
    padding), and one out of range gets a loss and a gradient that disagree (take_along_axis wraps
    it, the one-hot misses it). `one_pass`: the logsumexp as one reduction (a static
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


def _lse_and_target(logits_BTV, targets_BT, one_pass: bool):
    """Each row's logsumexp and its target's logit, both float32."""
    lse_BT = (_lse_one_pass if one_pass else _lse)(logits_BTV)
    target_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return lse_BT, target_BT.astype(jnp.float32)


def _softmax_minus_onehot(logits_BTV, lse_BT, targets_BT, scale, dtype):
    """The gradient of the loss with respect to the logits, (softmax - one-hot) * scale, in one
    elementwise pass written in `dtype`."""
    p_BTV = jnp.exp(logits_BTV.astype(jnp.float32) - lse_BT[..., None])
    onehot_BTV = jnp.arange(logits_BTV.shape[-1], dtype=jnp.int32) == targets_BT[..., None]
    return ((p_BTV - onehot_BTV) * scale).astype(dtype)


def _fwd(logits_BTV, targets_BT, one_pass):
    lse_BT, target_BT = _lse_and_target(logits_BTV, targets_BT, one_pass)
    return jnp.mean(lse_BT - target_BT), (logits_BTV, targets_BT, lse_BT)


def _bwd(one_pass, res, g):
    logits_BTV, targets_BT, lse_BT = res
    return _softmax_minus_onehot(logits_BTV, lse_BT, targets_BT, g / targets_BT.size, logits_BTV.dtype), None


cross_entropy.defvjp(_fwd, _bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def cross_entropy_rows(logits_BTV: jax.Array, targets_BT: jax.Array, vocab: int, one_pass: bool = False,
                       interpret: bool = False) -> jax.Array:
    """`cross_entropy` of logits whose entries from `vocab` on are a padded vocabulary's, not yet
    masked (the kernel masks them as it reads, where a mask of its own would be a pass over the
    logits). With a gradient, gpt/ops/xent_kernel.py's kernel (Pallas's interpreter with
    `interpret`) writes (softmax - one-hot) / N in the forward pass from the same read that gives
    the logsumexp, and keeps it in place of the logits: the backward only scales it by the
    incoming gradient, which under jax.grad is the constant 1 that XLA folds away. Without a
    gradient (evaluation) it is `cross_entropy`'s XLA path. First-order reverse mode only: a
    second derivative would differentiate the pallas_call, which Pallas cannot (it fails there)."""
    return cross_entropy(mask_padded(logits_BTV, vocab), targets_BT, one_pass)


def _rows_fwd(logits_BTV, targets_BT, vocab, one_pass, interpret):
    V, n = logits_BTV.shape[-1], targets_BT.size
    lse_R, target_R, d_RV = xent_rows(logits_BTV.reshape(-1, V), targets_BT.reshape(-1),
                                      jnp.full((n,), 1.0 / n, jnp.float32), vocab, interpret=interpret)
    return jnp.mean(lse_R - target_R), d_RV.reshape(logits_BTV.shape)


def _rows_bwd(vocab, one_pass, interpret, d_BTV, g):
    return g.astype(d_BTV.dtype) * d_BTV, None  # (a constant 1 under jax.grad: no pass at all)


cross_entropy_rows.defvjp(_rows_fwd, _rows_bwd)


class LinearCE(NamedTuple):
    """The static settings of `linear_cross_entropy`."""
    chunks: int  # slices of T, each one's logits formed, scored and differentiated on its own
    vocab_size: int  # entries of the head beyond it (a padded vocabulary) get probability 0
    dtype: Any  # the products' compute dtype (float32 accumulation)
    logits_dtype: Any  # what each chunk's logits are written in (Runtime.matmul_out)
    one_pass: bool = False  # the logsumexp as one reduction (Runtime.lse_one_pass)


def linear_cross_entropy(h_BTD: jax.Array, w_VD: jax.Array, targets_BT: jax.Array, s: LinearCE) -> jax.Array:
    """Mean cross-entropy of the logits h @ w^T against `targets_BT` (in [0, V), as for
    `cross_entropy`), the head's product formed `s.chunks` slices of T at a time inside the loss,
    so that in more than one the [B, T, V] logits
    and their gradient are never whole in memory (as Liger's fused linear cross-entropy and MaxText's
    vocabulary tiling do). With a gradient, each chunk's softmax - one-hot is applied to
    both products of the head's backward in the forward pass (nothing is recomputed); what the
    backward gets is the two gradients, scaled by the incoming one. T need not divide into chunks: the
    last one is padded, its padding masked out. Reverse-mode only (a custom VJP)."""
    return _linear_ce(h_BTD, w_VD, targets_BT, s)


def _in_chunks(a_BT: jax.Array, k: int) -> jax.Array:
    """[B, T, ...] -> [k, B, C, ...] with C = ceil(T / k), zero-padded at the end of T."""
    B, T = a_BT.shape[:2]
    C = -(-T // k)
    a_BT = jnp.pad(a_BT, [(0, 0), (0, k * C - T)] + [(0, 0)] * (a_BT.ndim - 2))
    return jnp.moveaxis(a_BT.reshape(B, k, C, *a_BT.shape[2:]), 1, 0)


def _chunk_logits(h_BCD, w_VD, s: LinearCE) -> jax.Array:
    """One chunk's logits over the padded vocabulary, in s.logits_dtype (float32 sums)."""
    return jnp.einsum("bcd,vd->bcv", h_BCD.astype(s.dtype), w_VD,
                      preferred_element_type=jnp.float32).astype(s.logits_dtype)


def _chunk_terms(h_BCD, w_VD, y_BC, s: LinearCE):
    """One chunk's logits (padded vocabulary entries -inf), their logsumexp and the targets'."""
    logits_BCV = mask_padded(_chunk_logits(h_BCD, w_VD, s), s.vocab_size)
    return (logits_BCV, *_lse_and_target(logits_BCV, y_BC, s.one_pass))


def _chunk_gradient(h_BCD, w_VD, y_BC, scale_BC, s: LinearCE):
    """One chunk's logsumexp, target logits and (softmax - one-hot) * scale in the compute dtype."""
    logits_BCV, lse_BC, target_BC = _chunk_terms(h_BCD, w_VD, y_BC, s)
    d_BCV = _softmax_minus_onehot(logits_BCV, lse_BC, y_BC, scale_BC[..., None], s.dtype)
    return lse_BC, target_BC, d_BCV


def _chunked(h_BTD, w_VD, targets_BT, s: LinearCE):
    """The chunks' inputs: h, the targets and a mask of the real (unpadded) positions; the head in
    the compute dtype, cast once."""
    mask_BT = jnp.ones(targets_BT.shape, jnp.float32)
    return (_in_chunks(h_BTD, s.chunks), _in_chunks(targets_BT, s.chunks),
            _in_chunks(mask_BT, s.chunks)), w_VD.astype(s.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _linear_ce(h_BTD, w_VD, targets_BT, s: LinearCE):
    xs, w_VD = _chunked(h_BTD, w_VD, targets_BT, s)

    def body(total, x):
        h_BCD, y_BC, m_BC = x
        _, lse_BC, target_BC = _chunk_terms(h_BCD, w_VD, y_BC, s)
        return total + jnp.sum((lse_BC - target_BC) * m_BC), None

    total, _ = jax.lax.scan(body, jnp.float32(0.0), xs)
    return total / targets_BT.size


def _linear_ce_fwd(h_BTD, w_VD, targets_BT, s: LinearCE):
    xs, wc_VD = _chunked(h_BTD, w_VD, targets_BT, s)
    n = targets_BT.size

    def body(carry, x):
        total, dw_VD = carry
        h_BCD, y_BC, m_BC = x
        lse_BC, target_BC, d_BCV = _chunk_gradient(h_BCD, wc_VD, y_BC, m_BC / n, s)
        dh_BCD = jnp.einsum("bcv,vd->bcd", d_BCV, wc_VD, preferred_element_type=jnp.float32)
        dw_VD = dw_VD + jnp.einsum("bcv,bcd->vd", d_BCV, h_BCD.astype(s.dtype),
                                   preferred_element_type=jnp.float32)
        return (total + jnp.sum((lse_BC - target_BC) * m_BC), dw_VD), dh_BCD.astype(h_BTD.dtype)

    init = (jnp.float32(0.0), jnp.zeros(w_VD.shape, jnp.float32))
    (total, dw_VD), dh_KBCD = jax.lax.scan(body, init, xs)
    B, T = targets_BT.shape[:2]
    dh_BTD = jnp.moveaxis(dh_KBCD, 0, 1).reshape(B, -1, h_BTD.shape[-1])[:, :T]
    return total / n, (dh_BTD, dw_VD.astype(w_VD.dtype))


def _linear_ce_bwd(s, res, g):
    dh_BTD, dw_VD = res
    return (g * dh_BTD).astype(dh_BTD.dtype), (g * dw_VD).astype(dw_VD.dtype), None


_linear_ce.defvjp(_linear_ce_fwd, _linear_ce_bwd)
