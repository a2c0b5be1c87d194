"""LoRA fine-tuning (gpt/lora.py): a fresh adapter changes nothing, training moves the adapters
only and keeps no optimizer state for the base, merged equals unmerged, resume is exact, any mesh
gives one device's losses, and sampling / --merge_lora / --to_hf read a LoRA run through its base.

The bases are random models of the GPT-2 and the modern block (RoPE, RMSNorm, SwiGLU, GQA, untied
head) saved as checkpoints with the test corpus's tokenizer: no pre-training needed.
"""
from __future__ import annotations

import json
import os
from functools import partial
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from helpers import REPO, tiny_model_config, tiny_runtime, xla_flags
from test_train import configs, run
from gpt import checkpoint as ckpt
from gpt import lora as L
from gpt import sharding
from gpt import train as T
from gpt.config import build_train, to_dict
from gpt.errors import UserError
from gpt.model import GPT, abstract_model

ARCHS = {"gpt2": dict(), "llama": dict(n_head=4, n_kv_head=2, pos_embedding="rope", norm="rmsnorm",
                                       mlp="swiglu", bias=False, tie_embeddings=False)}
LORA = ["--lora_rank=4", "--lora_alpha=8"]


def arch_config(arch: str, vocab_size: int = 65):
    return tiny_model_config(vocab_size=vocab_size, **ARCHS[arch])


def targets(cfg) -> tuple[str, ...]:
    attn = ("w_qkv",) if cfg.kv_heads == cfg.n_head else ("w_q", "w_kv")
    return (*attn, "w_o", "w_fc", "w_proj")


def random_params(cfg, seed: int = 0) -> dict:
    """Random base parameters of `cfg` drawn on the host (norm scales near 1, the rest N(0, 0.02^2)):
    building a GPT eagerly compiles every initialiser op by op, seconds per model here."""
    rng = np.random.default_rng(seed)
    scale = lambda name: "scale" in name or "norm" in name or "alpha" in name  # noqa: E731
    draw = lambda path, x: ((1.0 if scale(jax.tree_util.keystr(path)) else 0.0)  # noqa: E731
                            + (0.1 if scale(jax.tree_util.keystr(path)) else 0.02)
                            * rng.standard_normal(x.shape)).astype(np.float32)
    return jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(nnx.state(abstract_model(cfg))))


def build(cfg, params: dict, lora=None, adapters=None, **runtime) -> GPT:
    """A model of `cfg` holding `params` (and `lora`'s `adapters`), built from shapes alone."""
    graphdef = nnx.graphdef(abstract_model(cfg, runtime=tiny_runtime(cfg, **runtime), lora=lora))
    if adapters is not None:
        params = {**params, "blocks": {**params["blocks"], **adapters["blocks"]}}
    return nnx.merge(graphdef, params)


def save_base(out, cfg, tokenizer: dict, seed: int = 0, step: int = 0, params=None) -> None:
    """A model of `cfg` (random, or `params`) saved as a checkpoint, as gpt.convert --from_hf does."""
    if params is None:
        params = random_params(cfg, seed)
    meta = {"format_version": ckpt.FORMAT_VERSION, "step": step, "tokenizer": tokenizer,
            "config": {"model": to_dict(cfg), "train": {}}}
    c = ckpt.Checkpointer(out, keep=1, async_save=False)
    c.save(step, params, {"none": np.zeros((), np.int32)}, meta, None)
    c.close()


@pytest.fixture(scope="module")
def bases(tmp_path_factory, char_data):
    root = tmp_path_factory.mktemp("bases")
    meta = json.loads((char_data / "meta.json").read_text())
    for arch in ARCHS:
        save_base(root / arch, arch_config(arch, meta["vocab_size"]), meta["tokenizer"])
    return root


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, char_data, bases):
    """A LoRA run (adapter dropout on) from each base: the modern block's as `mesh_train` runs it on
    one device (the reference of the resume and mesh tests), the GPT-2 block's 2 steps in bfloat16."""
    root = tmp_path_factory.mktemp("lora_runs")
    ref = mesh_train(char_data, bases / "llama", root / "llama", "")
    r = run(root / "gpt2", char_data, f"--init_from={bases / 'gpt2'}", *LORA, "--lora_dropout=0.1",
            "--max_iters=2", "--eval_interval=2", "--dtype=bfloat16")
    assert all(np.isfinite(loss) for _, loss in r["train_losses"]) and np.isfinite(r["val_loss"])
    return root, ref


