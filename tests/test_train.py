import json
import math
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import REPO, tiny_model_config, user_xla_flags
from gpt import train as T
from gpt.config import ModelConfig, TrainConfig, build, build_train
from gpt.errors import UserError
from gpt.model import GPT


def configs(out_dir, data_dir, *argv):
    return build_train(["--preset=tiny", f"--out_dir={out_dir}", f"--data_dir={data_dir}",
                        "--log_interval=1", "--no_progress", *argv])


def run(out_dir, data_dir, *argv):
    return T.train(T.prepare_setup(*configs(out_dir, data_dir, *argv)))


@pytest.mark.slow  # 20 s; in CI the signal and full-disk tests of test_reliability.py resume bit-exactly
def test_resume_is_exact(tmp_path, char_data):
    """2N steps in one run == N steps + resume + N steps, at every step (with dropout on)."""
    common = ["--dropout=0.1", "--eval_interval=4", "--max_iters=8", "--lr_decay_iters=8"]
    full = run(tmp_path / "a", char_data, *common)
    first = run(tmp_path / "b", char_data, *common, "--max_iters=4")
    second = run(tmp_path / "b", char_data, *common, "--init_from=resume")
    assert second["start_step"] == 4
    resumed = dict(first["train_losses"]) | dict(second["train_losses"])
    assert resumed == dict(full["train_losses"])  # bit-identical losses
    assert second["val_loss"] == full["val_loss"]
    steps = [json.loads(l)["step"] for l in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
             if json.loads(l)["kind"] == "train"]
    assert steps == list(range(1, 9))


def test_gradient_accumulation_equals_one_large_batch(char_data):
    cfg = tiny_model_config()
    graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(params)
    (_, t), _ = build([ModelConfig, TrainConfig], ["--preset=tiny"])
    tx = T.make_optimizer(t)
    step = jax.jit(T.make_train_step(graphdef, tx, seed=0, train_mode=False))
    x = jax.random.randint(jax.random.key(0), (8, 32), 0, 65)
    y = jnp.roll(x, -1, axis=1)
    big = step(params, tx.init(params), 0, x[None], y[None])
    acc = step(params, tx.init(params), 0, x.reshape(4, 2, 32), y.reshape(4, 2, 32))
    assert abs(float(big[3]["loss"]) - float(acc[3]["loss"])) < 1e-6
    for a, b in zip(jax.tree.leaves(big[0]), jax.tree.leaves(acc[0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_cross_entropy_shifted_targets_and_padding():
    logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25, 0.0]]]))  # last entry is "padding" (-inf)
    loss = T.cross_entropy(logits, jnp.array([[1]]))
    assert float(loss) == pytest.approx(math.log(4))
    assert math.isfinite(float(jax.grad(lambda l: T.cross_entropy(l, jnp.array([[1]])))(logits)[0, 0, 0]))


def test_lr_schedules():
    (_, t), _ = build([ModelConfig, TrainConfig], ["--max_iters=100", "--warmup_iters=10",
                                                   "--learning_rate=1.0", "--min_lr=0.1"])
    lr = T.lr_schedule(t)
    assert float(lr(0)) == pytest.approx(1 / 11)
    assert float(lr(10)) == pytest.approx(1.0)
    assert float(lr(55)) == pytest.approx(0.55)
    assert float(lr(100)) == pytest.approx(0.1) and float(lr(500)) == pytest.approx(0.1)
    t.lr_schedule = "constant"
    assert float(T.lr_schedule(t)(70)) == 1.0
    t.lr_schedule = "wsd"
    wsd = T.lr_schedule(t)
    assert float(wsd(50)) == 1.0 and float(wsd(90)) == pytest.approx(0.55) and float(wsd(100)) == pytest.approx(0.1)


def test_weight_decay_only_on_matrices():
    params = nnx.to_pure_dict(nnx.state(GPT(tiny_model_config(), rngs=nnx.Rngs(0))))
    mask = T.decay_mask(params)
    assert mask["wte"] and mask["wpe"] and mask["blocks"]["w_qkv"] and mask["blocks"]["w_fc"]
    assert not mask["blocks"]["b_qkv"] and not mask["blocks"]["ln1_scale"] and not mask["lnf_scale"]


def _nanogpt_lr(it: int, t: TrainConfig) -> float:
    """nanoGPT train.py's get_lr, as written there."""
    if it < t.warmup_iters:
        return t.learning_rate * (it + 1) / (t.warmup_iters + 1)
    if it > t.lr_decay_iters:
        return t.min_lr
    decay_ratio = (it - t.warmup_iters) / (t.lr_decay_iters - t.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return t.min_lr + coeff * (t.learning_rate - t.min_lr)


def _nanogpt_steps(torch, ref, named: dict, xs, ys, t: TrainConfig) -> tuple[list[float], list[float]]:
    """nanoGPT train.py's loop on transformers' GPT-2 `ref`: each step's mean loss and gradient norm."""
    groups = [{"params": [p for p in named.values() if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in named.values() if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=t.learning_rate, betas=(t.beta1, t.beta2), eps=1e-8)
    losses, norms = [], []
    for it in range(xs.shape[0]):
        for g in opt.param_groups:
            g["lr"] = _nanogpt_lr(it, t)
        micro = []
        for a in range(xs.shape[1]):
            logits = ref(torch.tensor(xs[it, a])).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.tensor(ys[it, a]).view(-1))
            (loss / xs.shape[1]).backward()
            micro.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), t.grad_clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(np.mean(micro)))
    return losses, norms


