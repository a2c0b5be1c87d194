"""gpt/ops/xent_kernel.py against float64, in Pallas's interpreter (and, marked `gpu`, as a Triton
kernel: `pytest -m gpu`): rows whose blocks tile V and rows with a pulled-back last block, targets
in every kind of block, a padded vocabulary, bf16 logits. Its speed is a GPU's (BENCHMARKS.md:
bench/xent.py, which timed it, went with the kernel's first removal)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt.ops import xent_kernel as xk

ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")]
WHERE = [pytest.param(True, id="interpreter"), pytest.param(False, id="triton", marks=ON_GPU)]


def _reference(x, t, scale, vocab):
    """float64 logsumexp, target logit and (softmax - one-hot) * scale; entries >= vocab -inf."""
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64).copy()
    x[:, vocab:] = -np.inf
    rows, t = np.arange(len(x)), np.asarray(t)
    m = x.max(1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(1, keepdims=True)))[:, 0]
    onehot = np.zeros_like(x)
    onehot[rows, t] = 1.0
    return lse, x[rows, t], (np.exp(x - lse[:, None]) - onehot) * np.asarray(scale)[:, None]


# (V, vocab, width): blocks that tile V; a last block pulled back (V % width != 0); V under the
# asked width (the kernel takes 16)
SHAPES = [(128, 128, 32), (100, 97, 32), (100, 100, 64), (24, 20, 64)]


@pytest.mark.parametrize("interpret", WHERE)
@pytest.mark.parametrize("hold", [False, True], ids=["two reads", "held"])  # the row read twice, or held
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("V,vocab,width", SHAPES)
def test_rows_match_float64(V, vocab, width, dtype, hold, interpret):
    R, w = 9, xk.block_width(V, width)  # the width the kernel takes (at most V)
    x = (3.0 * jax.random.normal(jax.random.key(V), (R, V))).astype(dtype)
    # targets first and last of the vocabulary, on block edges, in the pulled-back block's columns
    # that an earlier block already covered, and past it
    t = jnp.array([0, vocab - 1, w - 1, w, (V // w) * w - 1, V - w, 5, vocab // 2, 1])
    t = jnp.clip(t, 0, vocab - 1)
    scale = jnp.linspace(0.1, 2.0, R)
    lse, target, d = jax.jit(lambda a: xk.xent_rows(a, t, scale, vocab, interpret=interpret, width=width,
                                                    hold=hold))(x)
    want = _reference(x, t, scale, vocab)
    assert d.dtype == x.dtype and d.shape == x.shape
    np.testing.assert_allclose(np.asarray(lse), want[0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(target), want[1], rtol=1e-6)
    atol = 1e-6 if dtype == "float32" else 8e-3  # bf16's rounding of a gradient of at most 2
    np.testing.assert_allclose(np.asarray(d, np.float64), want[2], atol=atol)
    assert not np.any(np.asarray(d)[:, vocab:])  # the padded vocabulary: gradient 0


def test_extreme_rows():
    """A row of -inf but one entry, one whose target is -inf (padded), and large logits: the
    reference's values (the first: the entry has probability 1; the second: an infinite loss)."""
    V, vocab = 64, 60
    x = jnp.stack([jnp.full((V,), -jnp.inf).at[7].set(3.0), jnp.zeros(V), jnp.linspace(-80.0, 80.0, V)])
    t = jnp.array([7, 62, 63 - 4])
    lse, target, d = xk.xent_rows(x, t, jnp.ones(3), vocab, interpret=True, width=16)
    assert float(lse[0]) == 3.0 and float(target[0]) == 3.0 and not np.any(np.asarray(d[0]))
    assert float(target[1]) == -np.inf and np.isfinite(float(lse[1]))
    want = _reference(x, t, jnp.ones(3), vocab)
    np.testing.assert_allclose(float(lse[2]), want[0][2], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(d[2]), want[2][2], atol=1e-6)


def test_block_width_is_a_power_of_two_within_v():
    assert [xk.block_width(v) for v in (1, 65, 4096, 50304)] == [1, 64, 4096, 4096]
    assert xk.block_width(50304, 8192) == 8192
