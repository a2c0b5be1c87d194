"""Training: a jit-compiled pure train step over the split NNX state, evaluation, the loop.

The model is split once (`nnx.split`) into a static graph definition and a pure dict of parameter
arrays; the train step is a `jax.jit` function of (params, opt_state, step) that merges the model
inside, so there is no per-call Python overhead from NNX. The state buffers are donated.

Exact resume rests on three things being functions of the step number alone: the data batches
(counter-based loader), the dropout keys (`fold_in(seed key, step)`) and the learning rate.
"""
from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from gpt import checkpoint as ckpt
from gpt import data as data_lib
from gpt import metrics as metrics_lib
from gpt import sharding
from gpt.config import ARCH_FIELDS, ModelConfig, TrainConfig, model_from_dict, to_dict
from gpt.errors import UserError
from gpt.model import GPT, abstract_params, flops_per_token, num_params
from gpt.runtime import compute_dtype
from gpt.tokenizer import load_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_CORPUS = REPO_ROOT / "data" / "shakespeare.txt"

# ----------------------------------------------------------------------------- pure pieces


def lr_schedule(t: TrainConfig) -> Callable[[jax.Array], jax.Array]:
    """Linear warmup, then cosine to min_lr (nanoGPT), constant, or warmup-stable-decay."""
    decay_iters = t.lr_decay_iters or t.max_iters
    warmup = t.warmup_iters

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = t.learning_rate * (step + 1) / (warmup + 1)
        if t.lr_schedule == "cosine":
            ratio = jnp.clip((step - warmup) / max(decay_iters - warmup, 1), 0.0, 1.0)
            after = t.min_lr + 0.5 * (1.0 + jnp.cos(jnp.pi * ratio)) * (t.learning_rate - t.min_lr)
        elif t.lr_schedule == "constant":
            after = jnp.asarray(t.learning_rate, jnp.float32)
        else:  # wsd: hold, then decay linearly to min_lr over the last decay_fraction of steps
            decay_start = decay_iters * (1.0 - t.decay_fraction)
            ratio = jnp.clip((step - decay_start) / max(decay_iters - decay_start, 1), 0.0, 1.0)
            after = t.learning_rate + ratio * (t.min_lr - t.learning_rate)
        return jnp.where(step < warmup, warm, after)
    return schedule


def decay_mask(params: Any) -> Any:
    """Weight decay on matrices only (names starting with w), not biases or LayerNorm scales."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: sharding._leaf_name(path).startswith("w"), params)


def make_optimizer(t: TrainConfig) -> optax.GradientTransformation:
    # The chain keeps the same structure with clipping off, so checkpoints stay compatible.
    clip = optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity()
    return optax.chain(clip, optax.adamw(lr_schedule(t), b1=t.beta1, b2=t.beta2,
                                         weight_decay=t.weight_decay, mask=decay_mask))


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in float32 (padded vocabulary entries are -inf, so excluded)."""
    logits_BTV = logits_BTV.astype(jnp.float32)
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_logit_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return jnp.mean(lse_BT - target_logit_BT)


def loss_fn(graphdef, params, x_BT, y_BT, dropout_key=None) -> jax.Array:
    """Logits at position t are scored against y[t] = x[t + 1] (the loader shifts the targets)."""
    logits_BTV, _ = nnx.merge(graphdef, params)(x_BT, dropout_key=dropout_key)
    return cross_entropy(logits_BTV, y_BT)