def lora_setup(out, data, base, *argv):
    return T.prepare_setup(*configs(out, data, f"--init_from={base}", *LORA, *argv))


def flat(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, x):
    return nnx.merge(graphdef, state)(x)[0]


def logits(model, x) -> np.ndarray:
    """The model's logits over the real vocabulary (one compiled call, not op by op)."""
    graphdef, state = nnx.split(model)
    return np.asarray(_forward(graphdef, state, x))[..., :model.cfg.vocab_size]


def random_adapters(cfg, lora, seed: int = 1) -> dict:
    """Adapters with random values everywhere (B included, which starts at zero)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: (0.1 * rng.standard_normal(x.shape)).astype(np.float32),
                        L.init_adapters(cfg, lora, 0))


# ----------------------------------------------------------------------------- the model


@pytest.mark.parametrize("arch,dtype", [("gpt2", "float32"), ("llama", "float32"), ("llama", "bfloat16")])
def test_fresh_lora_model_equals_its_base(arch, dtype):
    """Fresh adapters (training's `init_adapters`: A random, B zero) leave the logits those of the base."""
    cfg = arch_config(arch)
    lora = L.LoRAConfig(4, 8.0, targets(cfg))
    base_params, adapters = random_params(cfg), L.init_adapters(cfg, lora, seed=0)
    assert all(np.abs(a).max() > 0 for k, a in flat(adapters).items() if "lora_a" in k)
    assert all(not a.any() for k, a in flat(adapters).items() if "lora_b" in k)
    model = build(cfg, base_params, lora, adapters, dtype=dtype)
    assert flat(nnx.to_pure_dict(L.split_state(model, lora)[1])).keys() == flat(base_params).keys()
    x = jnp.arange(32)[None] % cfg.vocab_size
    # B = 0 adds exact zeros; only XLA fusing the two programs differently may move the last bit
    assert np.abs(logits(model, x) - logits(build(cfg, base_params, dtype=dtype), x)).max() <= 1e-6


@pytest.mark.parametrize("arch", list(ARCHS))
def test_merged_equals_unmerged(arch):
    """x W + (alpha/r)(x A) B == x (W + (alpha/r) A B) to float32 rounding, per-slot adapters of fused
    q|k|v, k|v and gate|up included (the layers scanned: a fast compile; trained runs below check
    the unrolled model through the loader)."""
    cfg = arch_config(arch)
    lora = L.LoRAConfig(4, 8.0, targets(cfg))
    base, adapters = random_params(cfg), random_adapters(cfg, lora)
    model = build(cfg, base, lora, adapters, scan_layers=True)
    merged = build(cfg, L.merge(base, adapters, lora), scan_layers=True)
    x = jax.random.randint(jax.random.key(0), (2, 32), 0, cfg.vocab_size)
    got, want = logits(model, x), logits(merged, x)
    assert np.abs(got - want).max() < 1e-5
    assert np.abs(logits(build(cfg, base, scan_layers=True), x) - want).max() > 1e-2  # adapters matter


def test_adapter_shapes_follow_the_paper():
    """Rank r per projection (PEFT's q/k/v/gate/up), logical axes of the weight for sharding."""
    cfg = arch_config("llama")
    lora = L.LoRAConfig(4, 8.0, targets(cfg))
    state = L.split_state(abstract_model(cfg, lora=lora), lora)[0]
    shapes = {k: v.shape for k, v in nnx.to_pure_dict(state)["blocks"].items()}
    D, H, G, K, F = cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.ffn
    assert shapes["lora_a_w_kv"] == (2, D, 2, 4) and shapes["lora_b_w_kv"] == (2, 2, 4, G, K)
    assert shapes["lora_a_w_o"] == (2, H, K, 4) and shapes["lora_b_w_fc"] == (2, 2, 4, F)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))["blocks"]
    assert tuple(specs["lora_b_w_q"]) == ("layers", None, "heads", None)
    assert tuple(specs["lora_a_w_proj"]) == ("layers", "mlp", None)


