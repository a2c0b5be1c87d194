"""GPT-2 style decoder-only Transformer in Flax NNX.

Shapes are suffixed with their axes: B batch, T time (queries), S key/cache slots, D width, H heads,
K head dim, F MLP width, V (padded) vocabulary, L layers.

Two choices shape this file:
- The per-layer parameters are stacked along a leading L axis and the layer loop is a `lax.scan`
  (fully unrolled unless `scan_layers`). One parameter layout therefore serves both the fast-compile
  scanned model and the unrolled one, checkpoints move between them, and sharding has one rule per
  parameter.
- Everything stateful is explicit: dropout takes a key argument and the KV cache is a pytree that goes
  in and comes out. The model holds parameters only, so `nnx.split` gives a pure pytree of arrays.
"""
from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend.random import threefry2x32_p

from gpt.config import ModelConfig

NEG_INF = -1e30  # finite "minus infinity" for attention masks, so fully masked rows stay finite


def compute_dtype(cfg: ModelConfig) -> jnp.dtype:
    if cfg.dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return jnp.dtype(cfg.dtype)


class KVCache(NamedTuple):
    """Preallocated keys/values of every layer plus where to write next.

    `index` is the number of slots written (shared by all rows); rows of different prompt lengths are
    left-padded, and `start_B` is each row's first real slot, so padding is never attended to and
    positions count from the row's first real token.
    """
    k_LBSHK: jax.Array
    v_LBSHK: jax.Array
    index: jax.Array  # int32 scalar
    start_B: jax.Array  # int32 [B]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, start_B: jax.Array | None = None,
               dtype=None) -> KVCache:
    shape = (cfg.n_layer, batch, max_len, cfg.n_head, cfg.head_dim)
    dtype = dtype or compute_dtype(cfg)
    start = jnp.zeros((batch,), jnp.int32) if start_B is None else jnp.asarray(start_B, jnp.int32)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.array(0, jnp.int32), start)


# ----------------------------------------------------------------------------- pure building blocks


def dense(x: jax.Array, w: jax.Array, spec: str, dtype) -> jax.Array:
    """Matmul in the compute dtype with float32 accumulation and a float32 result.

    It runs through `_dense_vjp`, whose custom VJP keeps the backward matmuls in the compute dtype
    (plain autodiff would run a bf16 model's in float32, the cotangent's dtype) and, on CPU, in
    the layouts the fast kernels take (see there); in float32 that alone made a shakespeare-char
    step 1.2-1.4x faster on CPU (XLA's own layout for the weight gradient transposed a [B*T, 4D]
    cotangent in a slow loop; BENCHMARKS.md). Specs it does not cover keep the plain einsum and its autodiff.
    """
    if _dense_plan(spec) is not None:
        return _dense_vjp(x, w, spec, jnp.dtype(dtype))
    return jnp.einsum(spec, x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)


def dense_einsum(x: jax.Array, w: jax.Array, spec: str, dtype) -> jax.Array:
    """The reference: a plain einsum differentiated by JAX (what `dense` must agree with)."""
    return jnp.einsum(spec, x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)


class _Plan(NamedTuple):
    x_free: str  # x's axes that stay (B, T): flattened to M
    contract: str  # contracted axes in x's order: flattened to K
    w_free: str  # w's axes that stay: flattened to N
    w_perm: tuple[int, ...]  # w's axes -> (contract, w_free): w as a [K, N] matrix


def _dense_plan(spec: str) -> _Plan | None:
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


def _cpu_layouts() -> bool:
    """Whether to force the layouts the CPU's fast matmuls take (flattened operands, physical
    transposes). GPU/TPU matmuls take any layout, and there the original axes keep their sharding
    (flattening [D, 3, H, K] would make XLA gather a head-sharded weight)."""
    return jax.default_backend() == "cpu"


def _physical_transpose(a_MK: jax.Array) -> jax.Array:
    """a.T materialised in row-major order.

    XLA would otherwise fold a transpose into the dot's dimension numbers (or into a layout change),
    which puts the contracted axis first: the slow path of the CPU's bf16 matmul. Going through a
    1-D array (which has only one layout) behind an optimisation barrier forces the copy.
    """
    M, K = a_MK.shape
    return jax.lax.optimization_barrier(a_MK.T.reshape(K * M)).reshape(K, M)


