"""Data parallel, FSDP and tensor parallel training on an 8-device CPU mesh.

The pytest process has one CPU device, and the device count is fixed when jax starts, so the 8-device
work runs in a subprocess: this file, run as a script with
XLA_FLAGS=--xla_force_host_platform_device_count=8, trains through `gpt.train.train` on each mesh and
prints JSON (losses, each parameter's and optimizer leaf's PartitionSpec and shard shapes, state
bytes, checkpoint round trips). The one-device reference runs here in the pytest process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import xla_flags

REPO = Path(__file__).resolve().parent.parent
N_DEV = 8
FAST_MESHES = ["data:2,fsdp:2,tensor:2"]  # one compile that exercises all three axes together
SLOW_MESHES = ["data:8", "fsdp:8", "data:2,fsdp:4", "data:4,tensor:2", "fsdp:4,tensor:2"]
STEPS = 5
REL_TOL = 1e-5


# ----------------------------------------------------------------------------- shared helpers
# (used both here and in the 8-device subprocess; jax is imported lazily)


def _model():
    from gpt.config import ModelConfig
    return ModelConfig(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32, bias=True)


def _compute():
    from gpt.config import ComputeConfig
    return ComputeConfig(dropout=0.1, dtype="float32")  # dropout on: masks must not depend on the mesh


def _train_cfg(data_dir, out_dir, mesh: str, **kw):
    from gpt.config import TrainConfig
    base = dict(out_dir=str(out_dir), data_dir=str(data_dir), batch_size=8, max_iters=STEPS,
                log_interval=1, eval_interval=STEPS, eval_iters=1, warmup_iters=1, progress=False,
                mesh=mesh, seed=0)
    base.update(kw)
    return TrainConfig(**base)


def _run_train(data_dir, out_dir, mesh: str) -> dict:
    from gpt import train as train_lib
    setup = train_lib.prepare_setup(_model(), _compute(), _train_cfg(data_dir, out_dir, mesh), set())
    return train_lib.train(setup, log=lambda msg: None)


def _make_state(data_dir, mesh_spec: str):
    """Parameters and optimizer state on `mesh_spec`, sharded as the trainer shards them, every
    element distinct (biases, norm scales and AdamW's moments too, which start constant): a shard
    restored to the wrong place cannot go unnoticed."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from gpt import sharding
    from gpt.model import GPT
    from gpt.train import make_optimizer

    m, t = _model(), _train_cfg(data_dir, "unused", mesh_spec)
    mesh = sharding.make_mesh(mesh_spec)
    _, shapes = nnx.split(nnx.eval_shape(lambda: GPT(m, rngs=nnx.Rngs(0))))
    p_shard = sharding.param_shardings(shapes, mesh)
    params = jax.jit(lambda: nnx.to_pure_dict(nnx.state(GPT(m, rngs=nnx.Rngs(0)))),
                     out_shardings=p_shard)()
    tx = make_optimizer(t)
    o_shard = sharding.like_params(jax.eval_shape(tx.init, params), p_shard, mesh)
    opt = jax.jit(tx.init, out_shardings=o_shard)(params)

    def distinct(x):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x + 3
        return x + 1e-3 * jnp.arange(x.size, dtype=x.dtype).reshape(x.shape)
    params, opt = jax.jit(lambda p, o: jax.tree.map(distinct, (p, o)),
                          out_shardings=(p_shard, o_shard))(params, opt)
    return mesh, params, opt, p_shard, o_shard


def _flat(tree) -> dict[str, np.ndarray]:
    import jax
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _save(out_dir, params, opt) -> None:
    from gpt import checkpoint as ckpt
    c = ckpt.Checkpointer(out_dir, keep=1)
    c.save(1, params, opt, {"step": 1}, None)
    c.close()
    np.savez(Path(out_dir) / "expected.npz", **_flat((params, opt)))


def _restore(out_dir, like_params, like_opt, p_shard, o_shard):
    """Restore step 1 of `out_dir` onto the given shardings (Orbax reshards on read)."""
    import jax

    from gpt import checkpoint as ckpt
    abstract = lambda tree, sh: jax.tree.map(  # noqa: E731
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)
    _, params, opt, _ = ckpt.Checkpointer(out_dir, read_only=True).restore(
        abstract(like_params, p_shard), abstract(like_opt, o_shard))
    return params, opt


def _bit_identical(out_dir, params, opt) -> list[str]:
    """Names of leaves that differ from the saved expected.npz (empty: bit-identical)."""
    expected = np.load(Path(out_dir) / "expected.npz")
    got = _flat((params, opt))
    bad = sorted(set(expected.files) ^ set(got))
    for k, v in got.items():
        if k in expected.files and (v.dtype != expected[k].dtype or v.shape != expected[k].shape
                                    or v.tobytes() != expected[k].tobytes()):
            bad.append(k)
    return bad


def _describe(tree) -> dict[str, dict]:
    """Per leaf: PartitionSpec, shard shape, number of distinct shards, all shards same shape."""
    import jax
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shards = x.addressable_shards
        spec = [list(a) if isinstance(a, tuple) else a for a in x.sharding.spec]
        out[jax.tree_util.keystr(path)] = {
            "spec": spec, "shape": list(x.shape),
            "shard_shape": list(shards[0].data.shape),
            "distinct": len({str(s.index) for s in shards}),
            "uniform": len({s.data.shape for s in shards}) == 1,
        }
    return out


# ----------------------------------------------------------------------------- 8-device worker


def _worker(job: dict) -> dict:
    import jax

    from gpt import sharding

    assert jax.device_count() == N_DEV, jax.device_count()
    res: dict = {"meshes": {}}
    captured = {}
    real_state_bytes = sharding.state_bytes

    def spy(tree):  # train() reports its live (params, opt_state) here, right after building them
        captured["tree"] = _describe(tree)
        captured["bytes"] = real_state_bytes(tree)
        return captured["bytes"]
    sharding.state_bytes = spy
    for mesh in job["meshes"]:
        t0 = time.perf_counter()
        summary = _run_train(job["data_dir"], Path(job["out"]) / mesh.replace(":", "").replace(",", "_"),
                             mesh)
        res["meshes"][mesh] = {"losses": summary["train_losses"], "state": captured.pop("tree"),
                               "bytes": captured.pop("bytes"), "sec": time.perf_counter() - t0}
    sharding.state_bytes = real_state_bytes

    if job.get("checkpoints"):
        # FSDP over 8 devices -> checkpoint (restored on one device by the pytest process).
        mesh, params, opt, p_shard, o_shard = _make_state(job["data_dir"], "fsdp:8")
        res["fsdp8_state"] = _describe((params, opt))
        res["fsdp8_bytes"] = sharding.state_bytes((params, opt))
        _save(job["fsdp8_ckpt"], params, opt)
        # One-device checkpoint (saved by the pytest process) -> FSDP over 8 devices.
        r_params, r_opt = _restore(job["one_ckpt"], params, opt, p_shard, o_shard)
        res["one_to_fsdp8_diff"] = _bit_identical(job["one_ckpt"], r_params, r_opt)
        res["one_to_fsdp8_state"] = _describe((r_params, r_opt))
    return res


def run_worker(job: dict, timeout: int = 300) -> dict:
    env = dict(os.environ, XLA_FLAGS=xla_flags(N_DEV),
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, __file__, json.dumps(job)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # nothing gathered whole onto every device (gpt.runtime.on_mesh: the CPU's flattened layouts
    # with the batch rows split over data and fsdp)
    assert "Involuntary full rematerialization" not in proc.stderr, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def reference(char_data, tmp_path_factory):
    """One device: the losses to match, and a checkpoint for the FSDP worker to restore."""
    import jax
    assert jax.device_count() == 1
    root = tmp_path_factory.mktemp("one_device")
    summary = _run_train(char_data, root / "run", "")
    _, params, opt, p_shard, o_shard = _make_state(char_data, "")
    _save(root / "ckpt", params, opt)
    return {"losses": summary["train_losses"], "ckpt": root / "ckpt",
            "like": (params, opt, p_shard, o_shard)}


@pytest.fixture(scope="module")
def worker(char_data, reference, tmp_path_factory):
    root = tmp_path_factory.mktemp("eight_devices")
    t0 = time.perf_counter()
    res = run_worker({"data_dir": str(char_data), "out": str(root), "meshes": FAST_MESHES,
                      "checkpoints": True, "one_ckpt": str(reference["ckpt"]),
                      "fsdp8_ckpt": str(root / "fsdp8_ckpt")})
    res["fsdp8_ckpt"] = root / "fsdp8_ckpt"
    res["sec"] = time.perf_counter() - t0
    return res


def _assert_same_losses(got, ref, mesh):
    assert [s for s, _ in got] == [s for s, _ in ref] == list(range(1, STEPS + 1))
    for (step, a), (_, b) in zip(got, ref):
        assert abs(a - b) <= REL_TOL * abs(b), f"mesh {mesh}, step {step}: {a} vs one device {b}"


# ----------------------------------------------------------------------------- mesh parsing (1 device)


def test_parse_mesh():
    from gpt.errors import UserError
    from gpt.sharding import parse_mesh
    assert parse_mesh("", 8) == {"data": 8, "fsdp": 1, "expert": 1, "tensor": 1}
    assert parse_mesh("data:2,fsdp:4", 8) == {"data": 2, "fsdp": 4, "expert": 1, "tensor": 1}
    assert parse_mesh("fsdp:4, tensor:2", 8) == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 2}
    assert parse_mesh("data:2,expert:4", 8) == {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}
    for bad, words in [("data:3", "uses 3 devices but 8"), ("model:8", "unknown axis 'model'"),
                       ("data:x", "needs a size"), ("data:0,fsdp:8", "positive size"),
                       ("data:4,data:2", "names axis data twice"), ("data:+8", "needs a size"),
                       ("data:1_0", "needs a size"), ("data:\u0668", "needs a size")]:
        with pytest.raises(UserError, match=words):
            parse_mesh(bad, 8)


def test_weights_fsdp_cannot_split_are_named():
    """fsdp needs a dimension it divides exactly: GPT-2 XL's attention weights (n_embd 1600, 25
    heads of 64) stay whole on every device of fsdp:128, a third of the model; fsdp:64 splits them."""
    from types import SimpleNamespace
    from flax import nnx
    from gpt.config import build_train
    from gpt.model import abstract_model
    from gpt.sharding import fsdp_left_whole
    m = build_train(["--preset=gpt2-xl"])[0]
    state = nnx.state(abstract_model(m, 0))
    mesh = lambda n: SimpleNamespace(shape={"data": 1, "fsdp": n, "expert": 1, "tensor": 1})  # noqa: E731
    line = fsdp_left_whole(state, mesh(128))
    assert line.startswith("warning: fsdp:128 divides no dimension of blocks/b_qkv, blocks/w_o, blocks/w_qkv "
                           "(31.6% of the parameters)")
    assert fsdp_left_whole(state, mesh(64)) is None and fsdp_left_whole(state, mesh(1)) is None


def test_readme_mesh_commands_fit_their_meshes():
    """Every train.py command of README.md with a --mesh passes the start-up checks of that mesh
    (the global batch over data x fsdp x expert, heads and MLP width over tensor, experts)."""
    import math
    import re
    import shlex
    from types import SimpleNamespace
    from gpt.config import build_train
    from gpt.sharding import check_divisibility, parse_mesh
    text = (REPO / "README.md").read_text().replace("\\\n", " ")
    commands = [ln for ln in text.splitlines() if "train.py" in ln and "--mesh=" in ln]
    assert len(commands) >= 7
    for line in commands:
        args = [a for a in shlex.split(line.split("train.py", 1)[1].split("#")[0].rstrip('"'))
                if a.startswith("--") and a != "--distributed" and not a.startswith(("--coordinator", "--num_pro",
                                                                                      "--process_id", "--out_dir"))]
        m, _, t, _ = build_train(args)
        spec = re.search(r"--mesh=(\S+)", line)[1]
        n = math.prod(int(part.split(":")[1]) for part in spec.split(","))
        sizes = parse_mesh(spec, n)
        check_divisibility(m, SimpleNamespace(shape=sizes, size=n), t.batch_size)


@pytest.mark.parametrize("preset, spec, batch, fix", [
    ("gpt2", "tensor:8", 16, "e.g. --mesh=data:2,tensor:4"),
    ("gpt2-xl", "fsdp:4,tensor:2", 16, "e.g. --mesh=data:2,fsdp:4"),
    # data:8 would not divide the batch of 12: no mesh is suggested, the batch is named
    ("gpt2-xl", "data:4,tensor:2", 12, "with a --batch_size the other axes divide")])
def test_a_tensor_size_that_does_not_fit_suggests_a_whole_mesh_that_does(preset, spec, batch, fix):
    from types import SimpleNamespace
    from gpt.config import build_train
    from gpt.errors import UserError
    from gpt.sharding import check_divisibility, parse_mesh
    m = build_train([f"--preset={preset}"])[0]
    mesh = SimpleNamespace(shape=parse_mesh(spec, 8), size=8)
    with pytest.raises(UserError, match="is not divisible by the tensor-parallel degree") as e:
        check_divisibility(m, mesh, batch)
    assert str(e.value).endswith(fix)
    if "--mesh=" in fix:  # and the suggestion passes
        check_divisibility(m, SimpleNamespace(shape=parse_mesh(fix.split("=")[1], 8), size=8), batch)


def test_make_mesh_on_a_subset_and_batch_layout():
    import jax

    from gpt import sharding
    mesh = sharding.make_mesh("data:1", devices=jax.devices()[:1])
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}
    assert sharding.batch_process_layout(mesh) == (0, 1)