def test_settings_are_resolved_against_the_model():
    gpt2, llama = arch_config("gpt2"), arch_config("llama")
    t = lambda *a: build_train(["--preset=tiny", "--init_from=x", *a])[2]  # noqa: E731
    assert L.resolve(t("--lora_rank=8"), gpt2).targets == ("w_qkv", "w_o", "w_fc", "w_proj")
    assert L.resolve(t("--lora_rank=8", "--lora_targets=attn"), llama).targets == ("w_q", "w_kv", "w_o")
    assert L.resolve(t("--lora_rank=8", "--lora_targets=w_proj,w_q"), llama).targets == ("w_q", "w_proj")
    assert L.resolve(t("--lora_rank=2", "--lora_alpha=16"), gpt2).scale == 8.0
    assert L.resolve(t(), gpt2) is None
    with pytest.raises(UserError, match="this model has no w_q .*w_qkv, w_o"):
        L.resolve(t("--lora_rank=8", "--lora_targets=w_q"), gpt2)
    with pytest.raises(UserError, match=r"--lora_rank=20 is larger than the matrix .* \(w_kv: 32 x 16\)"):
        L.resolve(t("--lora_rank=20"), llama)
    for argv, words in [(["--lora_rank=4"], "pass --init_from=DIR"),
                        (["--lora_rank=0", "--init_from=x"], "positive"),
                        (["--lora_rank=-1", "--init_from=x"], "--lora_rank=-1"),
                        (["--lora_rank=4", "--init_from=x", "--lora_alpha=0"], "--lora_alpha=0"),
                        (["--lora_rank=4", "--init_from=x", "--lora_targets=attn,q_proj"],
                         "unknown target 'q_proj'"),
                        (["--lora_rank=4", "--init_from=x", "--lora_dropout=1"], "--lora_dropout=1"),
                        (["--init_from=x", "--lora_alpha=4"], "--lora_alpha needs --lora_rank")]:
        with pytest.raises(UserError, match=words):
            build_train(["--preset=tiny", *argv])


# ----------------------------------------------------------------------------- training


def test_steps_train_the_adapters_only(tmp_path, char_data, bases):
    """Three steps: every adapter moved (B off zero), the base is bit-identical, and the optimizer
    state is Adam's two moments of the adapters (plus step counters): nothing for the base."""
    out = tmp_path / "o"
    out.mkdir()
    s = lora_setup(out, char_data, bases / "llama", "--max_iters=3", "--lora_dropout=0.1")
    run_, state = T.build_run(s, sharding.make_mesh(""), out, log=lambda msg: None)
    try:
        base0, adapters0 = flat(state.frozen), flat(state.params)
        for _ in range(3):
            x, y = T.next_batch(run_)
            state.params, state.opt_state, _, metrics = run_.step_fn(state.params, state.opt_state,
                                                                     state.step, x, y, state.frozen)
            state.step += 1
        assert np.isfinite(float(metrics["loss"]))
        base1, adapters1 = flat(state.frozen), flat(state.params)
        assert base0.keys() == base1.keys() and all(base0[k].tobytes() == base1[k].tobytes() for k in base0)
        assert all("lora_" in k for k in adapters1) and len(adapters1) == 2 * len(targets(s.model_cfg))
        assert all(not np.array_equal(adapters0[k], adapters1[k]) for k in adapters0)
        adapter_b = sum(a.nbytes for a in adapters1.values())
        base_b = sum(a.nbytes for a in base1.values())
        opt_b = sum(a.nbytes for a in jax.tree.leaves(state.opt_state))
        assert 2 * adapter_b <= opt_b <= 2 * adapter_b + 64 and opt_b < base_b / 2
        shapes = {a.shape for a in jax.tree.leaves(state.opt_state)}
        assert not shapes & {a.shape for a in base1.values() if a.ndim}  # no leaf shaped like the base
    finally:
        run_.checkpointer.close()
        run_.mlog.close()