def make_train_step(graphdef, tx: optax.GradientTransformation, seed: int, train_mode: bool = True):
    """(params, opt_state, step, x_ABT, y_ABT) -> (params, opt_state, step + 1, metrics).

    A is the number of gradient-accumulation micro-batches, summed inside the compiled step with a
    scan so that the result equals one step on the concatenated batch.
    """
    base_key = jax.random.key(seed)

    def step_fn(params, opt_state, step, x_ABT, y_ABT):
        key = jax.random.fold_in(base_key, step) if train_mode else None
        A = x_ABT.shape[0]

        def micro(grads_acc, xs):
            i, x_BT, y_BT = xs
            k = None if key is None else jax.random.fold_in(key, i)
            loss, grads = jax.value_and_grad(lambda p: loss_fn(graphdef, p, x_BT, y_BT, k))(params)
            return jax.tree.map(jnp.add, grads_acc, grads), loss

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, losses = jax.lax.scan(micro, zeros, (jnp.arange(A), x_ABT, y_ABT))
        grads = jax.tree.map(lambda g: g / A, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {"loss": jnp.mean(losses), "grad_norm": optax.global_norm(grads)}
        return params, opt_state, step + 1, metrics
    return step_fn


def make_eval_step(graphdef):
    return lambda params, x_BT, y_BT: loss_fn(graphdef, params, x_BT, y_BT)


# ----------------------------------------------------------------------------- set-up


@dataclasses.dataclass
class Setup:
    """Everything resolved before the first step."""
    model_cfg: ModelConfig
    train_cfg: TrainConfig
    data_dir: Path
    meta: dict[str, Any]
    init_params: Any = None  # from --init_from=<dir>|gpt2
    resume: tuple[int, Any, Any, dict] | None = None  # step, params, opt_state, meta


def resolve_data(t: TrainConfig) -> Path:
    if t.data_dir:
        return Path(t.data_dir)
    inputs = t.input or [str(BUNDLED_CORPUS)]
    cache = Path(os.environ.get("GPT_DATA_CACHE", REPO_ROOT / "data" / "cache"))
    return data_lib.ensure_prepared(inputs, t.tokenizer, cache)


def _arch_diff(a: ModelConfig, b: ModelConfig, keys) -> list[str]:
    return [f"{k} ({getattr(a, k)} in the checkpoint, {getattr(b, k)} requested)"
            for k in keys if getattr(a, k) != getattr(b, k)]


def _model_for_checkpoint(ckpt_model: ModelConfig, flags: ModelConfig, explicit: set[str]
                          ) -> ModelConfig:
    """The checkpoint fixes the architecture; runtime fields (dtype, dropout, ...) follow the flags."""
    diff = _arch_diff(ckpt_model, flags, [k for k in ARCH_FIELDS if k in explicit])
    if diff:
        raise UserError(f"the checkpoint's model differs from the flags: {'; '.join(diff)} "
                        f"(drop those flags or use a new --out_dir)")
    runtime = {f.name: getattr(flags, f.name) for f in dataclasses.fields(ModelConfig)
               if f.name not in ARCH_FIELDS}
    return dataclasses.replace(ckpt_model, **runtime)


def find_gpt2_dir() -> Path:
    """A local Hugging Face GPT-2 directory (no network here): $GPT2_DIR or the HF hub cache."""
    env = os.environ.get("GPT2_DIR")
    candidates = [Path(env)] if env else []
    hub = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"
    candidates += sorted((hub / "models--gpt2" / "snapshots").glob("*")) if hub.exists() else []
    for c in candidates:
        if (c / "config.json").is_file() and (c / "model.safetensors").is_file():
            return c
    raise UserError("GPT-2 weights not found locally: download openai-community/gpt2 "
                    "(config.json + model.safetensors) and set GPT2_DIR=DIR, or convert it with "
                    "`python -m gpt.convert --from_hf DIR --out_dir OUT` and use --init_from=OUT")


def prepare_setup(m: ModelConfig, t: TrainConfig, explicit: set[str]) -> Setup:
    """Resolve data, vocabulary and the starting point; every user mistake raises UserError here."""
    out = Path(t.out_dir)
    if t.init_from == "resume":
        steps = ckpt.list_steps(out)
        if not steps:
            raise UserError(ckpt.describe_missing(out))
        _, meta_ck = ckpt.read_meta(out)
        m = _model_for_checkpoint(model_from_dict(meta_ck["config"]["model"]), m, explicit)
        if not t.data_dir and not t.input and meta_ck.get("data_dir"):
            t = dataclasses.replace(t, data_dir=meta_ck["data_dir"])
    elif ckpt.list_steps(out) and not t.overwrite:
        raise UserError(f"{out} already holds checkpoints (steps {ckpt.list_steps(out)}); resume with "
                        f"--init_from=resume, or start over with --overwrite, or pick another --out_dir")

    data_dir = resolve_data(t)
    meta = data_lib.load_meta(data_dir)
    init_params = None
    if t.init_from not in ("scratch", "resume"):
        src = find_gpt2_dir() if t.init_from == "gpt2" else Path(t.init_from)
        m, init_params = load_init(src, m, explicit)
    if t.init_from == "scratch":
        if "vocab_size" in explicit and m.vocab_size < meta["vocab_size"]:
            raise UserError(f"--vocab_size={m.vocab_size} is smaller than the data's vocabulary "
                            f"({meta['vocab_size']} tokens)")
        if "vocab_size" not in explicit:
            m = dataclasses.replace(m, vocab_size=meta["vocab_size"])
    elif m.vocab_size < meta["vocab_size"]:
        raise UserError(f"the model's vocabulary ({m.vocab_size}) is smaller than the data's "
                        f"({meta['vocab_size']}); prepare the data with the model's tokenizer")
    data_lib.check_split_sizes(meta, m.block_size)
    return Setup(m, t, data_dir, meta, init_params)


def load_init(src: Path, m: ModelConfig, explicit: set[str]) -> tuple[ModelConfig, Any]:
    """Parameters (host arrays) and architecture from a checkpoint dir or a Hugging Face GPT-2 dir."""
    if (src / "config.json").is_file() and not (src / "checkpoints").exists():
        from gpt.convert import load_hf
        hf_model, params = load_hf(src)
        return _model_for_checkpoint(hf_model, m, explicit), params
    _, meta = ckpt.read_meta(src)
    m = _model_for_checkpoint(model_from_dict(meta["config"]["model"]), m, explicit)
    abstract = abstract_params(m)
    _, params, _, _ = ckpt.Checkpointer(src, read_only=True).restore(abstract)
    return m, params


# ----------------------------------------------------------------------------- the loop


class StopFlag:
    """SIGINT/SIGTERM set a flag; the loop finishes the step, saves and exits 0."""

    def __init__(self):
        self.signal: int | None = None
        self._old = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.signal = signum

    def restore(self):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def train(s: Setup, log: Callable[[str], None] = sharding.log) -> dict[str, Any]:
    m, t = s.model_cfg, s.train_cfg
    out = Path(t.out_dir)
    mesh = sharding.make_mesh(t.mesh)
    sharding.check_divisibility(m, mesh, t.batch_size)
    main = sharding.is_main_process()
    if main:
        out.mkdir(parents=True, exist_ok=True)
    if t.overwrite and t.init_from != "resume" and main:
        ckpt.remove_all(out)
    if jax.process_count() > 1:  # no process may look at out_dir before process 0 has set it up
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("gpt_train_out_dir_ready")

    graphdef, params_shape = nnx.split(nnx.eval_shape(lambda: GPT(m, rngs=nnx.Rngs(t.seed))))
    p_shard = sharding.param_shardings(nnx.to_pure_dict(params_shape), mesh)
    tx = make_optimizer(t)
    init_fn = jax.jit(lambda: nnx.to_pure_dict(nnx.state(GPT(m, rngs=nnx.Rngs(t.seed)))),
                      out_shardings=p_shard)
    params = init_fn() if s.init_params is None else jax.device_put(s.init_params, p_shard)
    opt_shape = jax.eval_shape(tx.init, params)
    o_shard = sharding.like_params(opt_shape, p_shard, mesh)
    opt_state = jax.jit(tx.init, out_shardings=o_shard)(params)
    step = 0
    checkpointer = ckpt.Checkpointer(out, keep=t.keep_checkpoints)
    tokenizer = load_tokenizer(s.meta["tokenizer"], s.data_dir)

    best_val = None
    if t.init_from == "resume":
        abs_p = abstract_params(m, p_shard)
        abs_o = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                             opt_shape, o_shard)
        step, params, opt_state, meta_ck = checkpointer.restore(abs_p, abs_o)
        best_val = meta_ck.get("best_val_loss")
        log(f"resuming from step {step} in {out}")

    n_params = num_params(m)
    total_b, per_dev_b = sharding.state_bytes((params, opt_state))
    log(f"{n_params / 1e6:.2f}M params; params+optimizer {total_b / 1e9:.3f} GB in all, "
        f"{per_dev_b / 1e9:.3f} GB per device on {mesh.size} (mesh {dict(mesh.shape)}); "
        f"compute {compute_dtype(m.dtype).name}")

    # Copy the tokenizer's files next to the checkpoints so sampling needs nothing else.
    if main:
        for name in tokenizer.files():
            (out / name).write_bytes((s.data_dir / name).read_bytes())

    A = t.gradient_accumulation_steps
    B, T = t.batch_size, m.block_size
    pi, pc = sharding.batch_process_layout(mesh)  # this process's block of the batch rows
    train_batches = data_lib.Batches(s.data_dir, "train", T, B * A, seed=t.seed,
                                     process_index=pi, process_count=pc)
    train_batches.restore({"seed": t.seed, "index": step})
    x_shard = sharding.batch_sharding(mesh, ndim=3)
    e_shard = sharding.batch_sharding(mesh, ndim=2)

    step_fn = jax.jit(make_train_step(graphdef, tx, t.seed, train_mode=m.dropout > 0),
                      in_shardings=(p_shard, o_shard, None, x_shard, x_shard),
                      out_shardings=(p_shard, o_shard, None, None), donate_argnums=(0, 1))
    eval_fn = jax.jit(make_eval_step(graphdef), in_shardings=(p_shard, e_shard, e_shard))

    def device_batch(batches) -> tuple[jax.Array, jax.Array]:
        x, y = batches.next()
        local_rows = x.shape[0] // A
        x = x.reshape(A, local_rows, T)
        y = y.reshape(A, local_rows, T)
        shape = (A, B, T)
        return sharding.global_batch(x, x_shard, shape), sharding.global_batch(y, x_shard, shape)

    def evaluate(at_step: int) -> dict[str, float]:
        res = {}
        for split in ("train", "val"):
            bt = data_lib.Batches(s.data_dir, split, T, B, seed=t.seed + 1 + (split == "val"),
                                  process_index=pi, process_count=pc)
            bt.restore({"seed": t.seed + 1 + (split == "val"), "index": at_step * t.eval_iters})
            losses = []
            for _ in range(t.eval_iters):
                x, y = bt.next()
                losses.append(eval_fn(params, sharding.global_batch(x, e_shard, (B, T)),
                                      sharding.global_batch(y, e_shard, (B, T))))
            res[f"{split}_loss"] = float(np.mean([float(v) for v in losses]))
        bpt = s.meta.get("bytes_per_token", {}).get("val")
        res["val_ppl"] = math.exp(min(res["val_loss"], 50))
        res["val_bpb"] = res["val_loss"] / math.log(2) / bpt if bpt else None
        return res

    dtype_name = compute_dtype(m.dtype).name
    ceiling = metrics_lib.measure_matmul_tflops(compute_dtype(m.dtype))
    through = metrics_lib.Throughput(flops_per_token(m, T), ceiling,
                                     metrics_lib.vendor_peak_tflops(dtype_name), mesh.size)
    mlog = metrics_lib.MetricsLog(out, resume_step=step if t.init_from == "resume" else None,
                                  enabled=main)
    config_json = {"model": to_dict(m), "train": to_dict(t)}

    def save(at_step: int, val_loss: float | None) -> None:
        meta = {"format_version": ckpt.FORMAT_VERSION, "step": at_step, "config": config_json,
                "tokenizer": s.meta["tokenizer"], "data_dir": str(s.data_dir.absolute()),
                "data_state": {"seed": t.seed, "index": at_step},
                "rng": np.asarray(jax.random.key_data(jax.random.key(t.seed))).tolist(),
                "val_loss": val_loss, "best_val_loss": best_val}
        checkpointer.save(at_step, params, opt_state, meta, val_loss)

    stop = StopFlag()
    progress = None
    if main and t.progress:
        from tqdm import tqdm
        progress = tqdm(total=t.max_iters, initial=step, dynamic_ncols=True, file=sys.stderr,
                        mininterval=1.0, disable=None)
    ckpt_interval = t.ckpt_interval or t.eval_interval
    summary: dict[str, Any] = {"start_step": step}
    t_start = time.perf_counter()
    t_log, tokens_since = time.perf_counter(), 0
    last_metrics = None
    train_losses: list[tuple[int, float]] = []
    x, y = device_batch(train_batches)
    try:
        while step < t.max_iters:
            params, opt_state, _, last_metrics = step_fn(params, opt_state, step, x, y)
            step += 1
            tokens_since += A * B * T
            if step < t.max_iters:
                x, y = device_batch(train_batches)  # prefetch while the step runs
            at_log = step % t.log_interval == 0 or step == t.max_iters
            at_eval = step % t.eval_interval == 0 or step == t.max_iters
            stopping = stop.signal is not None  # read once: a signal arriving later stops a step later
            at_ckpt = step % ckpt_interval == 0 or step == t.max_iters or stopping
            if at_log or at_eval or at_ckpt:
                host = metrics_lib.to_host(last_metrics)  # the only device->host sync
                if not math.isfinite(host["loss"]):
                    raise UserError(f"the loss became {host['loss']} at step {step}; stopped "
                                    f"without saving (last good checkpoint kept); try a lower "
                                    f"--learning_rate or --grad_clip=1.0")
                train_losses.append((step, host["loss"]))
                now = time.perf_counter()
                rate = through(tokens_since, now - t_log)
                t_log, tokens_since = now, 0
                lr = float(lr_schedule(t)(step - 1))
                rec = {"kind": "train", "step": step, "loss": host["loss"], "lr": lr,
                       "grad_norm": host["grad_norm"], **rate,
                       "elapsed_sec": now - t_start}
                if at_log:
                    mlog.write(rec)
                    if progress is not None:
                        mfu = f"{100 * rate['mfu']:.1f}%" if rate["mfu"] is not None else "-"
                        progress.set_postfix_str(f"loss {host['loss']:.4f} lr {lr:.2e} "
                                                 f"tok/s {rate['tokens_per_sec']:,.0f} mfu {mfu}",
                                                 refresh=False)
                val_loss = None
                if at_eval:
                    ev = evaluate(step)
                    val_loss = ev["val_loss"]
                    if best_val is None or val_loss < best_val:
                        best_val = val_loss
                    mlog.write({"kind": "eval", "step": step, **ev, "lr": lr,
                                "tokens_per_sec": rate["tokens_per_sec"], "mfu": rate["mfu"],
                                "mfu_vendor": rate["mfu_vendor"], "elapsed_sec": now - t_start})
                    mlog.plot()
                    msg = (f"step {step}: train loss {ev['train_loss']:.4f}, val loss "
                           f"{ev['val_loss']:.4f}" + (f", val bpb {ev['val_bpb']:.3f}"
                                                      if ev["val_bpb"] else ""))
                    (progress.write(msg, file=sys.stderr) if progress is not None else log(msg))
                    summary.update(ev)
                    t_log = time.perf_counter()  # do not charge evaluation to throughput
                if at_ckpt:
                    save(step, val_loss)
            if progress is not None:
                progress.update(1)
            if stopping:
                log(f"\nreceived {signal.Signals(stop.signal).name}: saved step {step}; continue "
                    f"with --init_from=resume")
                break
    finally:
        stop.restore()
        if progress is not None:
            progress.close()
        checkpointer.close()
        mlog.close()
    summary.update(step=step, train_losses=train_losses, best_val_loss=best_val,
                   elapsed_sec=time.perf_counter() - t_start, interrupted=stop.signal is not None)
    return summary