def test_train_step_matches_nanogpt_torch_recipe(tmp_path):
    """Our jitted step (make_optimizer + make_train_step) == nanoGPT's PyTorch recipe on the same
    weights and batches for 3 steps: AdamW in two groups (decay on every tensor of dim >= 2, the
    embeddings and tied head too; none on biases and LayerNorm weights), clip_grad_norm_ before the
    step, get_lr's warmup (step 0) then cosine (steps 1-2), 2 micro-batches of loss / A each. The
    torch model is our export (gpt.convert.to_hf) loaded as transformers' GPT2LMHeadModel, with
    exact GELU as nanoGPT's nn.GELU.

    grad_clip lies between the steps' norms (about 1.48, 1.20, 0.79): steps 0-1 clip, step 2 does
    not. With every step clipped Adam's scale invariance would hide both the threshold and how
    accumulation scales the gradient; here summing the micro-batch gradients instead of averaging
    them moves the weights by 6e-4, a 1% higher threshold by 4e-5, no weight decay by 3e-4.
    Measured float32 differences: losses and grad norms about 1e-7 relative, weights <= 2e-6 after
    the 3 steps, except the attention's key bias (up to 1.5e-5): its true gradient is zero (a
    constant added to a query's scores), so on both sides Adam turns rounding noise of about 1e-9
    into steps of a fraction of lr; it gets its own bound of lr / 100."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from gpt.convert import hf_tensors, to_hf
    from helpers import tiny_gpt

    cfg = tiny_model_config(block_size=16, activation="gelu")
    t = TrainConfig(batch_size=2, gradient_accumulation_steps=2, max_iters=3, learning_rate=1e-2, min_lr=1e-4,
                    warmup_iters=1, lr_decay_iters=3, weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0)
    N, A, B, T_, V, D = (t.max_iters, t.gradient_accumulation_steps, t.batch_size, cfg.block_size,
                         cfg.vocab_size, cfg.n_embd)
    graphdef, state = nnx.split(tiny_gpt(cfg, seed=0))
    params0 = nnx.to_pure_dict(state)
    tokens = np.random.default_rng(0).integers(0, V, (N, A, B, T_ + 1))
    xs, ys = tokens[..., :-1], tokens[..., 1:]

    # nanoGPT's side: our initial weights in transformers' GPT-2, trained as nanoGPT's train.py does
    to_hf(params0, cfg, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["activation_function"] == "gelu"
    ref = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()  # eval: no dropout
    assert ref.lm_head.weight is ref.transformer.wte.weight  # tied, as nanoGPT's
    named = dict(ref.named_parameters())  # the tied head once, as in nanoGPT's configure_optimizers
    ref_losses, ref_norms = _nanogpt_steps(torch, ref, named, xs, ys, t)

    # ours: the real step, jitted as the other tests run it
    tx = T.make_optimizer(t)
    step_fn = jax.jit(T.make_train_step(graphdef, tx, seed=0, lr=T.lr_schedule(t)))
    params, opt_state, losses, norms, lrs = params0, tx.init(params0), [], [], []
    for it in range(N):
        params, opt_state, _, m = step_fn(params, opt_state, it, jnp.asarray(xs[it]), jnp.asarray(ys[it]))
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
        lrs.append(float(m["lr"]))

    np.testing.assert_allclose(lrs, [_nanogpt_lr(it, t) for it in range(N)], rtol=1e-6)
    assert lrs[0] < lrs[1] > lrs[2] > t.min_lr  # warmup, then cosine
    # steps 0 and 1 clip, step 2 does not (each 10% or more from the threshold)
    assert ref_norms[0] > ref_norms[1] > 1.1 * t.grad_clip > t.grad_clip > 1.1 * ref_norms[2]
    loss_rel = float(np.max(np.abs(np.subtract(losses, ref_losses)) / np.asarray(ref_losses)))
    norm_rel = float(np.max(np.abs(np.subtract(norms, ref_norms)) / np.asarray(ref_norms)))
    got, start = hf_tensors(params, cfg), hf_tensors(params0, cfg)
    want = {k: v.detach().numpy() for k, v in ref.state_dict().items() if k in got}
    assert want.keys() == got.keys() == {n for n in named}
    key_bias = {k: (slice(D, 2 * D),) for k in got if k.endswith("attn.c_attn.bias")}  # q | k | v
    diff = {k: np.abs(got[k] - want[k]) for k in got}
    key_diff = max(float(diff[k][s].max()) for k, s in key_bias.items())
    for k, s in key_bias.items():
        diff[k][s] = 0.0
    worst = max(diff, key=lambda k: diff[k].max())
    moved = min(float(np.abs(want[k] - start[k]).max()) for k in got)
    print(f"losses max rel diff {loss_rel:.3g}, grad norms {norm_rel:.3g}; weights after {N} steps: "
          f"max abs diff {diff[worst].max():.3g} ({worst}), key biases {key_diff:.3g}; least a tensor "
          f"moved {moved:.3g}")
    assert loss_rel < 1e-5 and norm_rel < 1e-5
    assert diff[worst].max() < 1e-5 < moved / 100  # every tensor moved: its update is compared
    assert key_diff < t.learning_rate / 100

    # the decay mask decays exactly nanoGPT's parameters (dim >= 2 in the GPT-2 layout): each
    # exported tensor of the mask is all 1 (decayed) or all 0
    mask = T.decay_mask(params)
    mask_hf = hf_tensors(jax.tree.map(lambda m, p: np.full(np.shape(p), float(m)), mask, params), cfg)
    assert {k: float(p.dim() >= 2) for k, p in named.items()} == {
        k: float(v.flat[0]) for k, v in mask_hf.items() if (v == v.flat[0]).all()}


def test_outputs_and_best_checkpoint_kept(tmp_path, char_data):
    out = tmp_path / "o"
    run(out, char_data, "--max_iters=12", "--eval_interval=3", "--keep_checkpoints=2")
    steps = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert steps[-2:] == [9, 12] and len(steps) <= 3  # last 2, plus the best if it is older
    assert (out / "loss.png").stat().st_size > 1000
    assert list(out.glob("events.out.tfevents.*"))
    evals = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in evals if e["kind"] == "eval"]
    for key in ("step", "train_loss", "val_loss", "val_bpb", "lr", "tokens_per_sec", "mfu", "elapsed_sec"):
        assert key in evals[-1]


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, char_data):
    """A diverging run stops with one line before saving; the good checkpoints it would have
    replaced (--overwrite) are back in place."""
    out = tmp_path / "o"
    run(out, char_data, "--max_iters=4", "--eval_interval=2")
    with pytest.raises(UserError, match=r"loss became nan at step \d+"):
        run(out, char_data, "--overwrite", "--max_iters=20", "--eval_interval=10", "--learning_rate=1e30",
            "--min_lr=0", "--grad_clip=0", "--warmup_iters=0")
    steps = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert steps[-1] == 4
    # The loss is of the weights before the step's update: a save right after a diverging update
    # (every step here) is refused too, whether or not the step evaluates.
    diverge = ("--learning_rate=1e30", "--min_lr=0", "--grad_clip=0", "--warmup_iters=0", "--max_iters=20")
    with pytest.raises(UserError, match=r"val loss became (nan|inf) at step 1; stopped without saving"):
        run(tmp_path / "p", char_data, *diverge, "--eval_interval=1")
    with pytest.raises(UserError, match=r"weights diverged .* at step 1; stopped without saving"):
        run(tmp_path / "q", char_data, *diverge, "--eval_interval=10", "--ckpt_interval=1")
    from gpt.checkpoint import list_steps
    assert list_steps(tmp_path / "p") == list_steps(tmp_path / "q") == []


@pytest.mark.parametrize("grad_clip, saved, end", [
    (0.0, False, "stopped without saving it; try a lower --learning_rate or --grad_clip=1.0"),
    (1.0, True, "stopped without saving it; the checkpoints saved before are kept; try a lower --learning_rate"),
    (0.5, False, "stopped without saving it; try a lower --learning_rate"),
    (5.0, True, "the checkpoints saved before are kept; try a lower --learning_rate or --grad_clip=1.0")])
def test_the_divergence_message_fits_the_run(tmp_path, grad_clip, saved, end):
    """It says what is kept only when a checkpoint is, and suggests clipping only to a run that
    does not already clip at 1 or less (the default clips at 1)."""
    from types import SimpleNamespace
    if saved:
        (tmp_path / "checkpoints" / "4").mkdir(parents=True)
    run_ = SimpleNamespace(checkpointer=SimpleNamespace(dir=tmp_path / "checkpoints"),
                           s=SimpleNamespace(train_cfg=SimpleNamespace(grad_clip=grad_clip)))
    assert T.diverged(run_).endswith(end)


def test_resume_keeps_the_runs_settings(tmp_path, char_data):
    """--init_from=resume takes the training settings from the checkpoint (not the preset's
    defaults); a contradicting flag names both values; max_iters and the like may change."""
    out = tmp_path / "o"
    run(out, char_data, "--max_iters=2", "--eval_interval=2", "--learning_rate=3e-3", "--dropout=0.1",
        "--seed=7", "--residual_dtype=compute", "--loss_chunks=2")
    m, c, t, explicit = configs(out, char_data, "--init_from=resume", "--max_iters=4", "--eval_interval=4")
    s = T.prepare_setup(m, c, t, explicit)
    assert (s.train_cfg.learning_rate, s.train_cfg.seed, s.compute_cfg.dropout) == (3e-3, 7, 0.1)
    assert s.train_cfg.max_iters == 4 and s.compute_cfg.residual_dtype == "compute"
    assert s.compute_cfg.loss_chunks == 2
    # precision, like --dtype, may change on resume (and how the loss is chunked)
    s = T.prepare_setup(*configs(out, char_data, "--init_from=resume", "--residual_dtype=float32",
                                 "--loss_chunks=0"))
    assert s.compute_cfg.residual_dtype == "float32" and s.compute_cfg.loss_chunks == 0
    with pytest.raises(UserError, match=r"--learning_rate=0.01 differs from the run being resumed "
                                        r"\(learning_rate=0.003\)"):
        T.prepare_setup(*configs(out, char_data, "--init_from=resume", "--learning_rate=1e-2"))
    # Unflagged, even what may change comes from the checkpoint (not the preset's defaults).
    run(tmp_path / "p", char_data, "--max_iters=3", "--lr_decay_iters=50", "--keep_checkpoints=7",
        "--eval_interval=3")
    s = T.prepare_setup(*configs(tmp_path / "p", char_data, "--init_from=resume"))
    assert (s.train_cfg.max_iters, s.train_cfg.lr_decay_iters, s.train_cfg.keep_checkpoints) == (3, 50, 7)
    with pytest.raises(UserError, match="pass one of them"):
        T.prepare_setup(*configs(out, char_data, "--init_from=resume", "--overwrite"))
    said = []  # a run already at its --max_iters says so instead of ending in silence
    T.train(T.prepare_setup(*configs(tmp_path / "p", char_data, "--init_from=resume")), log=said.append)
    assert any("already at step 3 (--max_iters=3): nothing to train" in line for line in said)


@pytest.mark.parametrize("section,edit", [("train", {"seed": 1.5}), ("train", {"mesh": 5}),
                                          ("train", {"align_documents": "false"}), ("train", {"input": [3]}),
                                          ("compute", {"dropout": "0.1"})])
def test_resume_refuses_edited_settings(section, edit):
    """A checkpoint's saved settings of the wrong type (metadata edited by hand) are one line, as its
    model config's are, not a traceback or a silently different run."""
    m, c, t, explicit = build_train(["--preset=tiny", "--out_dir=o", "--init_from=resume"])
    saved = {"train": {}, "compute": {}, section: edit}
    with pytest.raises(UserError, match=f"has {next(iter(edit))}=.*the checkpoint metadata was edited"):
        T._settings_for_resume(saved, c, t, explicit)


