"""Dense layers: an einsum in the compute dtype with float32 accumulation, and a custom backward.

Plain autodiff of a bf16 einsum runs the backward matmuls in float32 (the cotangent's dtype) and, on
CPU, in layouts the fast kernels lack (XLA's own layout for a weight gradient transposed a
[B*T, 4D] cotangent in a slow loop). `dense` keeps every gradient matmul in the compute dtype and,
with `cpu_layouts`, as `a @ b` / `a @ b.T` products of flattened operands. Figures: BENCHMARKS.md.
Axis letters: M rows (the flattened free axes of x), C the contracted axes, N the weight's free axes.
"""
from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp


def dense_reference(x: jax.Array, w: jax.Array, spec: str, dtype, out_dtype=jnp.float32) -> jax.Array:
    """The reference: a plain einsum differentiated by JAX (what `dense` must agree with)."""
    return jnp.einsum(spec, x.astype(dtype), w.astype(dtype), preferred_element_type=out_dtype)


def dense(x: jax.Array, w: jax.Array, spec: str, dtype, cpu_layouts: bool = False,
          custom_vjp: bool = True, out_dtype=jnp.float32) -> jax.Array:
    """`dense_reference` with the custom backward (specs it does not cover keep the reference).

    `out_dtype`: what the product is written in (accumulation is float32 either way). A bf16
    result, as under PyTorch's autocast, halves the bytes of every activation between the matmuls
    and the elementwise work around them; float32 keeps the extra bits (the CPU's choice, where
    that traffic costs little next to the emulated or cache-blocked matmuls).
    """
    if not custom_vjp or _plan(spec) is None:
        return dense_reference(x, w, spec, dtype, out_dtype)
    return _dense_vjp(x, w, spec, jnp.dtype(dtype), cpu_layouts, jnp.dtype(out_dtype))


class _Plan(NamedTuple):
    x_free: str  # x's axes that stay (B, T): flattened to M
    contract: str  # contracted axes in x's order: flattened to C
    w_free: str  # w's axes that stay: flattened to N
    w_perm: tuple[int, ...]  # w's axes -> (contract, w_free): w as a [C, N] matrix


def _plan(spec: str) -> _Plan | None:
    """A dense spec "x,w->x_free w_free" with x's contracted axes trailing, or None."""
    try:
        ins, out = spec.replace(" ", "").split("->")
        xs, ws = ins.split(",")
    except ValueError:
        return None
    contract = "".join(c for c in xs if c in ws)
    x_free = "".join(c for c in xs if c not in ws)
    w_free = "".join(c for c in ws if c not in xs)
    if (len(set(xs + ws)) != len(xs) + len(ws) - len(contract) or not contract
            or xs != x_free + contract or out != x_free + w_free
            or any(c in contract for c in out)):
        return None
    return _Plan(x_free, contract, w_free, tuple(ws.index(c) for c in contract + w_free))


def physical_swap(a: jax.Array, cpu_layouts: bool) -> jax.Array:
    """Swap the last two axes; with `cpu_layouts`, materialised in row-major order.

    XLA would otherwise fold a transpose into the dot's dimension numbers (or a layout change),
    putting the contracted axis first: the slow path of the CPU's bf16 matmul. Going through an
    array with the last two axes merged (one layout only) behind an optimisation barrier forces
    the copy. Leading axes stay separate, so their sharding (batch, heads) survives.
    """
    if not cpu_layouts:
        return jnp.swapaxes(a, -1, -2)
    *lead, M, N = a.shape
    return jax.lax.optimization_barrier(
        jnp.swapaxes(a, -1, -2).reshape(*lead, N * M)).reshape(*lead, N, M)


def mm(a: jax.Array, b: jax.Array, spec: str, out_dtype=jnp.float32) -> jax.Array:
    return jnp.einsum(spec, a, b, preferred_element_type=out_dtype)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _dense_vjp(x, w, spec, dtype, cpu_layouts, out_dtype):
    return _dense_fwd(x, w, spec, dtype, cpu_layouts, out_dtype)[0]


def _dense_fwd(x, w, spec, dtype, cpu_layouts, out_dtype):
    # Zero-size arrays carry the primal shapes and dtypes to the backward pass for free.
    shapes = (jnp.zeros((*x.shape, 0), x.dtype), jnp.zeros((*w.shape, 0), w.dtype))
    x, w = x.astype(dtype), w.astype(dtype)
    if not cpu_layouts:  # GPU/TPU matmuls take any layout; the original axes keep their sharding
        return mm(x, w, spec, out_dtype), (x, w, shapes)
    p = _plan(spec)
    n_free = len(p.x_free)
    x_MC = x.reshape(math.prod(x.shape[:n_free]), -1)
    w_t = jnp.transpose(w, p.w_perm)  # weight-sized; the identity for most specs
    w_CN = w_t.reshape(x_MC.shape[1], -1)
    y = mm(x_MC, w_CN, "mc,cn->mn", out_dtype).reshape(*x.shape[:n_free], *w_t.shape[len(p.contract):])
    return y, (x_MC, w_CN, shapes)