def test_resume_is_exact_and_checkpoints_hold_adapters(tmp_path, char_data, bases, lora_runs):
    """4 steps == 2 + resume + 2 (with adapter dropout), to the bit; the checkpoints hold the
    adapters and a reference to the base, not a copy of it."""
    root, ref = lora_runs
    out = tmp_path / "b"
    shutil.copytree(root / "llama", out)
    shutil.rmtree(ckpt.checkpoint_dir(out) / "4")  # as if stopped after step 2
    second = run(out, char_data, "--init_from=resume")
    assert second["start_step"] == 2
    assert dict(second["train_losses"]) == {s: loss for s, loss in ref["losses"] if s > 2}
    assert second["val_loss"] == ref["val"]
    on_disk = ocp.StandardCheckpointer().metadata(ckpt.checkpoint_dir(out) / "4" / "params")
    names = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(on_disk.item_metadata)[0]]
    assert names and all("lora_" in n for n in names)
    _, meta = ckpt.read_meta(out)
    assert meta["lora"]["base"]["path"] == str((bases / "llama").absolute()) and meta["lora"]["rank"] == 4
    a, b = (L.restore_params(d)[2] for d in (root / "llama", out))
    assert all(x.tobytes() == y.tobytes() for x, y in zip(flat(a).values(), flat(b).values()))
    assert second["trainable_params"] < 0.2 * L.count(a)


# ----------------------------------------------------------------------------- loading a LoRA run


@pytest.mark.parametrize("arch", list(ARCHS))
def test_sample_merge_lora_and_export(tmp_path, char_data, bases, lora_runs, arch, capsys):
    """The loader merges once (== the unmerged model, < 1e-5); sample.py reads the run;
    --merge_lora writes a plain checkpoint with those very weights (removing what a merge killed part
    way left); --to_hf loads in transformers;
    --init_from=LORA_OUT without --lora_rank starts a full fine-tuning from the merged weights."""
    import sample
    from gpt import convert
    from gpt.checkpoint import load_model
    out = lora_runs[0] / arch
    _, meta = ckpt.read_meta(out)
    cfg = arch_config(arch, meta["config"]["model"]["vocab_size"])
    lora = L.from_meta(meta["lora"], out, cfg)
    _, adapters, _, _ = ckpt.Checkpointer(out, read_only=True).restore(L.abstract_adapters(cfg, lora))
    unmerged = build(cfg, L.read_base(bases / arch).params, lora, adapters)
    merged, _, _ = load_model(out, "float32")
    assert merged.blocks.lora is None and not nnx.state(merged, nnx.LoRAParam)
    x = jax.random.randint(jax.random.key(0), (2, 32), 0, cfg.vocab_size)
    want = logits(merged, x)
    assert np.abs(logits(unmerged, x) - want).max() < 1e-5
    assert np.abs(want - logits(load_model(bases / arch, "float32")[0], x)).max() > 1e-4  # trained

    capsys.readouterr()
    assert sample.main([f"--out_dir={out}", "--prompt=ROMEO:", "--max_new_tokens=8", "--temperature=0"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    killed = tmp_path / f".m.{gone.pid}.x1.tmp"  # a merge killed while writing left its copy
    killed.mkdir()
    assert convert.main(["--merge_lora", "--out_dir", str(out), "--merged_dir", str(tmp_path / "m")]) == 0
    assert not killed.exists() and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".m")) == []
    plain, meta_m, _ = load_model(tmp_path / "m", "float32")
    assert "lora" not in meta_m and np.array_equal(logits(plain, x), want)
    full = T.prepare_setup(*configs(tmp_path / "full", char_data, f"--init_from={out}"))
    got, merged_params = flat(full.init_params), flat(nnx.to_pure_dict(nnx.state(plain)))
    assert full.lora is None and got.keys() == merged_params.keys()
    assert all(np.array_equal(got[k], merged_params[k]) for k in got)
    if arch == "llama":
        torch = pytest.importorskip("torch")
        transformers = pytest.importorskip("transformers")
        assert convert.main(["--to_hf", "--out_dir", str(out), "--hf_dir", str(tmp_path / "hf")]) == 0
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
        with torch.no_grad():
            ref = hf(torch.tensor(np.asarray(x))).logits.float().numpy()
        assert np.abs(ref - want).max() < 1e-4