def test_without_a_bar_each_log_step_is_a_line(tmp_path, char_data):
    """--no_progress (or stderr not a terminal): the loss, lr, tokens/s and MFU of every log step
    are printed as lines, as nanoGPT prints them (only evaluations were); schedule settings that
    undo the schedule are a warning."""
    said = []
    T.train(T.prepare_setup(*configs(tmp_path / "o", char_data, "--max_iters=4", "--log_interval=2",
                                     "--eval_interval=4", "--warmup_iters=10")), log=said.append)
    steps = [line.split(":")[0] for line in said if re.match(r"step \d+: loss [\d.]+, lr .*, .* tok/s, mfu", line)]
    assert steps == ["step 2", "step 4"], said
    assert any(line.startswith("warning: --warmup_iters=10 is not below --max_iters=4") for line in said)


def test_a_saved_mesh_that_does_not_fit_says_where_it_came_from():
    """A run saved on 8 devices, resumed on others without --mesh: the line names the saved mesh
    (which the user never typed here) and the flag that fixes it; a --mesh flag is not checked
    against the saved one."""
    m, c, t, explicit = build_train(["--preset=tiny", "--out_dir=o", "--init_from=resume"])
    saved = {"train": {"mesh": "data:3"}, "compute": {}}
    with pytest.raises(UserError, match=r"saved with --mesh=data:3, which does not fit here: --mesh=data:3 "
                                        r"uses 3 devices but .*; pass --mesh for these"):
        T._settings_for_resume(saved, c, t, explicit)
    m, c, t, explicit = build_train(["--preset=tiny", "--out_dir=o", "--init_from=resume", "--mesh="])
    assert T._settings_for_resume(saved, c, t, explicit)[1].mesh == ""


