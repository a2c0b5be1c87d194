"""The cross-entropy's value and gradient over rows of logits, one Pallas (Triton) program a row.

For GPT-2 at batch 64 x 1024 the logits are [65536, 50304] bf16, 6.6 GB. XLA compiles the loss over
them to a reduction for the logsumexp (one read) and, in the backward, softmax - one-hot (a read
and a write): 19.8 GB and 9.5 ms of the H200's 126.6 ms step, the logsumexp's read at under half
the bandwidth (BENCHMARKS.md). Here program r takes row r: it reads the row in blocks of BV for
the online (max, sum of exp) and the target's logit, then reads it again (the row is 100 KB, read
a moment before, so mostly from L2) to write (softmax - one-hot) * scale in the logits' dtype.
That is 13.2 GB from memory when the second read hits L2 (on an H200: 5.59 ms against XLA's 8.06
for the same values). The gradient exists before the backward, so `gpt.ops.cross_entropy.
cross_entropy_rows` keeps it in place of the logits and the backward only scales it. (Through
`linear_cross_entropy`, which applies it to the head's products in the forward, the step was
2.5 ms slower, not faster: BENCHMARKS.md, thirty-fifth session.)

Entries from `vocab` on (a padded vocabulary) count as -inf: probability 0, gradient 0 (-scale at
a target there, whose loss is infinite, as XLA's path gives). Finite
logits are assumed (an entry of +inf gives NaN, where the reference gives +inf). A row's last block
is pulled back to end at V, its columns already seen masked in the first pass (no load is masked);
in the second it writes the same values again for them, which is why the gradient has its own
buffer and does not overwrite the logits.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gpt.ops.pallas_util import pow2_at_most, triton_params

F32 = jnp.float32
BV = 4096  # columns a block: 16 a thread at 8 warps
WARPS = 8


def _masked(raw, start, covered, vocab: int, t):
    """A block of a row, columns [start, start + width), in float32: -inf before `covered` (seen
    in an earlier block) and from `vocab` on; and the target's logit where it falls among them."""
    cols = start + jnp.arange(raw.shape[0])
    x = jnp.where((cols >= covered) & (cols < vocab), raw.astype(F32), -jnp.inf)
    return x, jnp.sum(jnp.where((cols == t) & (cols >= covered), x, 0.0))


def _gradient(raw, start, lse, vocab: int, t, scale):
    """A block's (softmax - one-hot) * scale, 0 from `vocab` on, in float32."""
    cols = start + jnp.arange(raw.shape[0])
    p = jnp.where(cols < vocab, jnp.exp(raw.astype(F32) - lse), 0.0)
    return (p - (cols == t)) * scale


def _fold(carry, x):
    """The running (max, sum of exp(x - max)) with one more block: the old sum rescaled by one
    exp; a max still -inf (every entry so far -inf) subtracts 0, not -inf (no NaN)."""
    m, s = carry
    m_new = jnp.maximum(m, jnp.max(x))
    base = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    return m_new, s * jnp.exp(m - base) + jnp.sum(jnp.exp(x - base))


def _empty() -> tuple[jax.Array, jax.Array, jax.Array]:
    """(max, sum of exp, target logit) of no entries yet."""
    return jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.float32(0.0)


def _starts(V: int, width: int) -> tuple[int, int]:
    """(full blocks, start of the pulled-back last block or -1 when the blocks tile V)."""
    return V // width, (V - width if V % width else -1)


def _row_kernel(t_ref, s_ref, x_ref, lse_ref, tv_ref, d_ref, *, vocab: int, width: int):
    """Program r: row r's logsumexp and target logit from a first read of its blocks (the full
    ones in a loop, then the pulled-back last one), its gradient written in a second read."""
    r = pl.program_id(0)
    t, scale = t_ref[r], s_ref[r]
    full, tail = _starts(x_ref.shape[1], width)

    def fold_block(i, carry):
        start = pl.multiple_of(i * width, width)
        x, tv = _masked(x_ref[r, pl.ds(start, width)], start, 0, vocab, t)
        return (*_fold(carry[:2], x), carry[2] + tv)

    m, s, tv = jax.lax.fori_loop(0, full, fold_block, _empty())
    if tail >= 0:
        x, tail_tv = _masked(x_ref[r, pl.ds(tail, width)], tail, full * width, vocab, t)
        (m, s), tv = _fold((m, s), x), tv + tail_tv
    lse = m + jnp.log(s)
    lse_ref[r], tv_ref[r] = lse, tv

    def write_gradient(start):
        d = _gradient(x_ref[r, pl.ds(start, width)], start, lse, vocab, t, scale)
        d_ref[r, pl.ds(start, width)] = d.astype(d_ref.dtype)

    jax.lax.fori_loop(0, full, lambda i, _: write_gradient(pl.multiple_of(i * width, width)), None)
    if tail >= 0:
        write_gradient(tail)


def _held_row_kernel(t_ref, s_ref, x_ref, lse_ref, tv_ref, d_ref, *, vocab: int, width: int):
    """`_row_kernel` with every block of the row loaded first and held in registers through both
    passes (blocks unrolled): one read of the logits whatever L2 keeps, for rows of a few blocks."""
    r = pl.program_id(0)
    t, scale = t_ref[r], s_ref[r]
    full, tail = _starts(x_ref.shape[1], width)
    starts = [i * width for i in range(full)] + ([tail] if tail >= 0 else [])
    raws = [x_ref[r, pl.ds(start, width)] for start in starts]  # the loads first (`decode_kernels._tiles`)
    m, s, tv = _empty()
    for i, (start, raw) in enumerate(zip(starts, raws, strict=True)):
        x, block_tv = _masked(raw, start, full * width if i == full else 0, vocab, t)
        (m, s), tv = _fold((m, s), x), tv + block_tv
    lse = m + jnp.log(s)
    lse_ref[r], tv_ref[r] = lse, tv
    for start, raw in zip(starts, raws, strict=True):
        d_ref[r, pl.ds(start, width)] = _gradient(raw, start, lse, vocab, t, scale).astype(d_ref.dtype)


def block_width(V: int, cap: int = BV) -> int:
    """The largest power of two at most V and `cap`: Triton's blocks are powers of two."""
    return pow2_at_most(V, cap)


def xent_rows(logits_RV: jax.Array, targets_R: jax.Array, scale_R: jax.Array, vocab: int, *,
              interpret: bool = False, width: int = BV, warps: int = WARPS, hold: bool = False
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each row's logsumexp and target logit (float32 [R]) and the gradient of
    sum_r scale_r (lse_r - target_r) with respect to the logits, (softmax - one-hot) * scale, in
    the logits' dtype [R, V]. Entries from `vocab` on count as -inf. `interpret`: Pallas's
    interpreter (off a GPU: tests); width and warps: Triton's block of columns and warps a program;
    `hold`: the row held in registers between its passes (`_held_row_kernel`; not timed on a GPU)."""
    R, V = logits_RV.shape
    # the loops' loads feed reductions, which Triton does not pipeline: 1 and 3 stages compiled to
    # the same PTX (offline, H200)
    params = triton_params(warps, 1, interpret)
    row = jax.ShapeDtypeStruct((R,), F32)
    row_kernel = _held_row_kernel if hold else _row_kernel
    kernel = functools.partial(row_kernel, vocab=vocab, width=block_width(V, width))
    return pl.pallas_call(kernel, grid=(R,), interpret=interpret, compiler_params=params,
                          out_shape=(row, row, jax.ShapeDtypeStruct((R, V), logits_RV.dtype)))(
        targets_R.astype(jnp.int32), scale_R.astype(F32), logits_RV)