def _mm(a, b, spec):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dense_vjp(x, w, spec, dtype):
    return _dense_vjp_fwd(x, w, spec, dtype)[0]


def _dense_vjp_fwd(x, w, spec, dtype):
    # Zero-size arrays carry the primal shapes and dtypes to the backward pass for free.
    shapes = (jnp.zeros((*x.shape, 0), x.dtype), jnp.zeros((*w.shape, 0), w.dtype))
    x, w = x.astype(dtype), w.astype(dtype)
    if not _cpu_layouts():
        return _mm(x, w, spec), (x, w, shapes)
    p = _dense_plan(spec)
    n_free = len(p.x_free)
    x_MK = x.reshape(math.prod(x.shape[:n_free]), -1)
    w_t = jnp.transpose(w, p.w_perm)  # weight-sized; the identity for most specs
    w_KN = w_t.reshape(x_MK.shape[1], -1)
    y = _mm(x_MK, w_KN, "mk,kn->mn").reshape(*x.shape[:n_free], *w_t.shape[len(p.contract):])
    return y, (x_MK, w_KN, shapes)


def _dense_vjp_bwd(spec, dtype, res, g):
    """dx = g @ w.T and dw = x.T @ g in the compute dtype; on CPU as `a @ b` / `a @ b.T` products.

    The cotangent is rounded to the compute dtype (as it would be for a bf16 result). The weight
    gradient contracts over the M = B*T rows of both operands, the layout the CPU's fast kernels
    lack; there it is computed from a physically transposed copy of the narrower of x and g (an
    [M, min(K, N)] copy, cheap next to the 2*M*K*N FLOP product), and a weight-sized result is
    transposed back.
    """
    x_res, w_res, (x_shape, w_shape) = res
    g = g.astype(dtype)
    if not _cpu_layouts():
        xs, ws, out = spec.replace(" ", "").replace("->", ",").split(",")
        dx, dw = _mm(g, w_res, f"{out},{ws}->{xs}"), _mm(x_res, g, f"{xs},{out}->{ws}")
        return dx.astype(x_shape.dtype), dw.astype(w_shape.dtype)
    p = _dense_plan(spec)
    (M, K), N = x_res.shape, w_res.shape[1]
    g_MN = g.reshape(M, N)
    dx_MK = _mm(g_MN, w_res, "mn,kn->mk")
    # The barriers keep XLA from folding the transposes that follow into the dot by swapping its
    # operands, which would bring back the slow layout (and XLA:CPU's fallback dot has no
    # bf16 x bf16 -> f32 kernel: it fails at run time).
    if K <= N:
        dw_KN = jax.lax.optimization_barrier(_mm(_physical_transpose(x_res), g_MN, "km,mn->kn"))
    else:
        dw_KN = jax.lax.optimization_barrier(_mm(_physical_transpose(g_MN), x_res, "nm,mk->nk")).T
    w_t_shape = tuple(w_shape.shape[i] for i in p.w_perm)
    inv = tuple(p.w_perm.index(i) for i in range(len(p.w_perm)))
    dw = jnp.transpose(dw_KN.reshape(w_t_shape), inv).astype(w_shape.dtype)
    dx = dx_MK.reshape(x_shape.shape[:-1]).astype(x_shape.dtype)
    return dx, dw


_dense_vjp.defvjp(_dense_vjp_fwd, _dense_vjp_bwd)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array | None, eps: float = 1e-5) -> jax.Array:
    x = x.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps) * scale
    return y + bias if bias is not None else y


DROPOUT_LEVELS = 1 << 16  # dropout masks are drawn as 16-bit uniforms


def drop_rate(rate: float) -> float:
    """The dropout rate actually applied: `rate` rounded to a multiple of 2^-16 (within 8e-6)."""
    return min(round(rate * DROPOUT_LEVELS), DROPOUT_LEVELS - 1) / DROPOUT_LEVELS