def test_bad_inputs(tmp_path, char_data):
    out = tmp_path / "o"
    with pytest.raises(UserError, match="no checkpoint found"):
        run(out, char_data, "--init_from=resume")
    run(out, char_data, "--max_iters=2", "--eval_interval=2")
    with pytest.raises(UserError, match="already holds checkpoints"):
        run(out, char_data, "--max_iters=2")
    with pytest.raises(UserError, match=r"n_layer \(2 in the checkpoint, 3 requested\)"):
        run(out, char_data, "--init_from=resume", "--n_layer=3")
    with pytest.raises(UserError, match="fewer|tokens"):
        run(tmp_path / "p", char_data, "--block_size=100000")
    run(out, char_data, "--max_iters=2", "--eval_interval=2", "--overwrite")  # allowed
    (tmp_path / "f").write_text("a file")
    with pytest.raises(UserError, match=r"--out_dir=.*f is a file, not a directory"):
        run(tmp_path / "f", char_data)
    with pytest.raises(UserError, match=r"--out_dir=.*f/sub lies under .*f, which is a file"):
        run(tmp_path / "f" / "sub", char_data)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "out")  # a FileExistsError traceback before
    for where in (tmp_path / "dangling", tmp_path / "dangling" / "sub"):
        with pytest.raises(UserError, match=r"dangling is a link to .*nowhere/out, which does not exist"):
            run(where, char_data)


