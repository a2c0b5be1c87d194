"""Dropout masks from 16-bit counter-based uniforms.

`jax.random.bernoulli` (one threefry output word and a float conversion per element) made the masks,
attention's [B, H, T, T] above all, the largest cost of a CPU step with dropout. Here each threefry
hash gives two 32-bit words, i.e. four 16-bit uniforms. Its counters are (row, column) iotas of the
full mask's indices, so, as with jax's partitionable threefry, a sharded mask is computed shard by
shard and equals the unsharded one (`lax.rng_bit_generator` is as fast, but XLA runs it whole on
every device), and a block of a mask can be drawn alone (the blocked attention's causal blocks).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.random import threefry2x32_p

DROPOUT_LEVELS = 1 << 16  # dropout masks are drawn as 16-bit uniforms


def drop_rate(rate: float) -> float:
    """The dropout rate actually applied: `rate` rounded to a multiple of 2^-16 (within 8e-6)."""
    return min(round(rate * DROPOUT_LEVELS), DROPOUT_LEVELS - 1) / DROPOUT_LEVELS


def keep_mask(key: jax.Array | None, rate: float, shape, offset=None, full=None) -> jax.Array:
    """Dropout's keep mask (True with probability 1 - drop_rate(rate)); a scalar True without a
    key or at rate 0. With `offset` and `full`: the block of shape `shape` at `offset` of the mask
    of shape `full` (equal to slicing that mask; the last offset a multiple of 4)."""
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


def scale_kept(x: jax.Array, keep: jax.Array, rate: float) -> jax.Array:
    """x / (1 - rate) where kept, 0 where dropped; x itself at rate 0."""
    return jnp.where(keep, x / (1.0 - rate), 0.0) if rate > 0 else x


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    keep = keep_mask(key, rate, x.shape)
    if keep.ndim == 0:
        return x
    return scale_kept(x, keep, drop_rate(rate)).astype(x.dtype)