def keep_mask(key: jax.Array | None, rate: float, shape, offset=None, full=None) -> jax.Array:
    """Dropout's keep mask (True with probability 1 - drop_rate(rate)); a scalar True without a
    key or at rate 0. With `offset` and `full`: the block of shape `shape` at `offset` of the mask
    of shape `full` (equal to slicing that mask; the last offset a multiple of 4).

    `jax.random.bernoulli` (one threefry output word and a float conversion per element) made the
    masks, attention's [B, H, T, T] above all, the largest cost of a CPU step with dropout. Here
    each threefry hash gives two 32-bit words, i.e. four 16-bit uniforms: 7x cheaper. Its counters
    are (row, column) iotas of the full mask's indices, so, as with jax's partitionable threefry, a
    sharded mask is computed shard by shard and equals the unsharded one (`lax.rng_bit_generator`
    is faster than `jax.random.bits` too, but XLA runs it whole on every device).
    """
    if key is None or rate == 0.0:
        return jnp.ones((), bool)
    full = tuple(shape) if full is None else tuple(full)
    offset = (0,) * len(shape) if offset is None else tuple(offset)
    assert offset[-1] % 4 == 0 and all(o + n <= f for o, n, f in zip(offset, shape, full)), offset
    *lead, n = shape
    words_shape = (*lead, (n + 3) // 4)
    iota = lambda axis: jax.lax.broadcasted_iota(jnp.uint32, words_shape, axis)
    row = jnp.zeros(words_shape, jnp.uint32)  # the flat index of the leading axes in `full`
    for axis in range(len(lead)):
        row = row * jnp.uint32(full[axis]) + iota(axis) + jnp.uint32(offset[axis])
    col = iota(len(lead)) + jnp.uint32(offset[-1] // 4)
    k = jax.random.bits(key, (2,), jnp.uint32)
    words = jnp.stack(threefry2x32_p.bind(k[0], k[1], row, col), axis=-1)
    u16 = jax.lax.bitcast_convert_type(words, jnp.uint16).reshape(*lead, -1)[..., :n]
    return u16 >= jnp.uint16(round(drop_rate(rate) * DROPOUT_LEVELS))


def _scale_kept(x: jax.Array, keep: jax.Array, rate: float) -> jax.Array:
    """x / (1 - rate) where kept, 0 where dropped; x itself at rate 0."""
    return jnp.where(keep, x / (1.0 - rate), 0.0) if rate > 0 else x


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    keep = keep_mask(key, rate, x.shape)
    if keep.ndim == 0:
        return x
    return _scale_kept(x, keep, drop_rate(rate)).astype(x.dtype)


def sinusoidal(positions: jax.Array, dim: int) -> jax.Array:
    """The fixed sin/cos position encoding of "Attention Is All You Need", interleaved."""
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    angles = positions[..., None].astype(jnp.float32) * inv_freq
    return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(*positions.shape, dim)


def attention_einsum(q_BTHK, k_BSHK, v_BSHK, mask_BTS, rate: float = 0.0, key=None) -> jax.Array:
    """Reference attention: scaled scores, mask, float32 softmax, (dropout), weighted values."""
    scale = 1.0 / math.sqrt(q_BTHK.shape[-1])
    scores_BHTS = jnp.einsum("bthk,bshk->bhts", q_BTHK, k_BSHK,
                             preferred_element_type=jnp.float32) * scale
    scores_BHTS = jnp.where(mask_BTS[:, None], scores_BHTS, NEG_INF)
    probs_BHTS = dropout(jax.nn.softmax(scores_BHTS, axis=-1), rate, key)
    return jnp.einsum("bhts,bshk->bthk", probs_BHTS.astype(v_BSHK.dtype), v_BSHK,
                      preferred_element_type=jnp.float32)


def _swap_last(a: jax.Array) -> jax.Array:
    """Swap the last two axes; on CPU materialised (see `_physical_transpose`). The leading axes
    stay separate, so their sharding (batch, heads) survives."""
    if not _cpu_layouts():
        return jnp.swapaxes(a, -1, -2)
    *lead, M, N = a.shape
    return jax.lax.optimization_barrier(
        jnp.swapaxes(a, -1, -2).reshape(*lead, N * M)).reshape(*lead, N, M)


ATTENTION_BLOCK = 64  # query rows per block of `attention_blocked` (64 beat 32 and 128 on CPU)


def causal_blocks(T: int, block: int = ATTENTION_BLOCK) -> list[tuple[int, int]]:
    """Query blocks [t0, t1) of at most `block` rows; block i attends to keys [0, t1) only."""
    return [(t0, min(t0 + block, T)) for t0 in range(0, T, block)]


def attention_keep_masks(key: jax.Array | None, rate: float, B: int, H: int, T: int,
                         block: int = ATTENTION_BLOCK) -> tuple[jax.Array, ...]:
    """The attention dropout mask [B, H, T, T] as `attention_blocked` takes it: one [B, H, t, t1]
    mask per query block (blocks of the full mask; the skipped upper blocks are never drawn)."""
    return tuple(keep_mask(key, rate, (B, H, t1 - t0, t1), (0, 0, t0, 0), (B, H, T, T))
                 for t0, t1 in causal_blocks(T, block))


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def attention_blocked(q_BTHK, k_BTHK, v_BTHK, keep_blocks, rate: float,
                      block: int = ATTENTION_BLOCK) -> jax.Array:
    """Causal training attention (with dropout) in query blocks, with a hand-written backward.

    The same function as `attention_einsum` with a causal mask and the dropout mask in
    `keep_blocks` (from `attention_keep_masks`; scalar Trues when rate is 0). Queries go in blocks
    of `block` rows, each against only the keys up to its last row: the fully masked upper blocks
    of the score matrix are skipped (3/8 of it at T = 4 * block), as flash attention does. Under
    plain autodiff the backward dots of a bf16 model get float32 cotangents and two of them
    (dV = P.T @ dO, dK = dS.T @ Q) contract over the query axis, the layout the CPU's fast bf16
    kernel lacks; here every dot is an `a @ b` or `a @ b.T` product in q's dtype, with physically
    transposed P and dS where needed, and softmax stays float32. Only used without a KV cache.
    """
    return _attention_blocked_fwd(q_BTHK, k_BTHK, v_BTHK, keep_blocks, rate, block)[0]


def _attention_blocked_fwd(q_BTHK, k_BTHK, v_BTHK, keep_blocks, rate, block):
    T, K = q_BTHK.shape[1], q_BTHK.shape[3]
    q_BHTK, k_BHSK, v_BHSK = (jnp.swapaxes(a, 1, 2) for a in (q_BTHK, k_BTHK, v_BTHK))
    o_blocks, p_blocks = [], []
    for (t0, t1), keep_BHtS in zip(causal_blocks(T, block), keep_blocks, strict=True):
        s_BHtS = _mm(q_BHTK[:, :, t0:t1], k_BHSK[:, :, :t1], "bhtk,bhsk->bhts") * (1.0 / math.sqrt(K))
        causal_tS = jnp.arange(t0, t1)[:, None] >= jnp.arange(t1)[None, :]
        p_BHtS = jax.nn.softmax(jnp.where(causal_tS, s_BHtS, NEG_INF), axis=-1)
        pd_BHtS = _scale_kept(p_BHtS, keep_BHtS, rate)
        o_blocks.append(_mm(pd_BHtS.astype(q_BTHK.dtype), v_BHSK[:, :, :t1], "bhts,bhsk->bhtk"))
        p_blocks.append(p_BHtS)
    o_BHTK = jnp.concatenate(o_blocks, axis=2)
    return jnp.swapaxes(o_BHTK, 1, 2), (q_BHTK, k_BHSK, v_BHSK, keep_blocks, p_blocks)


def _attention_blocked_bwd(rate, block, res, g_BTHK):
    q_BHTK, k_BHSK, v_BHSK, keep_blocks, p_blocks = res
    dtype, T, K = q_BHTK.dtype, q_BHTK.shape[2], q_BHTK.shape[-1]
    g_BHTK = jnp.swapaxes(g_BTHK, 1, 2).astype(dtype)
    dq_blocks = []
    dk_BHSK = dv_BHSK = jnp.zeros(k_BHSK.shape, jnp.float32)
    for (t0, t1), keep, p_BHtS in zip(causal_blocks(T, block), keep_blocks, p_blocks):
        g_BHtK, q_BHtK = g_BHTK[:, :, t0:t1], q_BHTK[:, :, t0:t1]
        pd_BHtS = _scale_kept(p_BHtS, keep, rate)
        dv_BHSK = dv_BHSK.at[:, :, :t1].add(
            _mm(_swap_last(pd_BHtS.astype(dtype)), g_BHtK, "bhst,bhtk->bhsk"))
        dp_BHtS = _scale_kept(_mm(g_BHtK, v_BHSK[:, :, :t1], "bhtk,bhsk->bhts"), keep, rate)
        # Softmax backward in float32; masked positions have p = 0, so their gradient is 0.
        ds_BHtS = (p_BHtS * (dp_BHtS - jnp.sum(dp_BHtS * p_BHtS, -1, keepdims=True))
                   * (1.0 / math.sqrt(K))).astype(dtype)
        dq_blocks.append(_mm(ds_BHtS, k_BHSK[:, :, :t1], "bhts,bhsk->bhtk"))
        dk_BHSK = dk_BHSK.at[:, :, :t1].add(_mm(_swap_last(ds_BHtS), q_BHtK, "bhst,bhtk->bhsk"))
    back = lambda a: jnp.swapaxes(a, 1, 2).astype(dtype)
    return back(jnp.concatenate(dq_blocks, axis=2)), back(dk_BHSK), back(dv_BHSK), None


attention_blocked.defvjp(_attention_blocked_fwd, _attention_blocked_bwd)


def attention_fused(q_BTHK, k_BSHK, v_BSHK, mask_BTS, implementation: str | None) -> jax.Array:
    """`jax.nn.dot_product_attention`: cuDNN flash attention on GPU, XLA elsewhere.

    Without a mask it runs the causal kernel directly (the training path).
    """
    if mask_BTS is None:
        out = jax.nn.dot_product_attention(q_BTHK, k_BSHK, v_BSHK, is_causal=True,
                                           implementation=implementation)
    else:
        out = jax.nn.dot_product_attention(q_BTHK, k_BSHK, v_BSHK, mask=mask_BTS[:, None],
                                           implementation=implementation)
    return out.astype(jnp.float32)


def fused_implementation(choice: str, causal: bool, dtype, head_dim: int, backend: str) -> str:
    """`jax.nn.dot_product_attention`'s implementation for --attention=auto|xla|cudnn.

    Left to itself (`implementation=None`) JAX picks XLA, which materialises the [B, H, T, T]
    scores and softmax; on a GPU that was 40% of a GPT-2 training step (BENCHMARKS.md). So `auto`
    takes cuDNN's flash attention where it applies (the causal training path in a 16-bit dtype,
    head dim a multiple of 8 up to 128) and XLA elsewhere.
    """
    if choice != "auto":
        return choice
    cudnn_ok = (backend == "gpu" and causal and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
                and head_dim % 8 == 0 and head_dim <= 128)
    return "cudnn" if cudnn_ok else "xla"


def causal_mask(T: int) -> jax.Array:
    return jnp.tril(jnp.ones((T, T), bool))[None]


# ----------------------------------------------------------------------------- modules


def _value(p: nnx.Param | None):
    return None if p is None else p[...]


def _param(key, shape, std) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(key, shape, jnp.float32))


class Block(nnx.Module):
    """Pre-LayerNorm Transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, H, K, F = cfg.n_embd, cfg.n_head, cfg.head_dim, 4 * cfg.n_embd
        proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)  # GPT-2: scale residual projections
        zeros = lambda *s: nnx.Param(jnp.zeros(s, jnp.float32)) if cfg.bias else None
        self.ln1_scale = nnx.Param(jnp.ones((D,), jnp.float32))
        self.ln1_bias = zeros(D)
        self.w_qkv = _param(rngs.params(), (D, 3, H, K), 0.02)
        self.b_qkv = zeros(3, H, K)
        self.w_o = _param(rngs.params(), (H, K, D), proj_std)
        self.b_o = zeros(D)
        self.ln2_scale = nnx.Param(jnp.ones((D,), jnp.float32))
        self.ln2_bias = zeros(D)
        self.w_fc = _param(rngs.params(), (D, F), 0.02)
        self.b_fc = zeros(F)
        self.w_proj = _param(rngs.params(), (F, D), proj_std)
        self.b_proj = zeros(D)

    def __call__(self, x_BTD, positions_BT, cache: KVCache | None, layer, cfg: ModelConfig, key):
        dtype = compute_dtype(cfg)
        bias = lambda b: 0.0 if b is None else b[...]
        keys = jax.random.split(key, 3) if key is not None else (None, None, None)

        h_BTD = layer_norm(x_BTD, self.ln1_scale[...], _value(self.ln1_bias))
        qkv_BT3HK = dense(h_BTD, self.w_qkv[...], "btd,dchk->btchk", dtype) + bias(self.b_qkv)
        q_BTHK, k_BTHK, v_BTHK = (qkv_BT3HK[:, :, i].astype(dtype) for i in range(3))
        if cache is None:
            k_BSHK, v_BSHK, mask_BTS = k_BTHK, v_BTHK, None
        else:
            cache, k_BSHK, v_BSHK, mask_BTS = _update_cache(cache, layer, k_BTHK, v_BTHK)
        train_dropout = key is not None and cfg.dropout > 0  # the fused kernels take no dropout
        # Without a cache the blocked attention runs when there is dropout, and on CPU always (it
        # beat jax.nn.dot_product_attention there; BENCHMARKS.md); --attention=einsum always runs
        # the plain reference.
        blocked = (cfg.attention != "einsum" and mask_BTS is None
                   and (train_dropout or (cfg.attention == "auto" and jax.default_backend() == "cpu")))
        if blocked:
            B, T = q_BTHK.shape[:2]
            keep = attention_keep_masks(keys[0], cfg.dropout, B, cfg.n_head, T, ATTENTION_BLOCK)
            rate = drop_rate(cfg.dropout) if keep[0].ndim else 0.0
            y_BTHK = attention_blocked(q_BTHK, k_BSHK, v_BSHK, keep, rate, ATTENTION_BLOCK)
        elif cfg.attention == "einsum" or train_dropout:
            T = q_BTHK.shape[1]
            mask = causal_mask(T) if mask_BTS is None else mask_BTS
            y_BTHK = attention_einsum(q_BTHK, k_BSHK, v_BSHK, mask, cfg.dropout, keys[0])
        else:
            impl = fused_implementation(cfg.attention, mask_BTS is None, q_BTHK.dtype, cfg.head_dim,
                                        jax.default_backend())
            y_BTHK = attention_fused(q_BTHK, k_BSHK, v_BSHK, mask_BTS, impl)
        attn_BTD = dense(y_BTHK, self.w_o[...], "bthk,hkd->btd", dtype) + bias(self.b_o)
        x_BTD = x_BTD + dropout(attn_BTD, cfg.dropout, keys[1])

        h_BTD = layer_norm(x_BTD, self.ln2_scale[...], _value(self.ln2_bias))
        h_BTF = jax.nn.gelu(dense(h_BTD, self.w_fc[...], "btd,df->btf", dtype) + bias(self.b_fc),
                            approximate=cfg.activation == "gelu_tanh")
        mlp_BTD = dense(h_BTF, self.w_proj[...], "btf,fd->btd", dtype) + bias(self.b_proj)
        return x_BTD + dropout(mlp_BTD, cfg.dropout, keys[2]), cache


def _update_cache(cache: KVCache, layer, k_BTHK, v_BTHK):
    """Write this call's keys/values at `cache.index` and return the layer's view and its mask."""
    T = k_BTHK.shape[1]
    at = (layer, 0, cache.index, 0, 0)
    k_all = jax.lax.dynamic_update_slice(cache.k_LBSHK, k_BTHK[None].astype(cache.k_LBSHK.dtype), at)
    v_all = jax.lax.dynamic_update_slice(cache.v_LBSHK, v_BTHK[None].astype(cache.v_LBSHK.dtype), at)
    cache = cache._replace(k_LBSHK=k_all, v_LBSHK=v_all)
    S = k_all.shape[2]
    slot_S = jnp.arange(S)
    query_slot_T = cache.index + jnp.arange(T)
    mask_BTS = (slot_S[None, None, :] <= query_slot_T[None, :, None]) & \
               (slot_S[None, None, :] >= cache.start_B[:, None, None])
    return cache, k_all[layer], v_all[layer], mask_BTS


def _stack_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
    """L independently initialised blocks merged into one Block whose arrays have a leading L axis."""
    blocks = [Block(cfg, rngs=rngs) for _ in range(cfg.n_layer)]
    graphdef, _ = nnx.split(blocks[0])
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(b) for b in blocks])
    return nnx.merge(graphdef, stacked)


class GPT(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D = cfg.n_embd
        self.wte = _param(rngs.params(), (cfg.padded_vocab_size, D), 0.02)
        self.wpe = _param(rngs.params(), (cfg.block_size, D), 0.02) \
            if cfg.pos_embedding == "learned" else None
        self.blocks = _stack_blocks(cfg, rngs)
        self.lnf_scale = nnx.Param(jnp.ones((D,), jnp.float32))
        self.lnf_bias = nnx.Param(jnp.zeros((D,), jnp.float32)) if cfg.bias else None

    def __call__(self, idx_BT: jax.Array, *, cache: KVCache | None = None,
                 dropout_key: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
        """Logits [B, T, V_padded] in float32 (padded entries are -inf), and the updated cache.

        With a cache, the tokens are written after the `cache.index` slots already filled and attend
        to those slots; without one, attention is causal over `idx_BT` alone.
        """
        cfg = self.cfg
        B, T = idx_BT.shape
        if cache is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
        else:
            positions_BT = jnp.maximum(cache.index + jnp.arange(T)[None] - cache.start_B[:, None], 0)
        # The residual stream is float32 whatever dtype the weights are held in (sampling may
        # hold them in the compute dtype).
        x_BTD = self.wte[...][idx_BT].astype(jnp.float32)
        if self.wpe is not None:
            x_BTD = x_BTD + self.wpe[...][positions_BT]
        else:
            x_BTD = x_BTD + sinusoidal(positions_BT, cfg.n_embd)
        keys = (None, None) if dropout_key is None else jax.random.split(dropout_key)
        x_BTD = dropout(x_BTD, cfg.dropout, keys[0])

        graphdef, state = nnx.split(self.blocks)

        def body(carry, xs):
            x_BTD, cache = carry
            layer_state, layer = xs
            key = None if keys[1] is None else jax.random.fold_in(keys[1], layer)
            x_BTD, cache = nnx.merge(graphdef, layer_state)(x_BTD, positions_BT, cache, layer, cfg, key)
            return (x_BTD, cache), None

        if cfg.remat == "block":
            body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
        elif cfg.remat == "dots":
            body = jax.checkpoint(body, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
        L = cfg.n_layer
        (x_BTD, cache), _ = jax.lax.scan(body, (x_BTD, cache), (state, jnp.arange(L)),
                                         unroll=1 if cfg.scan_layers else L)
        if cache is not None:
            cache = cache._replace(index=cache.index + T)

        x_BTD = layer_norm(x_BTD, self.lnf_scale[...], _value(self.lnf_bias))
        logits_BTV = dense(x_BTD, self.wte[...], "btd,vd->btv", compute_dtype(cfg))
        valid_V = jnp.arange(cfg.padded_vocab_size) < cfg.vocab_size
        return jnp.where(valid_V, logits_BTV, -jnp.inf), cache


# ----------------------------------------------------------------------------- sizes and FLOPs


def num_params(cfg: ModelConfig, *, include_position: bool = True) -> int:
    """Parameter count without vocabulary padding (what transformers reports for GPT-2)."""
    D, L, F = cfg.n_embd, cfg.n_layer, 4 * cfg.n_embd
    b = 1 if cfg.bias else 0
    per_block = (D * 3 * D + b * 3 * D) + (D * D + b * D) + (D * F + b * F) + (F * D + b * D) \
        + 2 * (D + b * D)
    total = cfg.vocab_size * D + L * per_block + (D + b * D)
    if include_position and cfg.pos_embedding == "learned":
        total += cfg.block_size * D
    return total


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token: 6N + 12*L*T*D (PaLM, appendix B).

    N excludes the position embeddings and the vocabulary padding; the tied token embedding counts
    once, for the LM head's matmul (nanoGPT's convention). Padding is wasted work, not model work.
    """
    T = seq_len or cfg.block_size
    return 6 * num_params(cfg, include_position=False) + 12 * cfg.n_layer * T * cfg.n_embd


def abstract_params(m: ModelConfig, shardings=None):
    """Shapes/dtypes of the parameters (no memory), placed on one device or on `shardings`."""
    shapes = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: GPT(m, rngs=nnx.Rngs(0)))))
    if shardings is None:
        sd = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sd), shapes)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, shardings)