@pytest.mark.parametrize("lora", [False, True])
def test_missing_init_from_names_that_flag(tmp_path, char_data, lora):
    """--init_from naming no checkpoint (a LoRA base or a model to fine-tune) is one line whose fix
    is about --init_from (it said `or pass --out_dir`), and nothing is written."""
    (tmp_path / "empty").mkdir()
    for src in (tmp_path / "nowhere", tmp_path / "empty"):
        argv = [f"--init_from={src}", *(["--lora_rank=2"] if lora else [])]
        with pytest.raises(UserError) as e:
            T.prepare_setup(*configs(tmp_path / "o", char_data, *argv))
        msg = str(e.value)
        assert f"--init_from={src}" in msg and "no checkpoint found" in msg, msg
        assert "--out_dir" not in msg.replace(f"--out_dir={src}", ""), msg
        assert not (tmp_path / "o").exists()


def test_unwritable_out_dir_is_one_line(tmp_path, char_data, monkeypatch):
    """A read-only disk or a folder without permission (the tests run as root, who passes any
    permission check, so access() is made to say no) is refused before anything is prepared."""
    monkeypatch.setattr(T.os, "access", lambda path, mode: False)
    with pytest.raises(UserError, match=r"--out_dir=.*new/run: .* is not writable \(read-only disk or no "
                                        r"permission\)"):
        run(tmp_path / "new" / "run", char_data)
    assert not (tmp_path / "new").exists()


