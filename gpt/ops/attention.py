"""Causal self-attention: one entry point over four implementations.

- "reference": scaled scores, mask, float32 softmax, (dropout), weighted values; plain einsums
  differentiated by JAX. Every other implementation is tested against it (tests/ops/).
- "blocked": queries in causal blocks with a hand-written backward: the fully masked upper blocks
  of the scores are never computed, and every matmul is an `a @ b` or `a @ b.T` product in the
  compute dtype (the CPU's fast layouts). The training path on CPU, and wherever there is dropout.
- "xla" / "cudnn": `jax.nn.dot_product_attention`; cuDNN is flash attention on NVIDIA GPUs.
With a KV cache, `cached_attention` (the reference's math over the cache's own layout; cuDNN on request).
Shapes: B batch, T queries, S keys, H heads, K head dim; a block has t query rows.
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from gpt.ops.dense import mm, physical_swap
from gpt.ops.dropout import drop_rate, keep_mask, scale_kept

NEG_INF = -1e30  # finite "minus infinity" for attention masks, so fully masked rows stay finite
ATTENTION_BLOCK = 64  # query rows per block of the blocked kernel (64 beat 32 and 128 on CPU)


def attention(q_BTHK, k_BSHK, v_BSHK, mask_BTS: jax.Array | None, impl: str, *,
              cpu_layouts: bool = False, rate: float = 0.0, key: jax.Array | None = None,
              block: int = ATTENTION_BLOCK) -> jax.Array:
    """Attention output [B, T, H, K] in float32; causal over S = T when `mask_BTS` is None.

    `impl` comes from `gpt.runtime`. Dropout (a key and rate > 0) needs the reference or the
    blocked kernel (the fused ones take none), so with dropout the fused choices yield to "blocked".
    """
    dropping = key is not None and rate > 0
    if impl == "reference":
        mask = causal_mask(q_BTHK.shape[1]) if mask_BTS is None else mask_BTS
        return attention_reference(q_BTHK, k_BSHK, v_BSHK, mask, rate, key)
    if mask_BTS is None and (impl == "blocked" or dropping):
        B, T, H = q_BTHK.shape[:3]
        keep = attention_keep_masks(key, rate, B, H, T, block)
        applied = drop_rate(rate) if keep[0].ndim else 0.0
        return attention_blocked(q_BTHK, k_BSHK, v_BSHK, keep, applied, block, cpu_layouts)
    if dropping:
        return attention_reference(q_BTHK, k_BSHK, v_BSHK, mask_BTS, rate, key)
    return attention_fused(q_BTHK, k_BSHK, v_BSHK, mask_BTS, "xla" if impl == "blocked" else impl)


def causal_mask(T: int) -> jax.Array:
    return jnp.tril(jnp.ones((T, T), bool))[None]


def attention_reference(q_BTHK, k_BSHK, v_BSHK, mask_BTS, rate: float = 0.0, key=None) -> jax.Array:
    scale = 1.0 / math.sqrt(q_BTHK.shape[-1])
    scores_BHTS = mm(q_BTHK, k_BSHK, "bthk,bshk->bhts") * scale
    scores_BHTS = jnp.where(mask_BTS[:, None], scores_BHTS, NEG_INF)
    probs_BHTS = jax.nn.softmax(scores_BHTS, axis=-1)
    keep = keep_mask(key, rate, probs_BHTS.shape)
    if keep.ndim:
        probs_BHTS = scale_kept(probs_BHTS, keep, drop_rate(rate))
    return mm(probs_BHTS.astype(v_BSHK.dtype), v_BSHK, "bhts,bshk->bthk")


def attention_fused(q_BTHK, k_BSHK, v_BSHK, mask_BTS, implementation: str) -> jax.Array:
    """`jax.nn.dot_product_attention`; without a mask, its causal kernel (the training path)."""
    if mask_BTS is None:
        out = jax.nn.dot_product_attention(q_BTHK, k_BSHK, v_BSHK, is_causal=True,
                                           implementation=implementation)
    else:
        out = jax.nn.dot_product_attention(q_BTHK, k_BSHK, v_BSHK, mask=mask_BTS[:, None],
                                           implementation=implementation)
    return out.astype(jnp.float32)


def repeat_kv_heads(x_BSGK: jax.Array, n_head: int) -> jax.Array:
    """Grouped-query keys or values [B, S, G, K] as [B, S, H, K]: each of the G heads repeated for
    the H / G query heads it serves."""
    groups = n_head // x_BSGK.shape[2]
    return jnp.repeat(x_BSGK, groups, axis=2) if groups > 1 else x_BSGK


def cached_attention(q_BTHK, k_BGKS, v_BGSK, mask_BTS: jax.Array, impl: str) -> jax.Array:
    """Attention of T queries to a KV cache (`gpt.model.KVCache`), output [B, T, H, K] float32.

    The cache holds keys [B, G, K, S] and values [B, G, S, K], the operand layouts of the two
    products, and each of the G key/value heads serves H / G query heads as one batch of rows
    (no repeated copy of the cache for grouped-query attention). Held [B, S, G, K], XLA:CPU
    transposed every layer's cache on every decoding step, the larger part of a small model's
    step (BENCHMARKS.md). "cudnn" takes the cache in its own layout (a transpose per call)."""
    B, T, H, K = q_BTHK.shape
    G = k_BGKS.shape[1]
    if impl == "cudnn":
        k_BSGK, v_BSGK = jnp.moveaxis(k_BGKS, 3, 1), jnp.swapaxes(v_BGSK, 1, 2)
        k_BSHK, v_BSHK = repeat_kv_heads(k_BSGK, H), repeat_kv_heads(v_BSGK, H)
        return attention_fused(q_BTHK, k_BSHK, v_BSHK, mask_BTS, impl)
    q_BGRTK = jnp.moveaxis(q_BTHK.reshape(B, T, G, H // G, K), 1, 3)
    q_BGRTK = q_BGRTK.astype(jnp.promote_types(q_BGRTK.dtype, k_BGKS.dtype))
    scores_BGRTS = mm(q_BGRTK, k_BGKS, "bgrtk,bgks->bgrts") * (1.0 / math.sqrt(K))
    scores_BGRTS = jnp.where(mask_BTS[:, None, None], scores_BGRTS, NEG_INF)
    probs_BGRTS = jax.nn.softmax(scores_BGRTS, axis=-1)
    y_BGRTK = mm(probs_BGRTS.astype(v_BGSK.dtype), v_BGSK, "bgrts,bgsk->bgrtk")
    return jnp.moveaxis(y_BGRTK, 3, 1).reshape(B, T, H, K)


def causal_blocks(T: int, block: int = ATTENTION_BLOCK) -> list[tuple[int, int]]:
    """Query blocks [t0, t1) of at most `block` rows; block i attends to keys [0, t1) only."""
    return [(t0, min(t0 + block, T)) for t0 in range(0, T, block)]


def attention_keep_masks(key: jax.Array | None, rate: float, B: int, H: int, T: int,
                         block: int = ATTENTION_BLOCK) -> tuple[jax.Array, ...]:
    """The attention dropout mask [B, H, T, T] as `attention_blocked` takes it: one [B, H, t, t1]
    mask per query block (blocks of the full mask; the skipped upper blocks are never drawn)."""
    return tuple(keep_mask(key, rate, (B, H, t1 - t0, t1), (0, 0, t0, 0), (B, H, T, T))
                 for t0, t1 in causal_blocks(T, block))


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def attention_blocked(q_BTHK, k_BTHK, v_BTHK, keep_blocks, rate: float,
                      block: int = ATTENTION_BLOCK, cpu_layouts: bool = False) -> jax.Array:
    """Causal attention (with the dropout mask in `keep_blocks`, scalar Trues at rate 0) in query
    blocks of `block` rows, each against the keys up to its last row, as flash attention does.

    Under plain autodiff the backward dots of a bf16 model get float32 cotangents and two of them
    (dV = P.T @ dO, dK = dS.T @ Q) contract over the query axis, the layout the CPU's fast bf16
    kernel lacks; here every dot is an `a @ b` or `a @ b.T` product in q's dtype, with physically
    transposed P and dS where needed, and softmax stays float32.
    """
    return _blocked_fwd(q_BTHK, k_BTHK, v_BTHK, keep_blocks, rate, block, cpu_layouts)[0]


def _blocked_fwd(q_BTHK, k_BTHK, v_BTHK, keep_blocks, rate, block, cpu_layouts):
    T, K = q_BTHK.shape[1], q_BTHK.shape[3]
    q_BHTK, k_BHSK, v_BHSK = (jnp.swapaxes(a, 1, 2) for a in (q_BTHK, k_BTHK, v_BTHK))
    o_blocks, p_blocks = [], []
    for (t0, t1), keep_BHtS in zip(causal_blocks(T, block), keep_blocks, strict=True):
        s_BHtS = mm(q_BHTK[:, :, t0:t1], k_BHSK[:, :, :t1], "bhtk,bhsk->bhts") * (1.0 / math.sqrt(K))
        causal_tS = jnp.arange(t0, t1)[:, None] >= jnp.arange(t1)[None, :]
        p_BHtS = jax.nn.softmax(jnp.where(causal_tS, s_BHtS, NEG_INF), axis=-1)
        pd_BHtS = scale_kept(p_BHtS, keep_BHtS, rate)
        o_blocks.append(mm(pd_BHtS.astype(q_BTHK.dtype), v_BHSK[:, :, :t1], "bhts,bhsk->bhtk"))
        p_blocks.append(p_BHtS)
    o_BHTK = jnp.concatenate(o_blocks, axis=2)
    return jnp.swapaxes(o_BHTK, 1, 2), (q_BHTK, k_BHSK, v_BHSK, keep_blocks, p_blocks)


def _blocked_bwd(rate, block, cpu_layouts, res, g_BTHK):
    q_BHTK, k_BHSK, v_BHSK, keep_blocks, p_blocks = res
    dtype, T, K = q_BHTK.dtype, q_BHTK.shape[2], q_BHTK.shape[-1]
    g_BHTK = jnp.swapaxes(g_BTHK, 1, 2).astype(dtype)
    dq_blocks = []
    dk_BHSK = dv_BHSK = jnp.zeros(k_BHSK.shape, jnp.float32)
    for (t0, t1), keep, p_BHtS in zip(causal_blocks(T, block), keep_blocks, p_blocks):
        g_BHtK, q_BHtK = g_BHTK[:, :, t0:t1], q_BHTK[:, :, t0:t1]
        pd_BHtS = scale_kept(p_BHtS, keep, rate)
        dv_BHSK = dv_BHSK.at[:, :, :t1].add(
            mm(physical_swap(pd_BHtS.astype(dtype), cpu_layouts), g_BHtK, "bhst,bhtk->bhsk"))
        dp_BHtS = scale_kept(mm(g_BHtK, v_BHSK[:, :, :t1], "bhtk,bhsk->bhts"), keep, rate)
        # Softmax backward in float32; masked positions have p = 0, so their gradient is 0.
        ds_BHtS = (p_BHtS * (dp_BHtS - jnp.sum(dp_BHtS * p_BHtS, -1, keepdims=True))
                   * (1.0 / math.sqrt(K))).astype(dtype)
        dq_blocks.append(mm(ds_BHtS, k_BHSK[:, :, :t1], "bhts,bhsk->bhtk"))
        dk_BHSK = dk_BHSK.at[:, :, :t1].add(
            mm(physical_swap(ds_BHtS, cpu_layouts), q_BHtK, "bhst,bhtk->bhsk"))
    back = lambda a: jnp.swapaxes(a, 1, 2).astype(dtype)
    return back(jnp.concatenate(dq_blocks, axis=2)), back(dk_BHSK), back(dv_BHSK), None


attention_blocked.defvjp(_blocked_fwd, _blocked_bwd)
