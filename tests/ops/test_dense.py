"""gpt.ops.dense: the custom-VJP dense against the einsum reference, in both layouts and dtypes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import ci_first, tiny_model_config, tiny_runtime
from gpt.model import GPT
from gpt.ops import dense as D

SPECS = [("btd,dchk->btchk", (2, 5, 16), (16, 3, 2, 8)),
         ("bthk,hkd->btd", (2, 5, 2, 8), (2, 8, 16)),
         ("btd,df->btf", (2, 5, 16), (16, 64)),
         ("btf,fd->btd", (2, 5, 64), (64, 16)),
         ("btd,vd->btv", (2, 5, 16), (128, 16))]


# CI: every contraction in float32 in the CPU layouts, and each of the other three settings on two
# of them; `-m slow` the whole product.
DENSE_CI = {*(("float32", *s, True) for s in SPECS),
            *((d, *s, c) for s in SPECS[1:3] for d, c in [("float32", False), ("bfloat16", True),
                                                           ("bfloat16", False)])}


@pytest.mark.parametrize("dtype,spec,xs,ws,cpu_layouts", ci_first(
    [(d, *s, c) for d in ["float32", "bfloat16"] for s in SPECS for c in [True, False]], DENSE_CI))
def test_custom_vjp_dense_matches_reference(spec, xs, ws, dtype, cpu_layouts):
    assert D._plan(spec) is not None
    dt = jnp.dtype(dtype)
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, xs, jnp.float32)
    w = jax.random.normal(kw, ws, jnp.float32)
    y1, vjp1 = jax.vjp(lambda x, w: D.dense(x, w, spec, dt, cpu_layouts), x, w)
    y2, vjp2 = jax.vjp(lambda x, w: D.dense_reference(x, w, spec, dt), x, w)
    g = jax.random.normal(kg, y2.shape, jnp.float32)
    (dx1, dw1), (dx2, dw2) = vjp1(g), vjp2(g)
    assert y1.dtype == y2.dtype == jnp.float32
    assert dx1.dtype == x.dtype and dw1.dtype == w.dtype
    assert dx1.shape == x.shape and dw1.shape == w.shape
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))  # same forward product
    # float32: the same products in another association; bfloat16: the custom VJP also rounds the
    # cotangent to bfloat16 (as a bf16 result would), so a few bf16 ulps apart.
    rtol = 1e-5 if dtype == "float32" else 2e-2
    for a, b in ((dx1, dx2), (dw1, dw2)):
        err = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        assert err < rtol, err


@pytest.mark.parametrize("cpu_layouts", [True, False])
@pytest.mark.parametrize("spec,xs,ws", SPECS[1:3])
def test_bf16_products_are_the_rounded_float32_ones(spec, xs, ws, cpu_layouts):
    """out_dtype=bf16 (the GPU's choice): the same products written in bf16, the input gradient
    in bf16 before its cast back, the weight gradient still accumulated in float32."""
    bf = jnp.dtype("bfloat16")
    kx, kw, kg = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, xs, jnp.float32)
    w = jax.random.normal(kw, ws, jnp.float32)
    y1, vjp1 = jax.vjp(lambda x, w: D.dense(x, w, spec, bf, cpu_layouts, out_dtype=bf), x, w)
    y2, vjp2 = jax.vjp(lambda x, w: D.dense_reference(x, w, spec, bf), x, w)
    assert y1.dtype == bf and y2.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2.astype(bf)))
    g = jax.random.normal(kg, y2.shape, jnp.float32)
    (dx1, dw1), (dx2, dw2) = vjp1(g.astype(bf)), vjp2(g)
    assert dx1.dtype == x.dtype and dw1.dtype == w.dtype
    for a, b in ((dx1, dx2), (dw1, dw2)):
        err = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        assert err < 2e-2, err


def test_physical_swap_is_a_transpose():
    a = jnp.arange(2 * 3 * 5.0).reshape(2, 3, 5)
    for cpu in (True, False):
        np.testing.assert_array_equal(np.asarray(D.physical_swap(a, cpu)),
                                      np.asarray(jnp.swapaxes(a, -1, -2)))


@pytest.mark.parametrize("dtype,tol,out", [("float32", 1e-5, "float32"), ("bfloat16", 5e-2, "float32"),
                                           ("bfloat16", 5e-2, "bfloat16")])
def test_model_gradients_through_dense_match_reference(dtype, tol, out):
    """The model takes the custom VJP; its gradients match plain autodiff's (to bf16 accuracy), also
    with the matmuls writing bf16 (out, the GPU's choice) against the float32-writing reference."""
    cfg = tiny_model_config()
    params = nnx.state(GPT(cfg, rngs=nnx.Rngs(0)))
    x = jax.random.randint(jax.random.key(1), (2, 16), 0, 65)

    def loss(p, rt):
        gd = nnx.graphdef(GPT(cfg, rngs=nnx.Rngs(0), runtime=rt))
        logits, _ = nnx.merge(gd, p)(x)
        return jnp.mean(jax.nn.logsumexp(logits, -1))

    gpu_form = {} if out == "float32" else {"cpu_layouts": False}  # the GPU's combination
    custom = tiny_runtime(cfg, dtype=dtype, matmul_out=jnp.dtype(out), **gpu_form)
    ref = tiny_runtime(cfg, dtype=dtype, dense_vjp=False)
    assert "name=_dense_vjp" in str(jax.make_jaxpr(loss, static_argnums=1)(
        params, custom))
    assert "name=_dense_vjp" not in str(jax.make_jaxpr(loss, static_argnums=1)(params, ref))
    g_custom, g_ref = jax.grad(loss)(params, custom), jax.grad(loss)(params, ref)
    for a, b in zip(jax.tree.leaves(g_custom), jax.tree.leaves(g_ref)):
        scale = float(jnp.max(jnp.abs(b))) or 1.0
        assert float(jnp.max(jnp.abs(a - b))) / scale < tol


@pytest.mark.parametrize("rows", [1, 5, D.FEW_ROWS + 1])  # matvec, few rows, GEMM
@pytest.mark.parametrize("spec,xs,ws", SPECS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_dense_with_out_in_weights_matches_reference(spec, xs, ws, dtype, rows):
    """decode_dense on the weight permuted by contract_last == the einsum on the original weight."""
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (rows, 1, *xs[2:]), jnp.float32)
    w = jax.random.normal(kw, ws, jnp.float32)
    perm, spec_t = D.contract_last(spec)
    assert D.contract_last(spec_t) == (tuple(range(len(ws))), spec_t)  # already [out, in]
    ref = D.dense_reference(x, w, spec, jnp.dtype(dtype))
    # few_rows=False (the GPU's): few rows by a dot too
    for few_rows in (True, False) if 2 <= rows <= D.FEW_ROWS else (True,):
        y = jax.jit(lambda x, w: D.decode_dense(x, w, spec, jnp.dtype(dtype), few_rows=few_rows))(
            x, jnp.transpose(w, perm))
        assert y.shape == ref.shape and y.dtype == jnp.float32
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)  # bf16: the same rounded inputs


def test_contract_last_layouts():
    assert D.contract_last("btd,df->btf") == ((1, 0), "btd,fd->btf")
    assert D.contract_last("bthk,hkd->btd") == ((2, 0, 1), "bthk,dhk->btd")
    assert D.contract_last("btd,dchk->btchk") == ((1, 2, 3, 0), "btd,chkd->btchk")
    with pytest.raises(ValueError, match="not a dense spec"):
        D.contract_last("bd,bd->b")
