"""LayerNorm and RMSNorm with a hand-written backward.

Plain autodiff of the textbook formulas differentiates every intermediate: the mean, the centred
input, its square, the variance and the rsqrt each get their own reductions and broadcasts in the
backward pass (a GPT-2 step carried ~40 backward reductions, most from its norms). The custom VJP
keeps the normalised input and the per-row 1/std from the forward and writes the input gradient
from two row means, dx = rstd * (gs - mean(gs) - xhat * mean(gs * xhat)) with gs = g * scale, which
XLA:CPU runs as a few fused passes (figures: BENCHMARKS.md). LayerNorm's bias is applied here too,
so that its gradient and the scale's come from one reduction over the two stacked: the incoming
gradient is read once, where XLA:GPU ran the two sums as separate kernels. Math in float32
whatever the input dtype; the gradient comes back in the input's dtype. `eps` is a Python float (a
static setting, not traced). The references are the plain formulas.
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp


def layer_norm_reference(x: jax.Array, scale: jax.Array, bias: jax.Array | None,
                         eps: float = 1e-5) -> jax.Array:
    x = x.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps) * scale
    return y + bias if bias is not None else y


def rms_norm_reference(x: jax.Array, scale: jax.Array, eps: float = 1e-5) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + eps) * scale


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array | None, eps: float = 1e-5) -> jax.Array:
    """LayerNorm over the last axis (float32 result); `bias` [D] like `scale`, or None (GPT-2
    without biases)."""
    if bias is not None and bias.shape != scale.shape:  # the custom VJP returns its gradient as [D]
        raise ValueError(f"LayerNorm bias of shape {bias.shape}, scale {scale.shape}: they must match")
    return _norm(x, scale, bias, eps, True)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-5) -> jax.Array:
    """RMSNorm (Llama): no centring and no bias; float32 result."""
    return _norm(x, scale, None, eps, False)


def _row_mean(a: jax.Array) -> jax.Array:
    return a.mean(-1, keepdims=True)


def _sum_rows(*arrays: jax.Array) -> jax.Array:
    """Each array summed over every axis but the last, as one reduction over them stacked: [n, D],
    the gradients of n [D] parameters, for which the arrays are read once. Reduced in place, not
    flattened first: merging sharded axes (batch, heads) would make XLA gather the whole array."""
    return jnp.stack(arrays).sum(tuple(range(1, arrays[0].ndim)))


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _norm(x, scale, bias, eps, centre):
    """scale * (x - mean) / std (+ bias) when `centre` (LayerNorm), else scale * x / rms (+ bias)."""
    return _norm_fwd(x, scale, bias, eps, centre)[0]


def _shift(x32: jax.Array) -> jax.Array:
    """A value within each row's spread, from elementwise work alone: the median of its first three
    entries, so that one outlier among them (trained GPT-2s carry a few huge residual dimensions)
    is never the shift."""
    if x32.shape[-1] < 3:
        return x32[..., :1]
    a, b, c = x32[..., 0:1], x32[..., 1:2], x32[..., 2:3]
    return jnp.maximum(jnp.minimum(a, b), jnp.minimum(jnp.maximum(a, b), c))


class RowStats(NamedTuple):
    """A norm's per-row statistics [..., 1] float32: 1/std (RMSNorm: 1/rms), and LayerNorm's shift
    and mean of x - shift (None for RMSNorm). The rows centred are (x - shift) - mean, in that
    order (gpt/ops/norm_kernel.py's backward recomputes them from x and these)."""
    rstd: jax.Array
    shift: jax.Array | None
    mean: jax.Array | None


def row_stats(x32: jax.Array, eps: float, centre: bool) -> tuple[jax.Array, RowStats]:
    """The rows centred (RMSNorm: as they are) and their statistics, from one pass: two sums that
    read x side by side (on a GPU one kernel, where a mean and then a variance of the centred rows
    were two; the decoding step's LayerNorm had three kernels). The rows are shifted first
    (`_shift`): E[d^2] - E[d]^2 cancels about (shift - mean)^2 / var of its digits, a few when the
    shift lies within the row's spread (the textbook one-pass formula, unshifted, would lose all of
    them to a mean far from zero), at worst D when the shift is the one outlier that dominates the
    row (two of the first three entries outliers). The centred row d - E[d] is never rounded
    through the mean itself (more exact than the two-pass formula for rows far from zero); a
    constant row gives exactly 0."""
    if not centre:
        return x32, RowStats(jax.lax.rsqrt(_row_mean(jnp.square(x32)) + eps), None, None)
    shift = _shift(x32)
    d = x32 - shift
    d_mean = _row_mean(d)
    var = jnp.maximum(_row_mean(jnp.square(d)) - jnp.square(d_mean), 0.0)
    return d - d_mean, RowStats(jax.lax.rsqrt(var + eps), shift, d_mean)


def norm_factors(x: jax.Array, eps: float, centre: bool) -> tuple[jax.Array, jax.Array]:
    """LayerNorm (`centre`) or RMSNorm in two factors: the rows centred (or as they are), float32,
    and their 1/std (1/rms) [..., 1]. The norm is xc * rstd * scale (+ bias).

    Decoding multiplies xc * scale by the next weight and applies rstd to the product's rows
    (gpt.model.Block.norm_in): on a GPU the 1/std, an rsqrt, kept XLA from fusing the normalisation
    into the one-row product that reads it (it would be recomputed for every weight element), so it
    was a kernel of its own; without it the product takes it in (kernel counts: BENCHMARKS.md)."""
    xc, stats = row_stats(x.astype(jnp.float32), eps, centre)
    return xc, stats.rstd


def normalize_rows(x: jax.Array, scale: jax.Array, bias: jax.Array | None, eps: float, centre: bool
                   ) -> tuple[jax.Array, jax.Array, RowStats]:
    """The norm in float32 (xhat * scale (+ bias)), the normalised rows xhat and their statistics."""
    xc, stats = row_stats(x.astype(jnp.float32), eps, centre)
    xhat = xc * stats.rstd
    return (xhat * scale if bias is None else xhat * scale + bias), xhat, stats


def _norm_fwd(x, scale, bias, eps, centre):
    y, xhat, stats = normalize_rows(x, scale, bias, eps, centre)
    like = (jnp.zeros((), x.dtype), (None if bias is None else jnp.zeros((), bias.dtype)))
    return y, (xhat, stats.rstd, scale, like)


def _norm_bwd(eps, centre, res, g):
    xhat, rstd, scale, (like_x, like_bias) = res
    g = g.astype(jnp.float32)
    gs = g * scale
    dxhat = gs - _row_mean(gs) if centre else gs  # centring removes the gradient's row mean
    dx = rstd * (dxhat - xhat * _row_mean(gs * xhat))
    sums = _sum_rows(g * xhat, *(() if like_bias is None else (g,)))  # the scale's, the bias's
    dbias = None if like_bias is None else sums[1].astype(like_bias.dtype)
    return dx.astype(like_x.dtype), sums[0].astype(scale.dtype), dbias


_norm.defvjp(_norm_fwd, _norm_bwd)
