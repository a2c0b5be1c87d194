"""gpt.ops.dropout: 16-bit counter-based masks, their rate and scale, per-shard drawing."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from gpt.ops.dropout import drop_rate, dropout, keep_mask
from helpers import run_on_4_cpu_devices


@pytest.mark.parametrize("rate", [0.001, 0.2, 0.5])
def test_dropout_mask_rate_and_scale(rate):
    """The kept fraction is 1 - rate (to sampling error), the mean is preserved, odd trailing
    sizes work, and the same key gives the same mask."""
    key = jax.random.key(4)
    keep = keep_mask(key, rate, (8, 3, 40001))
    assert keep.shape == (8, 3, 40001) and keep.dtype == jnp.bool_
    n = keep.size
    kept = float(keep.mean())
    assert abs(kept - (1 - rate)) < 5 * (rate * (1 - rate) / n) ** 0.5 + 1e-5, kept
    assert abs(drop_rate(rate) - rate) <= 2 ** -17
    y = dropout(jnp.ones((8, 3, 40001)), rate, key)
    assert abs(float(y.mean()) - 1.0) < 5 * (rate / (1 - rate) / n) ** 0.5 + 1e-5
    assert bool(jnp.all(keep_mask(key, rate, (8, 3, 40001)) == keep))
    assert not bool(jnp.all(keep_mask(jax.random.key(5), rate, (8, 3, 40001)) == keep))
    assert keep_mask(None, rate, (4,)).ndim == 0 and keep_mask(key, 0.0, (4,)).ndim == 0


def test_a_block_of_a_mask_equals_the_slice():
    key = jax.random.key(1)
    full = keep_mask(key, 0.3, (2, 3, 16, 16))
    block = keep_mask(key, 0.3, (2, 3, 5, 12), (0, 0, 7, 4), (2, 3, 16, 16))
    assert bool(jnp.all(block == full[:, :, 7:12, 4:16]))


_MASK_SCRIPT = """
import json, re, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from gpt.ops.dropout import keep_mask
shape = (8, 6, 64, 64)  # [B, H, T, S], as for attention dropout
f = lambda k: keep_mask(k, 0.2, shape)
key = jax.random.key(7)
ref = np.asarray(jax.jit(f)(key))
mesh = jax.make_mesh((2, 2), ("data", "tensor"))
g = jax.jit(f, out_shardings=NamedSharding(mesh, P("data", "tensor")))
hlo = g.lower(key).compile().as_text()
print(json.dumps({"equal": bool((np.asarray(g(key)) == ref).all()), "kept": float(ref.mean()),
                  "u32_shapes": sorted(set(re.findall(r"u32\\[([\\d,]+)\\]", hlo)))}))
"""


def test_dropout_masks_are_mesh_independent_and_drawn_per_shard():
    """The same key gives the same mask on a 2x2 mesh, and each device hashes only its shard (no
    device generates the global [B, H, ...] words)."""
    out = run_on_4_cpu_devices(_MASK_SCRIPT)
    assert out["equal"] and abs(out["kept"] - 0.8) < 0.01
    leading = {tuple(int(d) for d in s.split(",")[:2]) for s in out["u32_shapes"] if s.count(",") >= 3}
    assert leading == {(4, 3)}, out["u32_shapes"]  # per-device [B/2, H/2, ...] only