def _dense_bwd(spec, dtype, cpu_layouts, out_dtype, res, g):
    """dx = g @ w.T and dw = x.T @ g in the compute dtype; on CPU as `a @ b` / `a @ b.T` products.

    The cotangent is rounded to the compute dtype (as it would be for a bf16 result). The weight
    gradient contracts over the M rows of both operands, the layout the CPU's fast kernels lack;
    there it is computed from a physically transposed copy of the narrower of x and g (an
    [M, min(C, N)] copy, cheap next to the 2*M*C*N FLOP product), and a weight-sized result is
    transposed back. The input gradient is written in `out_dtype` (like the forward's product),
    the weight gradient in float32.
    """
    x_res, w_res, (x_shape, w_shape) = res
    g = g.astype(dtype)
    if not cpu_layouts:
        xs, ws, out = spec.replace(" ", "").replace("->", ",").split(",")
        dx, dw = mm(g, w_res, f"{out},{ws}->{xs}", out_dtype), mm(x_res, g, f"{xs},{out}->{ws}")
        return dx.astype(x_shape.dtype), dw.astype(w_shape.dtype)
    p = _plan(spec)
    (M, C), N = x_res.shape, w_res.shape[1]
    g_MN = g.reshape(M, N)
    dx_MC = mm(g_MN, w_res, "mn,cn->mc", out_dtype)
    # The barriers keep XLA from folding the transposes that follow into the dot by swapping its
    # operands, which would bring back the slow layout (and XLA:CPU's fallback dot has no
    # bf16 x bf16 -> f32 kernel: it fails at run time).
    if C <= N:
        dw_CN = jax.lax.optimization_barrier(mm(physical_swap(x_res, True), g_MN, "cm,mn->cn"))
    else:
        dw_CN = jax.lax.optimization_barrier(mm(physical_swap(g_MN, True), x_res, "nm,mc->nc")).T
    w_t_shape = tuple(w_shape.shape[i] for i in p.w_perm)
    inv = tuple(p.w_perm.index(i) for i in range(len(p.w_perm)))
    dw = jnp.transpose(dw_CN.reshape(w_t_shape), inv).astype(w_shape.dtype)
    dx = dx_MC.reshape(x_shape.shape[:-1]).astype(x_shape.dtype)
    return dx, dw


_dense_vjp.defvjp(_dense_fwd, _dense_bwd)


# ----------------------------------------------------------------------------- decoding

FEW_ROWS = 32  # products of 2..FEW_ROWS rows run as multiply-and-reduce in `decode_dense`


def contract_last(spec: str) -> tuple[tuple[int, ...], str]:
    """(permutation of the weight, spec of the permuted weight) that put a dense spec's contracted
    axes last: "btd,df->btf" gives ((1, 0), "btd,fd->btf"), the [out, in] layout of `decode_dense`."""
    p = _plan(spec)
    if p is None:
        raise ValueError(f"not a dense spec: {spec}")
    ws = spec.replace(" ", "").split("->")[0].split(",")[1]
    w_t = p.w_free + p.contract
    return tuple(ws.index(c) for c in w_t), f"{p.x_free}{p.contract},{w_t}->{p.x_free}{p.w_free}"


def decode_dense(x: jax.Array, w: jax.Array, spec: str, dtype, out_dtype=jnp.float32,
                 few_rows: bool = True) -> jax.Array:
    """x times a weight held with its contracted axes last (`contract_last`; `gpt.model.for_decoding`
    holds the weights so on CPU and GPU): the forward of a decoding step, without a backward.

    Decoding multiplies one to a few rows (a batch, or the K+1 tokens of a speculative verify) by
    every weight, which is read from memory once per step. One row takes XLA:CPU's matrix-vector
    kernel, which streams the weight; from two rows on a dot becomes a GEMM that packs the weight
    first and reads it at a fraction of the bandwidth, so 5 rows cost about 3 single-row steps.
    Written as a product and a sum over the last axis of an [N, M, C] array, 2..FEW_ROWS rows are
    one fusion that streams each weight row once for all M rows (`few_rows`: XLA:CPU's case; a GPU
    runs them as a GEMM). Figures: BENCHMARKS.md.
    `spec` may name either layout; the weight must be the permuted one.
    """
    p = _plan(contract_last(spec)[1])
    free_shape, n_w_free = x.shape[:len(p.x_free)], len(p.w_free)
    M = math.prod(free_shape)
    x_MC = x.reshape(M, -1).astype(dtype)
    w_NC = w.reshape(math.prod(w.shape[:n_w_free]), -1).astype(dtype)
    # Flattened either way: an einsum over the [out..., in...] axes would have XLA copy the
    # weight back into [in, out] order on every call.
    if few_rows and 2 <= M <= FEW_ROWS:
        y_MN = _few_rows(x_MC, w_NC, out_dtype)
    else:
        y_MN = mm(x_MC, w_NC, "mc,nc->mn", out_dtype)
    return y_MN.reshape(*free_shape, *w.shape[:n_w_free])


@partial(jax.jit, static_argnums=2)  # inside a jit: one fusion; called eagerly, no [N, M, C] array
def _few_rows(x_MC: jax.Array, w_NC: jax.Array, out_dtype) -> jax.Array:
    y_NM = jnp.sum(w_NC[:, None, :].astype(jnp.float32) * x_MC[None].astype(jnp.float32), axis=-1)
    return y_NM.T.astype(out_dtype)
