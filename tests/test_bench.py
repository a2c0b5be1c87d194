"""Benchmark scripts run end to end (no timing asserts), and the custom-VJP dense matches the einsum."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt import model as M

REPO = Path(__file__).resolve().parent.parent


def _run(script: str, *args: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_bench_train_smoke():
    out = _run("train.py", "--preset=tiny", "--steps=2", "--warmup=1", "--ceiling_n=128",
               "--ceiling_reps=2", "--dtypes=float32,bfloat16")
    for k in ("tokens_per_sec", "model_tflops", "ceiling_tflops", "mfu_measured", "mfu_vendor",
              "compile_sec", "device", "dtype", "step_ms"):
        assert k in out
    assert out["dtype"] == "bfloat16" and [r["dtype"] for r in out["runs"]] == ["float32", "bfloat16"]
    assert "speedup_vs_float32" in out and len(out["speedup_per_round"]) == 2  # interleaved rounds


def test_bench_sample_smoke():
    out = _run("sample.py", "--configs=tiny", "--batches=1,2", "--new_tokens=4", "--reps=1")
    rows = out["results"]
    assert [r["batch"] for r in rows] == [1, 2]
    for k in ("prefill_ms", "decode_tokens_per_sec", "baseline_tokens_per_sec", "speedup"):
        assert k in rows[0]
    assert rows[0]["baseline_tokens_per_sec"] > 0 and rows[1]["baseline_tokens_per_sec"] is None


SPECS = [("btd,dchk->btchk", (2, 5, 16), (16, 3, 2, 8)),
         ("bthk,hkd->btd", (2, 5, 2, 8), (2, 8, 16)),
         ("btd,df->btf", (2, 5, 16), (16, 64)),
         ("btf,fd->btd", (2, 5, 64), (64, 16)),
         ("btd,vd->btv", (2, 5, 16), (128, 16))]


@pytest.mark.parametrize("cpu_layouts", [True, False])  # False: the GPU/TPU form, on the CPU
@pytest.mark.parametrize("spec,xs,ws", SPECS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_custom_vjp_dense_matches_einsum(spec, xs, ws, dtype, cpu_layouts, monkeypatch):
    monkeypatch.setattr(M, "_cpu_layouts", lambda: cpu_layouts)
    assert M._dense_plan(spec) is not None
    dt = jnp.dtype(dtype)
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, xs, jnp.float32)
    w = jax.random.normal(kw, ws, jnp.float32)
    custom = lambda x, w: M._dense_vjp(x, w, spec, dt)  # the custom VJP, in either dtype
    ref = lambda x, w: M.dense_einsum(x, w, spec, dt)
    y1, vjp1 = jax.vjp(custom, x, w)
    y2, vjp2 = jax.vjp(ref, x, w)
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


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 5e-2)])
def test_dense_dispatch_and_grad_through_model(dtype, tol):
    """`dense` takes the custom VJP; the model's gradients match the einsum's (to bf16 accuracy in
    bfloat16)."""
    from flax import nnx
    from conftest import tiny_model_config
    cfg = tiny_model_config(dtype=dtype)
    model = M.GPT(cfg, rngs=nnx.Rngs(0))
    gd, params = nnx.split(model)
    x = jax.random.randint(jax.random.key(1), (2, 16), 0, 65)

    def loss(p):
        logits, _ = nnx.merge(gd, p)(x)
        return jnp.mean(jax.nn.logsumexp(logits, -1))

    assert "name=_dense_vjp" in str(jax.make_jaxpr(loss)(params))
    g_custom = jax.grad(loss)(params)
    orig = M.dense
    try:
        M.dense = M.dense_einsum
        g_ref = jax.grad(loss)(params)
    finally:
        M.dense = orig
    for a, b in zip(jax.tree.leaves(g_custom), jax.tree.leaves(g_ref)):
        scale = float(jnp.max(jnp.abs(b))) or 1.0
        assert float(jnp.max(jnp.abs(a - b))) / scale < tol


def test_gpu_suite_runs_at_tiny_size(tmp_path):
    """bench/gpu.py end to end on CPU with tiny models: every part runs and lands in gpu.json,
    gpu.md and loss.png (the GPU tests are skipped off a GPU)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, str(REPO / "bench" / "gpu.py"), f"--out={tmp_path}",
                        "--size=tiny"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "gpu.json").read_text())["parts"]
    assert res["tests"]["exit"] == 0 and res["tests"]["skipped"] > 0
    assert all("error" not in v and v["tokens_per_sec"] > 0 for v in res["train"].values())
    assert res["train"]["b4-scan"]["flags"][-1] == "--scan_layers"
    rows = [row for w in ("compute", "float32") for row in res["sample"][w]["results"]]
    assert len(rows) == 4 and all(0 < row["bw_util"] for row in rows)
    assert res["curve"]["exit"] == 0 and [s for s, *_ in res["curve"]["eval"]] == [10, 20]
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert "## Training step" in (tmp_path / "gpu.md").read_text()


def test_profile_reports_device_time():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, str(REPO / "bench" / "profile.py"), "train", "--preset=tiny",
                        "--steps=2", "--top=5"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "train: per step" in r.stdout and " ms/step" in r.stdout