def test_base_gone_changed_or_a_lora_run(tmp_path, char_data, bases, lora_runs):
    """A LoRA run whose base was changed or removed is one clear error (sampling and resuming);
    a LoRA run is not a base itself, nor is a plain run resumed as a LoRA run."""
    from gpt.checkpoint import load_model
    base, out = tmp_path / "base", tmp_path / "lora"
    shutil.copytree(bases / "gpt2", base)
    shutil.copytree(lora_runs[0] / "gpt2", out)
    for step in ckpt.list_steps(out):  # point the copy at the copied base
        path = ckpt.checkpoint_dir(out) / str(step) / "meta" / "metadata"
        meta = json.loads(path.read_text())
        meta["lora"]["base"]["path"] = str(base)
        path.write_text(json.dumps(meta))
    load_model(out)
    with pytest.raises(UserError, match="is a LoRA run; fine-tune its merged weights"):
        lora_setup(tmp_path / "o2", char_data, out)
    params = L.read_base(base).params
    params["lnf_scale"] = params["lnf_scale"] + 1.0
    shutil.rmtree(ckpt.checkpoint_dir(base))
    _, meta = ckpt.read_meta(bases / "gpt2")
    cfg = arch_config("gpt2", meta["config"]["model"]["vocab_size"])
    save_base(base, cfg, meta["tokenizer"], params=params)
    for load in (lambda: load_model(out), lambda: run(out, char_data, "--init_from=resume", "--max_iters=3")):
        with pytest.raises(UserError, match=r"base model of the LoRA run in .*lora, .*base \(step 0\), "
                                            r"has changed"):
            load()
    shutil.rmtree(base)
    with pytest.raises(UserError, match=r"base \(step 0\), is gone"):
        load_model(out)
    with pytest.raises(UserError, match=r"base \(step 0\), is gone"):  # from metadata alone: before
        ckpt.load_tokenizer_of(out)  # gpt.evaluate reads its input, sample.py its prompt
    with pytest.raises(UserError, match="not a LoRA run, so it cannot be resumed with --lora_rank"):
        run(bases / "gpt2", char_data, "--init_from=resume", *LORA)


@pytest.mark.parametrize("flag", ["--lora_rank=8", "--lora_alpha=2", "--lora_targets=attn"])
def test_resume_with_other_lora_settings_points_at_the_base(char_data, bases, lora_runs, flag):
    """Resuming a LoRA run with other LoRA settings is refused, and the fix names a new LoRA run
    from its base (it named --init_from=LORA_OUT, which --lora_rank then refuses as a LoRA run)."""
    out = lora_runs[0] / "gpt2"
    before = sorted(p.name for p in ckpt.checkpoint_dir(out).iterdir())
    with pytest.raises(UserError) as e:
        T.prepare_setup(*configs(out, char_data, "--init_from=resume", flag))
    msg = str(e.value)
    assert "differs from the run being resumed" in msg and f"--init_from={bases / 'gpt2'}" in msg, msg
    assert f"--init_from={out}" not in msg, msg
    assert sorted(p.name for p in ckpt.checkpoint_dir(out).iterdir()) == before


def test_data_must_use_the_bases_tokenizer(tmp_path, bases):
    from gpt.data import prepare
    (tmp_path / "t.txt").write_text("abc cab bca " * 400)
    prepare([str(tmp_path / "t.txt")], "char", tmp_path / "d")
    with pytest.raises(UserError, match=r"tokenized with char \(4 tokens\) but the base model .* with char"):
        lora_setup(tmp_path / "o", tmp_path / "d", bases / "gpt2")
    # a Hugging Face directory as the base (--init_from=gpt2 is one): its tokenizer is checked too
    # (it was skipped, and GPT-2 trained on char ids)
    import transformers
    hf = tmp_path / "hf_gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=64, n_embd=16, n_layer=1, n_head=2)) \
        .save_pretrained(hf, safe_serialization=True)
    with pytest.raises(UserError, match=r"tokenized with char \(4 tokens\) but .*hf_gpt2 with gpt2 .*--tokenizer=gpt2"):
        lora_setup(tmp_path / "o", tmp_path / "d", hf)