# ----------------------------------------------------------------------------- 8 devices


@pytest.mark.parametrize("mesh", FAST_MESHES)
def test_losses_match_one_device(worker, reference, mesh):
    _assert_same_losses(worker["meshes"][mesh]["losses"], reference["losses"], mesh)


def _leaf(state: dict, name: str, which: int = 0) -> dict:
    """The entry of parameter `name` in params ([0]...) or the first Adam moment ([1]...mu)."""
    keys = [k for k in state if k.endswith(f"['{name}']")]
    keys = [k for k in keys if k.startswith("[0]")] if which == 0 else \
        [k for k in keys if k.startswith("[1]") and ".mu" in k]
    assert len(keys) == 1, (name, keys)
    return state[keys[0]]


def test_params_and_optimizer_state_are_sharded(worker):
    L, D, H, K, F, V = 2, 32, 2, 16, 128, 128
    # FSDP over 8: each matrix's largest dimension split 8 ways; Adam moments follow the parameter.
    st = worker["fsdp8_state"]
    for which in (0, 1):
        w_fc = _leaf(st, "w_fc", which)
        assert w_fc["spec"] == [None, None, "fsdp"] and w_fc["shard_shape"] == [L, D, F // 8]
        assert w_fc["distinct"] == 8 and w_fc["uniform"]
        w_proj = _leaf(st, "w_proj", which)
        assert w_proj["spec"] == [None, "fsdp", None] and w_proj["shard_shape"] == [L, F // 8, D]
        wte = _leaf(st, "wte", which)
        assert wte["shard_shape"] == [V // 8, D] and wte["distinct"] == 8
    # data x FSDP x tensor, as train() built them: heads, MLP width and vocabulary over `tensor`,
    # then the largest remaining dimension over `fsdp`; replicated over the 2 data-parallel groups.
    st = worker["meshes"]["data:2,fsdp:2,tensor:2"]["state"]
    for which in (0, 1):
        w_qkv = _leaf(st, "w_qkv", which)
        assert w_qkv["spec"] == [None, "fsdp", None, "tensor", None]
        assert w_qkv["shard_shape"] == [L, D // 2, 3, H // 2, K] and w_qkv["distinct"] == 4
        w_fc = _leaf(st, "w_fc", which)
        assert w_fc["spec"] == [None, "fsdp", "tensor"] and w_fc["shard_shape"] == [L, D // 2, F // 2]
        w_o = _leaf(st, "w_o", which)
        assert w_o["spec"][1] == "tensor" and w_o["shard_shape"][1] == H // 2
        wte = _leaf(st, "wte", which)
        assert wte["spec"] == ["tensor", "fsdp"] and wte["shard_shape"] == [V // 2, D // 2]
        assert wte["distinct"] == 4 and wte["uniform"]


def test_fsdp_per_device_bytes(worker):
    """params+optimizer per device ~ total / N: only LayerNorm vectors, 1-D biases and Adam's step
    counters are replicated (about 2% of this tiny model; far less for real ones)."""
    total, per_dev = worker["fsdp8_bytes"]
    assert total / N_DEV <= per_dev <= 1.25 * total / N_DEV, (total, per_dev)
    total4, per_dev4 = worker["meshes"]["data:2,fsdp:2,tensor:2"]["bytes"]  # split 2 x 2 ways
    assert total4 == total
    assert total / 4 <= per_dev4 <= 1.25 * total / 4, (total4, per_dev4)


def test_one_device_checkpoint_restores_onto_fsdp8(worker):
    assert worker["one_to_fsdp8_diff"] == []
    w_fc = _leaf(worker["one_to_fsdp8_state"], "w_fc", 1)
    assert w_fc["spec"] == [None, None, "fsdp"] and w_fc["distinct"] == 8


def test_fsdp8_checkpoint_restores_on_one_device(worker, reference):
    like_params, like_opt, p_shard, o_shard = reference["like"]
    params, opt = _restore(worker["fsdp8_ckpt"], like_params, like_opt, p_shard, o_shard)
    assert _bit_identical(worker["fsdp8_ckpt"], params, opt) == []
    import jax
    assert all(len(x.sharding.device_set) == 1 for x in jax.tree.leaves((params, opt)))


@pytest.mark.slow
def test_losses_match_one_device_other_meshes(char_data, reference, tmp_path):
    res = run_worker({"data_dir": str(char_data), "out": str(tmp_path), "meshes": SLOW_MESHES})
    for mesh in SLOW_MESHES:
        _assert_same_losses(res["meshes"][mesh]["losses"], reference["losses"], mesh)
    w_fc = _leaf(res["meshes"]["fsdp:8"]["state"], "w_fc")
    assert w_fc["shard_shape"] == [2, 32, 128 // 8]
    w_qkv = _leaf(res["meshes"]["data:4,tensor:2"]["state"], "w_qkv", 1)
    assert w_qkv["spec"] == [None, None, None, "tensor", None] and w_qkv["shard_shape"][3] == 1
    w_fc = _leaf(res["meshes"]["data:8"]["state"], "w_fc")
    assert w_fc["shard_shape"] == [2, 32, 128] and w_fc["distinct"] == 1  # pure data parallel
    w_fc = _leaf(res["meshes"]["data:2,fsdp:4"]["state"], "w_fc", 1)
    assert w_fc["spec"] == [None, None, "fsdp"] and w_fc["shard_shape"] == [2, 32, 128 // 4]
    w_qkv = _leaf(res["meshes"]["fsdp:4,tensor:2"]["state"], "w_qkv")
    assert w_qkv["spec"] == [None, "fsdp", None, "tensor", None]
    assert w_qkv["shard_shape"] == [2, 32 // 4, 3, 1, 16] and w_qkv["distinct"] == 8


def test_rows_split_over_data_and_fsdp_are_not_gathered(char_data, tmp_path):
    """README's CPU example: with the batch rows split over two axes, the CPU's flattened layouts
    made XLA's partitioner gather tensors whole onto every device (gpt.runtime.on_mesh)."""
    env = dict(os.environ, XLA_FLAGS=xla_flags(4), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "train.py", "--preset=tiny", f"--data_dir={char_data}",
                           f"--out_dir={tmp_path / 'out'}", "--progress=false", "--mesh=data:2,fsdp:2",
                           "--batch_size=4", "--max_iters=1", "--dtype=float32"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Involuntary full rematerialization" not in proc.stderr, proc.stderr[-2000:]


# ----------------------------------------------------------------------------- bad input (train.py)


@pytest.mark.parametrize("args, words", [
    (["--mesh=data:3"], "uses 3 devices but 4 are available"),
    (["--mesh=model:4"], "unknown axis 'model'"),
    (["--mesh=data:2,fsdp:2", "--batch_size=6"], "--batch_size=6 is not divisible by the "
                                                  "data-parallel degree 4"),
    (["--mesh=data:2,tensor:2", "--n_head=3", "--n_embd=48"], "--n_head=3 is not divisible by the "
                                                              "tensor-parallel degree 2"),
])
def test_bad_mesh_input(char_data, tmp_path, args, words):
    env = dict(os.environ, XLA_FLAGS=xla_flags(4), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "train.py", "--preset=tiny", f"--data_dir={char_data}",
                           f"--out_dir={tmp_path / 'out'}", "--progress=false", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    assert words in lines[0]
    assert "Traceback" not in proc.stderr


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    print(json.dumps(_worker(json.loads(sys.argv[1]))), flush=True)


_GQA_SCRIPT = """
import json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from gpt import sharding
from gpt.config import ModelConfig
from gpt.model import GPT
cfg = ModelConfig(vocab_size=65, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                  bias=False, pos_embedding="rope", norm="rmsnorm", mlp="swiglu", tie_embeddings=False)
model = GPT(cfg, rngs=nnx.Rngs(0))
gd, state = nnx.split(model)
params = nnx.to_pure_dict(state)
x = jax.random.randint(jax.random.key(1), (4, 16), 0, 65)
loss = lambda p, x: jnp.mean(jax.nn.logsumexp(nnx.merge(gd, p)(x)[0][..., :65], -1))
ref_l, ref_g = jax.value_and_grad(loss)(params, x)
out = {}
for spec in ("tensor:4", "fsdp:2,tensor:2"):
    mesh = sharding.make_mesh(spec)
    shard = sharding.param_shardings(state, mesh)
    p = jax.device_put(params, shard)
    xs = jax.device_put(x, sharding.batch_sharding(mesh))
    l, g = jax.jit(jax.value_and_grad(loss))(p, xs)
    kv = shard["blocks"]["w_kv"].spec
    err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)))
    out[spec] = [abs(float(l) - float(ref_l)), err, str(kv), str(shard["blocks"]["w_q"].spec)]
print(json.dumps(out))
"""


@pytest.mark.slow  # 35 s in a 4-device subprocess
def test_gqa_sharded_equals_one_device():
    """Tensor parallelism shards query heads; key/value heads too where the tensor axis divides
    them (2 KV heads over 2), else they stay replicated (2 over 4): loss and gradients == one device."""
    from helpers import run_on_4_cpu_devices
    out = run_on_4_cpu_devices(_GQA_SCRIPT)
    for spec, (dl, dg, kv, q) in out.items():
        assert dl < 1e-5 and dg < 1e-5, (spec, dl, dg)
        assert "tensor" in q
    assert "tensor" not in out["tensor:4"][2] and "tensor" in out["fsdp:2,tensor:2"][2]


_CHUNKED_LOSS_SCRIPT = """
import json
import jax, numpy as np
from flax import nnx
from gpt import sharding, train
from gpt.config import ComputeConfig, ModelConfig
from gpt.model import GPT
from gpt.runtime import resolve
cfg = ModelConfig(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_embd=32, bias=True)
x = jax.random.randint(jax.random.key(1), (4, 16), 0, 61)
def run(chunks, spec):
    model = GPT(cfg, rngs=nnx.Rngs(0), runtime=resolve(cfg, ComputeConfig(loss_chunks=chunks), attention="reference"))
    gd, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    fn = jax.jit(jax.value_and_grad(lambda p, x: train.loss_fn(gd, p, x, x)))
    if spec is None:
        return fn(params, x)
    mesh = sharding.make_mesh(spec)
    p = jax.device_put(params, sharding.param_shardings(state, mesh))
    return fn(p, jax.device_put(x, sharding.batch_sharding(mesh)))
ref_l, ref_g = run(1, None)
out = {}
for spec in ("data:4", "fsdp:2,tensor:2"):
    l, g = run(3, spec)
    err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)))
    out[spec] = [abs(float(l) - float(ref_l)), err]
print(json.dumps(out))
"""


@pytest.mark.slow  # a 4-device subprocess
def test_chunked_loss_sharded_equals_one_device():
    """The loss in slices of T (--loss_chunks) over a batch-sharded and a tensor-parallel mesh ==
    the whole loss on one device, in value and gradients."""
    from helpers import run_on_4_cpu_devices
    out = run_on_4_cpu_devices(_CHUNKED_LOSS_SCRIPT)
    for spec, (dl, dg) in out.items():
        assert dl < 1e-5 and dg < 1e-5, (spec, dl, dg)


def test_a_resumed_runs_batch_that_the_mesh_does_not_divide_asks_for_another_mesh():
    """A resumed run keeps its --batch_size, so "use a multiple of 16" led to a second error; the
    fix there is a mesh that divides the batch."""
    from types import SimpleNamespace
    from gpt.errors import UserError
    from gpt.sharding import check_divisibility
    from helpers import tiny_model_config
    mesh = SimpleNamespace(shape={"data": 16, "fsdp": 1, "expert": 1, "tensor": 1})
    with pytest.raises(UserError, match="degree 16 .*; use a multiple of 16$"):
        check_divisibility(tiny_model_config(), mesh, 8)
    with pytest.raises(UserError, match="pass a --mesh whose data x fsdp x expert divides 8 \\(a resumed run"):
        check_divisibility(tiny_model_config(), mesh, 8, resuming=True)