def _cli(*args, **kw):
    return subprocess.run([sys.executable, "train.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, **kw)


@pytest.mark.parametrize("args,needle", [  # more in tests/test_bad_inputs.py
    (["--batch_size=x"], "--batch_size"),
    (["--init_from=resume"], "no checkpoint found"),
])
def test_cli_errors_are_one_line(tmp_path, args, needle):
    r = _cli("--preset=tiny", f"--out_dir={tmp_path / 'o'}", *args)
    assert r.returncode == 2, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_cli_keeps_compiled_programs_for_the_next_run(tmp_path, char_data):
    """train.py keeps its compiled programs in $GPT_COMPILATION_CACHE: a second run of the same
    shapes finds every one of them there (no new entries) and trains exactly as the first. Both
    compile as a user's run does (not with the tests' XLA flags, tests/helpers.py), and their
    losses are those of the same run here with the tests' flags (to 1e-4)."""
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(GPT_COMPILATION_CACHE=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               XLA_FLAGS=user_xla_flags())
    args = ["--preset=tiny", f"--data_dir={char_data}", "--no_progress", "--log_interval=1", "--max_iters=4",
            "--eval_interval=4"]
    first = _cli(*args, f"--out_dir={tmp_path / 'a'}", env=env)
    assert first.returncode == 0, first.stderr
    entries = sorted(cache.glob("cpu-*/*-cache"))
    assert any(p.name.startswith("jit_step_fn-") for p in entries), entries
    second = _cli(*args, f"--out_dir={tmp_path / 'b'}", env=env)
    assert second.returncode == 0 and "warning" not in second.stderr.lower(), second.stderr
    assert sorted(cache.glob("cpu-*/*-cache")) == entries
    records = [[json.loads(ln) for ln in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
               for d in "ab"]
    val_losses = [[r["val_loss"] for r in recs if r["kind"] == "eval"] for recs in records]
    assert val_losses[0] == val_losses[1]
    here = run(tmp_path / "c", char_data, "--max_iters=4", "--eval_interval=4")
    train_losses = [(r["step"], r["loss"]) for r in records[0] if r["kind"] == "train"]
    assert [s for s, _ in here["train_losses"]] == [s for s, _ in train_losses] == [1, 2, 3, 4]
    np.testing.assert_allclose([loss for _, loss in here["train_losses"]], [loss for _, loss in train_losses],
                               rtol=1e-4)  # other machine code (-O0, older emitters): other roundings
    np.testing.assert_allclose(here["val_loss"], val_losses[0][-1], rtol=1e-4)


def test_init_from_checkpoint_dir_and_hf_gpt2(tmp_path, char_data, monkeypatch):
    """--init_from=<train dir>, --init_from=<HF dir> and --init_from=gpt2 ($GPT2_DIR) start from those weights."""
    from gpt.checkpoint import load_model
    from gpt.convert import checkpoint_to_hf
    src = tmp_path / "src"
    run(src, char_data, "--max_iters=6", "--eval_interval=6")
    hf = tmp_path / "hf"
    checkpoint_to_hf(src, hf)
    base, _, _ = load_model(src, "float32")
    V = base.cfg.vocab_size
    x = jnp.arange(16)[None] % V
    want = base(x)[0]
    for how in (str(src), str(hf), "gpt2"):
        monkeypatch.setenv("GPT2_DIR", str(hf))
        setup = T.prepare_setup(*configs(tmp_path / f"o{len(how)}", char_data, f"--init_from={how}",
                                         "--max_iters=1", "--learning_rate=1e-9", "--min_lr=0",
                                         "--warmup_iters=0"))
        got = nnx.merge(nnx.split(GPT(setup.model_cfg, rngs=nnx.Rngs(0)))[0], setup.init_params)(x)[0]
        assert float(jnp.abs(got[..., :V] - want[..., :V]).max()) < 1e-5, how
        if how == str(hf):  # one training step from those weights (the same step for all three)
            summary = T.train(setup)
            assert summary["start_step"] == 0 and summary["step"] == 1
    with pytest.raises(UserError, match=r"n_embd \(32 in the checkpoint, 64 requested\)"):
        T.prepare_setup(*configs(tmp_path / "bad", char_data, f"--init_from={src}", "--n_embd=64"))
    monkeypatch.setenv("GPT2_DIR", str(tmp_path / "nowhere"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "nohf"))
    with pytest.raises(UserError, match="GPT-2 weights not found locally"):
        T.prepare_setup(*configs(tmp_path / "bad2", char_data, "--init_from=gpt2"))


def test_gpt2_is_found_in_the_hf_cache_under_either_repo_name(tmp_path, monkeypatch):
    """--init_from=gpt2 finds a snapshot in the HF cache downloaded as `gpt2` or as
    `openai-community/gpt2` (the name the not-found error tells the user to download); a $GPT2_DIR
    that holds no model is named in the error."""
    monkeypatch.delenv("GPT2_DIR", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    for repo in ("models--gpt2", "models--openai-community--gpt2"):
        snap = tmp_path / "hub" / repo / "snapshots" / "abc"
        snap.mkdir(parents=True)
        (snap / "config.json").write_text("{}")
        (snap / "model.safetensors").write_bytes(b"")
        assert T.find_gpt2_dir() == snap, repo
        shutil.rmtree(tmp_path / "hub")
    monkeypatch.setenv("GPT2_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match=r"GPT2_DIR=.*nowhere holds no config.json"):
        T.find_gpt2_dir()


def test_llama_tiny_preset_trains_and_samples(tmp_path, char_data, capsys):
    """`python train.py --preset=llama-tiny` (RoPE, RMSNorm, SwiGLU, GQA, untied head) learns on
    the bundled corpus, and sample.py reads the checkpoint back, past block_size (rolling cache)."""
    import sample
    out = tmp_path / "llama"
    r = T.train(T.prepare_setup(*build_train(["--preset=llama-tiny", f"--out_dir={out}",
                                              f"--data_dir={char_data}", "--no_progress"])))
    losses = dict(r["train_losses"])
    assert losses[max(losses)] < losses[min(losses)] - 0.25  # 20 steps of batch 4: learning
    capsys.readouterr()
    assert sample.main([f"--out_dir={out}", "--prompt=ROMEO:", "--max_new_tokens=80", "--seed=1"]) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith("ROMEO:") and len(cap.out) > 60 and "rolling KV cache" in cap.err
    # README's --top_k=200 on a char vocabulary keeps every token, as nanoGPT does
    assert sample.main([f"--out_dir={out}", "--prompt=ROMEO:", "--max_new_tokens=80", "--seed=1",
                        "--top_k=200"]) == 0
    again = capsys.readouterr()
    assert again.out == cap.out and "--top_k=200 exceeds the vocabulary (62 tokens): every token is kept" in again.err


def test_overwrite_replaces_old_checkpoints_only_after_saving(tmp_path, char_data, monkeypatch):
    """--overwrite moves the old run aside: a start-up failure puts it back, a run that dies before
    its first save leaves it to be put back next time, and a run that saves drops it. A fresh run
    starts new TensorBoard event files; a checkpoints/ that is not ours is never replaced."""
    from gpt import checkpoint as ckpt
    out = tmp_path / "o"
    run(out, char_data, "--max_iters=4", "--eval_interval=2")
    old = ckpt.list_steps(out)
    events = sorted(out.glob("events.out.tfevents.*"))

    def boom(*a, **k):
        raise UserError("start-up failed")
    monkeypatch.setattr(T, "build_run", boom)
    with pytest.raises(UserError, match="start-up failed"):
        run(out, char_data, "--max_iters=3", "--eval_interval=3", "--overwrite")
    assert ckpt.list_steps(out) == old and not (out / ckpt.ASIDE).exists()
    monkeypatch.undo()
    # a run that fails mid-way: the old run's logs come back with its checkpoints (they were gone,
    # and a resume then mixed the failed run's records into them)
    logs = {p.name: p.read_bytes() for p in [out / "metrics.jsonl", out / "loss.png", *events]}
    with pytest.raises(UserError, match="loss became nan"):
        run(out, char_data, "--max_iters=20", "--eval_interval=10", "--overwrite", "--learning_rate=1e30",
            "--min_lr=0", "--grad_clip=0", "--warmup_iters=0", "--log_interval=1")
    assert ckpt.list_steps(out) == old and not (out / ckpt.ASIDE).exists()
    assert {p.name: p.read_bytes() for p in [out / "metrics.jsonl", out / "loss.png",
                                             *sorted(out.glob("events.out.tfevents.*"))]} == logs

    (out / "checkpoints").rename(out / ckpt.ASIDE)  # as if an --overwrite run died before saving
    (out / "checkpoints").mkdir()
    run(out, char_data, "--max_iters=3", "--eval_interval=3", "--overwrite")
    assert ckpt.list_steps(out) == [3] and not (out / ckpt.ASIDE).exists()
    assert not set(events) & set(out.glob("events.out.tfevents.*"))

    (out / "checkpoints" / "2.damaged.1").mkdir()  # what a second fallback past step 2 leaves: ours
    run(out, char_data, "--max_iters=3", "--eval_interval=3", "--overwrite")
    (out / "checkpoints" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="holds files our runs never write .*notes.txt"):
        run(out, char_data, "--overwrite")
    assert (out / "checkpoints" / "notes.txt").exists() and ckpt.list_steps(out) == [3]


def test_a_second_run_in_one_out_dir_is_refused(tmp_path, char_data):
    """While a run holds out_dir's lock, another train.py there is one line and touches nothing: a
    resume started beside an --overwrite run that had not saved yet put the old run back under it
    (deleting that run's checkpoints dir), and both then saved into one checkpoints folder."""
    import fcntl

    from gpt import checkpoint as ckpt
    out = tmp_path / "o"
    run(out, char_data, "--max_iters=2", "--eval_interval=2")
    (out / "checkpoints").rename(out / ckpt.ASIDE)  # an --overwrite run, still running, before its first save
    (out / "checkpoints").mkdir()
    fd = os.open(out, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # its lock (another open file: to this process, another run's)
    try:
        for argv in (["--init_from=resume"], ["--overwrite"], []):
            with pytest.raises(UserError, match="is in use by another run"):
                run(out, char_data, "--max_iters=4", "--eval_interval=2", *argv)
            assert (out / ckpt.ASIDE / "2").is_dir() and (out / "checkpoints").is_dir()
            assert ckpt.list_steps(out) == []
    finally:
        os.close(fd)
    second = run(out, char_data, "--max_iters=4", "--eval_interval=2", "--init_from=resume")  # it has ended
    assert second["start_step"] == 2 and ckpt.list_steps(out) == [2, 4]


def test_a_train_refused_before_it_starts_releases_the_lock(tmp_path, char_data):
    """The Python API: prepare_setup takes out_dir's lock; a train() that then refuses the mesh
    (before its try) left it held, so another process was told the folder is in use by another
    run for as long as this one lived."""
    import fcntl

    import jax

    from gpt import checkpoint as ckpt
    out = tmp_path / "o"
    run(out, char_data, "--max_iters=2", "--eval_interval=2")
    s = T.prepare_setup(*configs(out, char_data, "--max_iters=4", "--eval_interval=2", "--init_from=resume",
                                 f"--mesh=data:{2 * len(jax.devices())}"))
    with pytest.raises(UserError, match="devices"):
        T.train(s)
    assert str(out.resolve()) not in ckpt._HELD
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file: another run's try
    finally:
        os.close(fd)


def test_a_second_setup_refused_keeps_the_first_setups_lock(tmp_path, char_data):
    """The Python API: a second prepare_setup of the same out_dir in one process that fails must not
    release the lock the first setup took (the lock is re-entrant without a count), or another
    process could start writing there beside the first setup's run."""
    import fcntl

    from gpt import checkpoint as ckpt
    out = tmp_path / "o"
    run(out, char_data, "--max_iters=2", "--eval_interval=2")
    first = T.prepare_setup(*configs(out, char_data, "--max_iters=4", "--eval_interval=2", "--init_from=resume"))
    assert ckpt.holds_out_dir(out)
    with pytest.raises(UserError, match="--overwrite starts over"):
        T.prepare_setup(*configs(out, char_data, "--init_from=resume", "--overwrite"))
    assert ckpt.holds_out_dir(out)
    fd = os.open(out, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file: another run's try
    finally:
        os.close(fd)
    assert T.train(first)["start_step"] == 2
    assert not ckpt.holds_out_dir(out)


def test_a_run_refused_another_runs_new_out_dir_leaves_it(tmp_path, char_data, monkeypatch):
    """Two runs starting on an out_dir that did not exist: the one refused the lock once the other
    had made the folder took the folder for its own new one and removed it while still empty."""
    from gpt import checkpoint as ckpt
    out = tmp_path / "o"

    def the_other_run_made_it(s):
        out.mkdir()
        raise ckpt.OutDirInUse(f"--out_dir={out} is in use by another run")

    monkeypatch.setattr(T, "prepare_out_dir", the_other_run_made_it)
    with pytest.raises(UserError, match="in use by another run"):
        run(out, char_data, "--max_iters=2")
    assert out.is_dir()


def test_document_aligned_rows_train_and_resume_exactly(tmp_path, capsys):
    """--align_documents on a sharded JSONL store: training runs, the waste is reported, and a
    resumed run sees exactly the batches of an uninterrupted one."""
    from gpt.data import prepare
    text = (REPO / "data" / "shakespeare.txt").read_text()[:60_000]
    docs = [text[i:i + 300 + (i % 7) * 200] for i in range(0, 55_000, 1000)]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    data_dir = tmp_path / "data"
    prepare([src], "char", data_dir, val_documents=5, shard_tokens=10_000)
    common = ["--align_documents", "--eval_interval=4", "--max_iters=6", "--lr_decay_iters=6"]
    full = run(tmp_path / "a", data_dir, *common)
    assert "of the tokens drawn are cut off" in capsys.readouterr().err
    run(tmp_path / "b", data_dir, *common, "--max_iters=3")
    second = run(tmp_path / "b", data_dir, *common, "--init_from=resume")
    assert dict(second["train_losses"]) == {k: v for k, v in full["train_losses"] if k > 3}


def test_converted_checkpoint_is_not_resumed_for_training(tmp_path, char_data):
    """A conversion has no training state: --init_from=resume on it says so (it is intact)."""
    import shutil
    from gpt import checkpoint as ckpt
    out = tmp_path / "o"
    run(out, char_data, "--max_iters=2", "--eval_interval=2")
    for s in ckpt.list_steps(out):
        path = ckpt.checkpoint_dir(out) / str(s) / "meta" / "metadata"
        meta = json.loads(path.read_text())
        meta["config"]["train"], meta["source"] = {}, "/models/gpt2"
        path.write_text(json.dumps(meta))
    with pytest.raises(UserError, match="converted from /models/gpt2, which has no training state") as e:
        T.prepare_setup(*configs(out, char_data, "--init_from=resume"))
    assert "--overwrite" not in str(e.value)
    shutil.rmtree(out)


def test_data_must_be_tokenized_as_the_model_was(tmp_path, char_data):
    """Resuming or fine-tuning on data tokenized otherwise (here: a char alphabet without capitals)
    is one line naming both tokenizers, not a run whose ids mean other characters; --data_dir with
    a preparation flag is refused, and a resumed run's explicit --input replaces its saved data."""
    from gpt.data import prepare
    lower = tmp_path / "lower.txt"
    lower.write_text((REPO / "data" / "shakespeare.txt").read_text()[:200_000].lower())
    prepare([str(lower)], "char", tmp_path / "lower")
    out = tmp_path / "o"
    run(out, char_data, "--max_iters=2", "--eval_interval=2")
    with pytest.raises(UserError, match=r"the data is tokenized with char \(\d+ tokens\) but the run in .*o was "
                                        r"trained with char \(\d+ tokens\) \(they differ in chars, vocab_size\); "
                                        r"pass the data it was trained on "
                                        r"\(--data_dir=.*prepared\)"):
        T.prepare_setup(*configs(out, tmp_path / "lower", "--init_from=resume", "--max_iters=4"))
    with pytest.raises(UserError, match=r"but the model in .*o with char \(\d+ tokens\) \(they differ in chars, "
                                        r"vocab_size\); prepare the data with the same tokenizer"):
        T.prepare_setup(*configs(tmp_path / "p", tmp_path / "lower", f"--init_from={out}"))
    T.prepare_setup(*configs(tmp_path / "p", char_data, f"--init_from={out}"))  # the same alphabet
    with pytest.raises(UserError, match="--data_dir names data already prepared and tokenized, which "
                                        "--input, --tokenizer would not change"):
        T.prepare_setup(*configs(tmp_path / "q", char_data, f"--input={lower}", "--tokenizer=gpt2"))
    flags = ["--preset=tiny", f"--out_dir={out}", "--init_from=resume", f"--input={lower}"]
    _, _, t, _ = T._starting_point(*build_train(flags))
    assert t.data_dir == "" and t.input == [str(lower)]  # the saved --data_dir gives way
    _, _, t, _ = T._starting_point(*build_train(flags + ["--data_dir=", "--tokenizer=char"]))
    assert t.data_dir == "" and t.input == [str(lower)]  # an empty --data_dir names no data


def test_throughput_leaves_out_the_first_steps_compilation():
    """The first step's call compiles it: tokens/s and MFU are timed from its return, and a log at
    that step has no throughput (null), not a figure a hundred times too low."""
    from gpt.metrics import Throughput
    _, _, t, _ = build_train(["--preset=tiny", "--no_progress"])
    prog, through = T.Progress(t, 0, print), Throughput(6e6, 1.0, 2.0)
    prog.tokens += 128
    prog.compiled()
    assert prog.rate(through) == dict.fromkeys(["tokens_per_sec", "model_tflops", "mfu", "mfu_vendor"])
    prog.tokens += 128
    assert prog.rate(through)["tokens_per_sec"] > 0


def test_input_reads_with_the_errors_and_include_it_is_given(tmp_path, monkeypatch):
    """--errors=replace and --include reach the preparation of --input (the messages advised them,
    and train.py refused both as unknown settings); the defaults keep earlier runs' cache."""
    monkeypatch.setenv("GPT_DATA_CACHE", str(tmp_path / "cache"))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.md").write_bytes("caf\xe9 au lait, ".encode("latin-1") * 40)
    (tmp_path / "in" / "b.txt").write_text("plain text, " * 40)
    from gpt.config import build_train
    from gpt.data import load_meta
    t = build_train([f"--input={tmp_path / 'in'}", "--errors=replace", "--include=*.md"])[2]
    meta = load_meta(T.resolve_data(t))
    assert meta["tokenizer"]["chars"] == "".join(sorted(set("caf\ufffd au lait, ")))  # a.md alone, replaced
    t = build_train([f"--input={tmp_path / 'in'}"])[2]
    chars = load_meta(T.resolve_data(t))["tokenizer"]["chars"]  # the default include: b.txt alone
    assert chars == "".join(sorted(set("plain text, ")))