def test_a_run_cannot_write_over_its_own_starting_point(tmp_path, char_data, bases):
    """--init_from and --out_dir the same folder: with --overwrite a LoRA run would set aside (then
    delete) the base it points at, leaving adapters that can never load; refused at once."""
    base = tmp_path / "base"
    shutil.copytree(bases / "gpt2", base)
    for extra in ((), ("--overwrite",)):
        with pytest.raises(UserError, match="--init_from and --out_dir are both"):
            lora_setup(base, char_data, base, *extra)
    assert ckpt.list_steps(base) == ckpt.list_steps(bases / "gpt2")


# ----------------------------------------------------------------------------- meshes

def mesh_train(data, base, out, mesh: str) -> dict:
    """A 4-step LoRA run (adapter dropout on, checkpoints at 2 and 4) of the modern block on `mesh`:
    losses, val loss and the adapters' partition specs. Runs here (one device: the `lora_runs`
    fixture) and in an 8-device subprocess."""
    argv = ["--preset=tiny", f"--out_dir={out}", f"--data_dir={data}", f"--init_from={base}", *LORA,
            "--lora_dropout=0.1", "--max_iters=4", "--eval_interval=4", "--ckpt_interval=2",
            "--log_interval=1", "--no_progress", f"--mesh={mesh}", "--seed=0"]
    s = T.prepare_setup(*build_train(argv))
    summary = T.train(s, log=lambda msg: None)
    state = L.split_state(abstract_model(s.model_cfg, lora=s.lora), s.lora)[0]
    specs = {k: [list(a) if isinstance(a, tuple) else a for a in v.spec]
             for k, v in sharding.param_shardings(state, sharding.make_mesh(mesh))["blocks"].items()}
    return {"losses": summary["train_losses"], "val": summary["val_loss"], "devices": jax.device_count(),
            "specs": specs}


_MESH_SCRIPT = "import json, sys; sys.path[:0] = ['tests']; import test_lora; " \
               "print(json.dumps(test_lora.mesh_train(*sys.argv[1:5])))"


@pytest.mark.slow  # 30 s; sharding of the base model is tested in CI by tests/test_sharding.py
def test_sharded_matches_one_device(tmp_path, char_data, bases, lora_runs):
    """LoRA on the modern block over data x fsdp x tensor (8 CPU devices) == one device, to 1e-5;
    the adapters are sharded like their weights (B of w_q over heads, A of w_proj over the MLP width)."""
    _, one = lora_runs
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, str(char_data), str(bases / "llama"),
                        str(tmp_path / "eight"), "data:2,fsdp:2,tensor:2"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    eight = json.loads(r.stdout.strip().splitlines()[-1])
    assert one["devices"] == 1 and eight["devices"] == 8
    for (s1, a), (s8, b) in zip(one["losses"], eight["losses"]):
        assert s1 == s8 and abs(a - b) <= 1e-5 * abs(a)
    assert abs(one["val"] - eight["val"]) <= 1e-5 * one["val"]
    assert eight["specs"]["lora_b_w_q"][:3] == [None, None, "tensor"]  # [L, r, H, K]
    assert eight["specs"]["lora_a_w_proj"][:2] == [None, "tensor"]  # [L, F, r]
    assert eight["specs"]["lora_a_w_q"] == [None, "fsdp", None]  # [L, D, r]


@pytest.mark.parametrize("edit", [{"targets": ["w_o", "w_o"]}, {"alpha": float("nan")}, {"targets": ["w_q"]},
                                  {"rank": 10_000}, {"base_step": True}])
def test_edited_lora_settings_are_one_line(tmp_path, lora_runs, edit):
    """Settings a LoRA checkpoint's meta may carry after an edit or damage (a target twice would
    add its update twice; a NaN alpha poisons every merged weight; a target the model lacks; a
    rank above the matrix; a step that is not a number) are refused in one line."""
    from gpt.checkpoint import load_model
    out = tmp_path / "lora"
    shutil.copytree(lora_runs[0] / "gpt2", out)
    for step in ckpt.list_steps(out):
        path = ckpt.checkpoint_dir(out) / str(step) / "meta" / "metadata"
        meta = json.loads(path.read_text())
        if "base_step" in edit:
            meta["lora"]["base"]["step"] = edit["base_step"]
        else:
            meta["lora"].update(edit)
        path.write_text(json.dumps(meta))
    with pytest.raises(UserError, match="metadata is damaged"):
        load_model(out, "float32")
