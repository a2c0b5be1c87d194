"""Training: a jit-compiled pure train step over the split NNX state, evaluation, the loop.

The model is split once (`nnx.split`) into a static graph definition and a pure dict of parameter
arrays; the train step is a `jax.jit` function of (params, opt_state, step) that merges the model
inside, so there is no per-call Python overhead from NNX. The state buffers are donated.

Exact resume rests on three things being functions of the step number alone: the data batches
(counter-based loader), the dropout keys (`fold_in(seed key, step)`) and the learning rate.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
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
from gpt import batches as batches_lib
from gpt import data as data_lib
from gpt import distributed
from gpt import lora as lora_lib
from gpt import store
from gpt import metrics as metrics_lib
from gpt import moe as moe_lib
from gpt import sharding
from gpt.config import (ComputeConfig, ModelConfig, TrainConfig, check_moe_flags, model_from_dict,
                        schedule_warnings, to_dict)
from gpt.errors import UserError, finite_number
from gpt.model import GPT, abstract_model, flops_per_token, num_params
from gpt.ops.cross_entropy import cross_entropy  # noqa: F401 - re-exported (the tests use it)
from gpt.runtime import Runtime, compiler_options, dtype_note, loss_chunks_for, on_mesh, resolve
from gpt.tokenizer import REPO_ROOT, atomic_write_bytes, check_data_tokenizer, load_tokenizer, tokenizer_hint

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
    """Weight decay on matrices only (names starting with w, and LoRA adapters), not biases or
    LayerNorm scales."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: sharding._leaf_name(path).startswith(("w", "lora_")), params)


def make_optimizer(t: TrainConfig) -> optax.GradientTransformation:
    # The chain keeps the same structure with clipping off, so checkpoints stay compatible.
    clip = optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity()
    return optax.chain(clip, optax.adamw(lr_schedule(t), b1=t.beta1, b2=t.beta2,
                                         weight_decay=t.weight_decay, mask=decay_mask))


def loss_fn(graphdef, params, x_BT, y_BT, dropout_key=None, frozen=None) -> jax.Array:
    """Logits at position t are scored against y[t] = x[t + 1] (the loader shifts the targets).
    `frozen`: parameters that are not trained (a LoRA run's base), merged in beside `params`."""
    model = nnx.merge(graphdef, params, frozen) if frozen else nnx.merge(graphdef, params)
    return model.loss(x_BT, y_BT, dropout_key=dropout_key)[0]


def objective(graphdef, params, x_BT, y_BT, dropout_key=None, frozen=None,
              moe: moe_lib.MoETraining | None = None) -> tuple[jax.Array, tuple[jax.Array, Any]]:
    """(what training minimises, (cross-entropy, the MoE layers' routing figures or None)): the
    cross-entropy of `loss_fn`, plus for a mixture of experts the load-balancing and z-losses
    (averaged over the MoE layers) times their coefficients, with the experts' capacity applied."""
    moe = moe or moe_lib.MoETraining()
    model = nnx.merge(graphdef, params, frozen) if frozen else nnx.merge(graphdef, params)
    ce, stats = model.loss(x_BT, y_BT, dropout_key=dropout_key, capacity_factor=moe.capacity_factor)
    if stats is None:
        return ce, (ce, None)
    aux = moe.aux_loss_coef * jnp.mean(stats.aux_loss) + moe.z_loss_coef * jnp.mean(stats.z_loss)
    return ce + aux, (ce, stats)


def moe_metrics(stats_A: moe_lib.MoEStats) -> dict[str, jax.Array]:
    """The step's routing figures (A micro-batches, M MoE layers): the auxiliary losses and the
    dropped share averaged over both, and each layer's expert load [M, E]."""
    return {"moe_aux_loss": jnp.mean(stats_A.aux_loss), "moe_z_loss": jnp.mean(stats_A.z_loss),
            "moe_dropped_fraction": jnp.mean(stats_A.dropped), "moe_load": jnp.mean(stats_A.load_E, axis=0)}


def make_train_step(graphdef, tx: optax.GradientTransformation, seed: int, train_mode: bool = True,
                    lr: Callable[[jax.Array], jax.Array] | None = None,
                    moe: moe_lib.MoETraining | None = None):
    """(params, opt_state, step, x_ABT, y_ABT[, frozen]) -> (params, opt_state, step + 1, metrics).

    A is the number of gradient-accumulation micro-batches, summed inside the compiled step with a
    scan so that the result equals one step on the concatenated batch (for MoE models up to the
    load-balancing loss, a product of per-batch means, taken per micro-batch and averaged). With
    `lr` (the optimizer's schedule) the metrics include the learning rate this step applied.
    `frozen` parameters (a LoRA run's base) take part in the loss but get no gradient and no update. `moe`: the experts'
    capacity and the auxiliary losses' coefficients (default: TrainConfig's defaults); the
    metrics' "loss" is the cross-entropy alone, and a MoE model's metrics add `moe_metrics`.
    """
    base_key = jax.random.key(seed)

    def step_fn(params, opt_state, step, x_ABT, y_ABT, frozen=None):
        key = jax.random.fold_in(base_key, step) if train_mode else None
        A = x_ABT.shape[0]

        def micro(grads_acc, xs):
            i, x_BT, y_BT = xs
            k = None if key is None else jax.random.fold_in(key, i)
            loss = lambda p: objective(graphdef, p, x_BT, y_BT, k, frozen, moe)  # noqa: E731
            (_, (ce, stats)), grads = jax.value_and_grad(loss, has_aux=True)(params)
            return jax.tree.map(jnp.add, grads_acc, grads), (ce, stats)

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, (losses, stats_A) = jax.lax.scan(micro, zeros, (jnp.arange(A), x_ABT, y_ABT))
        grads = jax.tree.map(lambda g: g / A, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {"loss": jnp.mean(losses), "grad_norm": optax.global_norm(grads)}
        if stats_A is not None:
            metrics.update(moe_metrics(stats_A))
        if lr is not None:
            metrics["lr"] = lr(step)
        return params, opt_state, step + 1, metrics
    return step_fn


def make_eval_step(graphdef):
    """(params, x_BT, y_BT[, frozen]) -> mean next-token loss, without dropout."""
    return lambda params, x_BT, y_BT, frozen=None: loss_fn(graphdef, params, x_BT, y_BT, frozen=frozen)


def evaluate(eval_fn, params, data_dir: Path, meta: dict, shape: tuple[int, int], at_step: int,
             t: TrainConfig, layout: tuple[int, int], place) -> dict[str, float | None]:
    """Mean loss over `eval_iters` batches of each split, val perplexity and bits per byte.

    The batches are a function of the step (as the training batches are), so a resumed run
    evaluates exactly what an uninterrupted one would. `place` puts a host batch on the mesh.
    """
    (B, T), res = shape, {}
    for split in ("train", "val"):
        seed = t.seed + 1 + (split == "val")
        batches = batches_lib.Batches(data_dir, split, T, B, seed=seed, process_index=layout[0],
                                      process_count=layout[1], meta=meta)
        batches.restore({"seed": seed, "index": at_step * t.eval_iters})
        losses = [eval_fn(params, *map(place, batches.next())) for _ in range(t.eval_iters)]
        res[f"{split}_loss"] = float(np.mean([float(v) for v in losses]))
    bpt = meta.get("bytes_per_token", {}).get("val")
    res["val_ppl"] = math.exp(min(res["val_loss"], 50))
    res["val_bpb"] = res["val_loss"] / math.log(2) / bpt if bpt else None
    return res


# ----------------------------------------------------------------------------- set-up


@dataclasses.dataclass
class Setup:
    """Everything resolved before the first step."""
    model_cfg: ModelConfig
    compute_cfg: ComputeConfig
    train_cfg: TrainConfig
    data_dir: Path
    meta: dict[str, Any]
    init_params: Any = None  # from --init_from=<dir>|gpt2 (a LoRA run: its frozen base)
    lora: lora_lib.LoRAConfig | None = None
    base_ref: dict[str, Any] | None = None  # a LoRA run's base: path, step, sha256


def resolve_data(t: TrainConfig) -> Path:
    """The data dir: --data_dir, or --input (default: the bundled Shakespeare) prepared into the
    cache once. In a multi-host job process 0 prepares and the others then find it prepared."""
    if t.data_dir:
        return Path(t.data_dir)
    inputs = t.input or [str(BUNDLED_CORPUS)]
    cache = Path(os.environ.get("GPT_DATA_CACHE", REPO_ROOT / "data" / "cache"))
    kw = dict(text_field=t.text_field, skip_bad_records=t.skip_bad_records, errors=t.errors,
              **({"include": t.include} if t.include else {}))  # the cache key of earlier runs kept
    return sharding.main_process_first(lambda: data_lib.ensure_prepared(inputs, t.tokenizer, cache, **kw),
                                       lambda: data_lib.ensure_prepared(inputs, t.tokenizer, cache,
                                                                        prepare_missing=False, **kw))


def _arch_diff(a: ModelConfig, b: ModelConfig, keys) -> list[str]:
    return [f"{k} ({getattr(a, k)} in the checkpoint, {getattr(b, k)} requested)"
            for k in keys if getattr(a, k) != getattr(b, k)]


def _model_for_checkpoint(ckpt_model: ModelConfig, flags: ModelConfig, explicit: set[str],
                          resuming: bool = False) -> ModelConfig:
    """The checkpoint fixes the architecture: a flag that asks for another one is an error (how the
    model is run, ComputeConfig, always follows the flags)."""
    keys = [f.name for f in dataclasses.fields(ModelConfig) if f.name in explicit]
    diff = _arch_diff(ckpt_model, flags, keys)
    if diff:
        fix = ("drop those flags, or train another model in a new --out_dir" if resuming else
               "drop those flags: a model trained from these weights keeps their architecture")
        raise UserError(f"the checkpoint's model differs from the flags: {'; '.join(diff)} ({fix})")
    return ckpt_model


def find_gpt2_dir() -> Path:
    """A local Hugging Face GPT-2 directory (no network here): $GPT2_DIR or the HF hub cache."""
    env = os.environ.get("GPT2_DIR")
    candidates = [Path(env)] if env else []
    hub = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"
    for repo in ("models--gpt2", "models--openai-community--gpt2"):  # as `gpt2`, or under its org's name
        candidates += sorted((hub / repo / "snapshots").glob("*")) if hub.exists() else []
    for c in candidates:
        if (c / "config.json").is_file() and (c / "model.safetensors").is_file():
            return c
    there = f" (GPT2_DIR={env} holds no config.json + model.safetensors)" if env else ""
    raise UserError(f"GPT-2 weights not found locally{there}: download openai-community/gpt2 "
                    "(config.json + model.safetensors) and set GPT2_DIR=DIR, or convert it with "
                    "`python -m gpt.convert --from_hf DIR --out_dir OUT` and use --init_from=OUT")


def init_source(init_from: str) -> Path:
    """--init_from's folder (not scratch or resume): GPT-2's for gpt2, else the one named (which
    `check_init_from` found to hold a model before any data was prepared)."""
    return find_gpt2_dir() if init_from == "gpt2" else Path(init_from)


def prepare_setup(m: ModelConfig, c: ComputeConfig, t: TrainConfig, explicit: set[str]) -> Setup:
    """Resolve data, vocabulary and the starting point; every user mistake raises UserError here.
    In a multi-host job every process does the same, and a mistake on any stops them all.
    out_dir's lock (`ckpt.hold_out_dir`) is taken here and held until `train` ends; a refusal
    releases it unless this process held it before (an earlier setup of the same out_dir)."""
    held = ckpt.holds_out_dir(t.out_dir)
    try:
        m, c, t, meta_ck = sharding.all_or_none(lambda: _starting_point(m, c, t, explicit))
        data_dir = resolve_data(t)
        return sharding.all_or_none(lambda: _with_data(m, c, t, explicit, data_dir, meta_ck))
    except BaseException:
        if not held:
            ckpt.release_out_dir(t.out_dir)
        raise


def _starting_point(m: ModelConfig, c: ComputeConfig, t: TrainConfig, explicit: set[str]
                    ) -> tuple[ModelConfig, ComputeConfig, TrainConfig, dict | None]:
    """The settings, from the checkpoint for --init_from=resume (with its meta); out_dir's state
    checked."""
    out = Path(t.out_dir)
    if t.init_from == "resume" and t.overwrite:
        raise UserError("--overwrite starts over and --init_from=resume continues: pass one of them")
    check_writable_dir(out, "--out_dir")
    text_flags = [f"--{k}" for k in PREPARE_FLAGS if k in explicit]
    named_dir = "data_dir" in explicit and bool(t.data_dir)  # --data_dir="" names none
    if named_dir and text_flags:
        raise UserError(f"--data_dir names data already prepared and tokenized, which {', '.join(text_flags)} "
                        f"would not change; pass --data_dir alone, or --input with its preparation flags")
    if t.init_from not in ("scratch", "resume", "gpt2") and Path(t.init_from).resolve() == out.resolve():
        # the run would replace the weights it starts from (a LoRA run keeps only its adapters and
        # points at its base, which would be gone)
        raise UserError(f"--init_from and --out_dir are both {out}: the run would write over the model it "
                        f"starts from; pick another --out_dir")
    if t.init_from not in ("scratch", "resume", "gpt2"):
        check_init_from(Path(t.init_from))
    if sharding.is_main_process():  # an --overwrite run that died before saving: old run back
        ckpt.hold_out_dir(out)  # never while that run (or any other) is still writing there
        ckpt.settle_aside(out, out.absolute() / ckpt.ASIDE)
    meta_ck = None
    if t.init_from == "resume":
        steps = ckpt.list_steps(out)
        if not steps:
            raise UserError(ckpt.describe_missing(out))
        _, meta_ck = ckpt.read_meta(out)
        if not meta_ck["config"].get("train") and not t.lora_rank:  # a conversion, or a LoRA merge
            origin = meta_ck.get("source") or (meta_ck.get("merged_from") or {}).get("path", "another run")
            raise UserError(f"{out} holds a checkpoint converted from {origin}, which has no training state to "
                            f"resume (it is intact); fine-tune it with --init_from={out} and a new --out_dir")
        m = _model_for_checkpoint(model_from_dict(meta_ck["config"]["model"]), m, explicit, resuming=True)
        c, t = _settings_for_resume(meta_ck["config"], c, t, explicit, _recorded_base(meta_ck))
        if "input" in explicit and not named_dir:  # the flag wins over the saved data
            t = dataclasses.replace(t, data_dir="")
        elif named_dir:
            t = dataclasses.replace(t, input=[])
        elif not t.data_dir and not t.input and isinstance(meta_ck.get("data_dir"), str):
            t = dataclasses.replace(t, data_dir=meta_ck["data_dir"])
    elif ckpt.list_steps(out) and not t.overwrite:
        raise UserError(f"{out} already holds checkpoints (steps {ckpt.list_steps(out)}); resume with "
                        f"--init_from=resume, or start over with --overwrite, or pick another --out_dir")
    elif t.overwrite and ckpt.foreign_entries(out):
        raise UserError(f"{ckpt.checkpoint_dir(out)} holds files our runs never write "
                        f"({', '.join(ckpt.foreign_entries(out)[:3])}), so --overwrite will not replace it; "
                        f"pick another --out_dir")
    return m, c, t, meta_ck


def check_init_from(src: Path) -> None:
    """--init_from names a Hugging Face directory or a folder with checkpoints: said before any data
    is prepared, naming --init_from (the generic message told the user to pass --out_dir)."""
    if not lora_lib.is_hf_dir(src) and not ckpt.list_steps(src):
        raise UserError(f"--init_from={src}: " + ckpt.describe_missing(
            src, "pass --init_from=DIR of a training output or a Hugging Face model (config.json)"))


def check_writable_dir(path: Path, flag: str) -> None:
    """`path` is (or can be made) a directory this process can write into: not a file, under no
    file, on no read-only or forbidden disk. Checked before anything is prepared or written."""
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag}={path} is a file, not a directory; pass a directory")
    parent = path
    while not parent.exists():
        if parent.is_symlink():
            raise UserError(f"{flag}={path}: {parent} is a link to {os.readlink(parent)}, which does not exist; "
                            f"create that directory, or pass another")
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{flag}={path} lies under {parent}, which is a file; pass a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{flag}={path}: {parent} is not writable (read-only disk or no permission); "
                        f"pass a directory you can write to")


def _with_data(m: ModelConfig, c: ComputeConfig, t: TrainConfig, explicit: set[str], data_dir: Path,
               meta_ck: dict | None) -> Setup:
    """The data's meta, --init_from's weights, and the vocabulary checked against the data."""
    meta = data_lib.load_meta(data_dir)
    init_params, lora, base_ref = None, None, None
    if t.lora_rank:
        m, base = _lora_base(t, m, explicit, meta_ck)
        lora_lib.check_tokenizer(base, meta["tokenizer"], base.ref["path"])
        init_params, lora, base_ref = base.params, lora_lib.resolve(t, m), base.ref
    elif t.init_from not in ("scratch", "resume"):
        src = init_source(t.init_from)
        m, init_params, tokenizer = load_init(src, m, explicit)
        check_data_tokenizer(tokenizer, meta["tokenizer"], f"the model in {src}",
                             f"prepare the data with {tokenizer_hint(tokenizer, src)}")
    elif meta_ck is not None:
        check_data_tokenizer(meta_ck.get("tokenizer"), meta["tokenizer"], f"the run in {t.out_dir} was trained",
                             f"pass the data it was trained on ({_recorded_data(meta_ck)})")
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
    check_moe_flags(m, t, explicit)  # the model is known now, from a checkpoint too
    if t.align_documents and meta["format_version"] < 2:
        raise UserError(f"{str(data_dir)!r} has no document index (a single-file data dir, format version 1), "
                        f"which --align_documents needs; prepare the data again with python -m gpt.data")
    return Setup(m, c, t, data_dir, meta, init_params, lora, base_ref)


def _lora_base(t: TrainConfig, m: ModelConfig, explicit: set[str], meta_ck: dict | None
               ) -> tuple[ModelConfig, lora_lib.Base]:
    """A LoRA run's frozen base: --init_from's, or the one a resumed run recorded (which must be
    unchanged); the architecture is the base's."""
    if meta_ck is None:
        base = lora_lib.read_base(init_source(t.init_from))
    elif isinstance(meta_ck.get("lora"), dict):
        base = lora_lib.load_base(meta_ck["lora"].get("base"), t.out_dir)
    else:
        raise UserError(f"the run in {t.out_dir} is not a LoRA run, so it cannot be resumed with "
                        f"--lora_rank; to fine-tune its weights with LoRA use --init_from={t.out_dir} "
                        f"--out_dir=NEW_DIR")
    return _model_for_checkpoint(base.cfg, m, explicit), base


# The flags that say how text is prepared (gpt.data): with a prepared --data_dir they do nothing.
PREPARE_FLAGS = ("input", "tokenizer", "text_field", "skip_bad_records", "errors", "include")

# What a resumed run may change with a flag (how long it runs, how often it reports, where the
# data and devices are, the kernels); every other setting must match the checkpoint. Unflagged,
# all of them come from the checkpoint, except the per-invocation ones.
RESUME_MAY_CHANGE = {"data_dir", "input", "max_iters", "lr_decay_iters", "eval_interval", "eval_iters",
                     "log_interval", "ckpt_interval", "keep_checkpoints", "mesh", "dtype", "attention",
                     "remat", "scan_layers", "residual_dtype", "loss_chunks"}
PER_INVOCATION = {"out_dir", "init_from", "overwrite", "progress", "distributed", "coordinator_address",
                  "num_processes", "process_id"}


def _saved(saved: dict, key: str) -> dict:
    """The saved settings of one config; checkpoints from before ComputeConfig existed kept the
    dropout in the model's config."""
    old = saved.get(key) if isinstance(saved.get(key), dict) else {}
    if key == "compute" and not old and isinstance(saved.get("model"), dict) and "dropout" in saved["model"]:
        old = {"dropout": saved["model"]["dropout"]}
    return old


def _settings_for_resume(saved: dict, c: ComputeConfig, t: TrainConfig, explicit: set[str],
                         base: str | None = None) -> tuple[ComputeConfig, TrainConfig]:
    """--init_from=resume continues the run as it was: its training and compute settings come
    from the checkpoint, a flag that contradicts one is an error naming both values unless it is
    in RESUME_MAY_CHANGE. Checkpoints from before the settings were saved keep the flags. `base`:
    a LoRA run's base, where other LoRA settings start (a LoRA run is no base for --lora_rank)."""
    from gpt.config import json_fields, validate_compute, validate_train
    merged = []
    for cfg, key in ((c, "compute"), (t, "train")):
        old, updates = json_fields(type(cfg), _saved(saved, key)), {}
        for f in dataclasses.fields(cfg):
            if f.name not in old or f.name in PER_INVOCATION:
                continue
            if f.name not in explicit:
                updates[f.name] = old[f.name]
            elif getattr(cfg, f.name) != old[f.name] and f.name not in RESUME_MAY_CHANGE:
                fresh = f"a new run from its weights with --init_from={t.out_dir}"
                if base and f.name.startswith("lora_"):
                    fresh = f"a new LoRA run from its base with --init_from={base}"
                raise UserError(f"--{f.name}={getattr(cfg, f.name)} differs from the run being resumed "
                                f"({f.name}={old[f.name]!r}); a resumed run keeps its settings: drop the "
                                f"flag, or start {fresh} --out_dir=NEW_DIR")
        merged.append(dataclasses.replace(cfg, **updates))
    try:
        c, t = validate_compute(merged[0]), validate_train(merged[1])
    except (TypeError, ValueError, UserError) as e:
        raise UserError(f"the settings saved in {t.out_dir}'s checkpoint are not valid ({e}); "
                        f"the checkpoint's metadata is damaged") from None
    if "mesh" not in explicit:
        _check_saved_mesh(t.mesh)
    return c, t


def _recorded_base(meta_ck: dict) -> str | None:
    """The path of the base a LoRA checkpoint records (None for any other checkpoint)."""
    ref = meta_ck.get("lora", {}).get("base") if isinstance(meta_ck.get("lora"), dict) else None
    return ref["path"] if isinstance(ref, dict) and isinstance(ref.get("path"), str) else None


def _check_saved_mesh(mesh: str) -> None:
    """A resumed run keeps its saved --mesh unless the flag is given; on other devices one line
    says where the mesh came from (the user never typed it)."""
    try:
        sharding.parse_mesh(mesh, jax.device_count())
    except UserError as e:
        raise UserError(f"the run being resumed was saved with --mesh={mesh}, which does not fit here: {e}; "
                        f"pass --mesh for these {jax.device_count()} device(s) (--mesh= puts them all on "
                        f"data)") from None


def load_init(src: Path, m: ModelConfig, explicit: set[str]) -> tuple[ModelConfig, Any, dict | None]:
    """Parameters (host arrays), architecture and tokenizer spec (None if it records none) from a
    checkpoint dir (a LoRA run's merged) or a Hugging Face dir."""
    if lora_lib.is_hf_dir(src):
        from gpt.convert import hf_dir_tokenizer, load_hf
        hf_model, params = load_hf(src)
        tokenizer = hf_dir_tokenizer(src, hf_model)
        return _model_for_checkpoint(hf_model, m, explicit), params, tokenizer and tokenizer[0]
    _, meta = ckpt.read_meta(src)
    m = _model_for_checkpoint(model_from_dict(meta["config"]["model"]), m, explicit)
    _, _, params, meta = lora_lib.restore_params(src)
    return m, params, meta.get("tokenizer")


def _recorded_data(meta_ck: dict) -> str:
    """Where a checkpoint says its data came from, as flags."""
    train = meta_ck["config"].get("train") or {}
    if isinstance(meta_ck.get("data_dir"), str):
        return f"--data_dir={meta_ck['data_dir']}"
    inputs = train.get("input") if isinstance(train.get("input"), list) else []
    return " ".join(f"--input={i}" for i in inputs) or "its --data_dir or --input"


# ----------------------------------------------------------------------------- the loop


class StopFlag:
    """SIGINT/SIGTERM set a flag; the loop finishes the step (multi-host: the next one), saves and
    exits 0. A second signal is reported and the save goes on (schedulers often repeat SIGTERM); a
    third aborts once Python runs again: on CPU, where a step runs on the main thread
    (`gpt.runtime.run_cpu_programs_inline`), after the step under way.
    In a multi-host job the processes agree on the step to stop at (`agreed`), since a signal
    reaches each process at its own moment and a save is collective."""

    def __init__(self):
        self.signal: int | None = None
        self.count = 0
        self._pending = None  # multi-host: the previous step's agreement, still on its way
        self._old = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        self.count += 1
        if self.count >= 3:
            raise KeyboardInterrupt  # a third signal aborts (the last complete checkpoint stays)
        if self.count == 2:
            print(f"\nreceived {signal.Signals(signum).name} again: finishing the save first "
                  f"(a third signal aborts it)", file=sys.stderr, flush=True)
        self.signal = self.signal or signum

    def agreed(self) -> bool:
        """Whether to stop after this step: this process's flag, or in a multi-host job any
        process's. There every call starts a tiny reduction of the processes' flags on the devices
        and answers with the previous call's, so a signal stops the job one step later. Waiting
        for this step's own answer would wait for the step itself: the host could not queue the
        next step while the devices run this one, and every step would leave them idle for as
        long as the host takes to dispatch it. Every process reads the same answers in the same
        order, so all of them stop after the same step."""
        if jax.process_count() == 1:
            return self.signal is not None
        previous, self._pending = self._pending, sharding.max_over_processes(self.signal or 0)
        agreed = 0 if previous is None else int(np.asarray(previous.addressable_data(0)))
        if self.signal is None and agreed:
            self.signal = agreed  # stopping because another process was told to
        return bool(agreed)

    def restore(self):
        for sig, old in self._old.items():
            signal.signal(sig, old)


@dataclasses.dataclass
class State:
    """What changes from step to step (and what a checkpoint holds: all but `frozen`)."""
    params: Any  # what trains: all parameters, or a LoRA run's adapters
    opt_state: Any
    step: int = 0
    best_val: float | None = None
    frozen: Any = dataclasses.field(default_factory=dict)  # a LoRA run's base: read, never updated


@dataclasses.dataclass
class Run:
    """What the loop uses, built once: the compiled steps, shardings, data and outputs."""
    s: Setup
    mesh: Any
    step_fn: Callable
    eval_fn: Callable
    shardings: dict[str, Any]  # params, opt_state, batch (A, B, T), eval batch (B, T)
    batches: batches_lib.Batches
    layout: tuple[int, int]  # this process's (index, count) in the batch rows
    checkpointer: ckpt.Checkpointer
    mlog: metrics_lib.MetricsLog
    through: metrics_lib.Throughput


def prepare_out_dir(s: Setup) -> tuple[Path, Path | None]:
    """Create out_dir (process 0), check that every process runs the same job in the same
    out_dir (before anything destructive), move old checkpoints aside for --overwrite (deleted
    only once this run has saved one: `ckpt.settle_aside`), and hold every process until that is
    done (no process may look at out_dir before process 0 has set it up)."""
    t = s.train_cfg
    out, aside = Path(t.out_dir), None
    sharding.all_or_none(lambda: (out.mkdir(parents=True, exist_ok=True), ckpt.hold_out_dir(out))
                         if sharding.is_main_process() else None)
    if jax.process_count() > 1:
        agree_across_processes(s, out)
    if sharding.is_main_process() and t.overwrite and t.init_from != "resume":
        aside = ckpt.set_aside(out)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("gpt_train_out_dir_ready")
    return out, aside


PER_PROCESS = {"process_id", "out_dir", "data_dir", "input"}  # may differ: paths are per host
TOKEN = ".gpt-process0-token"


def agree_across_processes(s: Setup, out: Path) -> None:
    """Every process of a multi-host job must have process 0's settings, data (by content) and
    resume step, and see the same out_dir: process 0 writes a random token there that the others
    must read back. A mismatch is one line on every process (sharding.check_agreement)."""
    from jax.experimental import multihost_utils
    token = out / TOKEN
    sharding.all_or_none(lambda: atomic_write_bytes(token, secrets.token_hex(16).encode())
                         if sharding.is_main_process() else None)
    try:
        seen = token.read_text()
    except OSError:
        seen = ""
    settings = {k: v for cfg in (s.model_cfg, s.compute_cfg, s.train_cfg)
                for k, v in dataclasses.asdict(cfg).items() if k not in PER_PROCESS}
    data = {k: s.meta.get(k) for k in ("tokenizer", "dtype", "splits", "shards")}
    data["sources"] = [src.get("sha256") for src in s.meta.get("sources", [])]
    step = max(ckpt.list_steps(out), default=0) if s.train_cfg.init_from == "resume" else 0
    # what each host's --dtype=auto / --attention=auto became (its own CPU flags, its own backend)
    rt = dataclasses.asdict(dataclasses.replace(resolve(s.model_cfg, s.compute_cfg), mesh=None))
    parts = {"settings": json.dumps(settings, sort_keys=True, default=str),
             "compute as resolved (pass --dtype and --attention explicitly)": json.dumps(rt, sort_keys=True,
                                                                                       default=str),
             "data (by content)": json.dumps(data, sort_keys=True), "resume step": str(step), "out_dir": seen}
    try:
        sharding.check_agreement(parts, hint=f"run the same command on every host with one shared --out_dir "
                                             f"(process 0 wrote {TOKEN} in {out}, which the others must see)")
    finally:
        multihost_utils.sync_global_devices("gpt_train_token_read")
        if sharding.is_main_process():
            token.unlink(missing_ok=True)


def init_state(s: Setup, model_shape: GPT, tx, mesh) -> tuple[State, dict[str, Any]]:
    """Parameters (fresh, or --init_from's; a LoRA run: fresh adapters beside the frozen base)
    and optimizer state, created sharded on the mesh."""
    m, t = s.model_cfg, s.train_cfg
    trainable, frozen = lora_lib.split_state(model_shape, s.lora)
    p_shard, f_shard = (sharding.param_shardings(x, mesh) for x in (trainable, frozen))
    if s.lora is not None:
        params = jax.device_put(lora_lib.init_adapters(m, s.lora, t.seed), p_shard)
        frozen_params = jax.device_put(s.init_params, f_shard)
    else:
        init_fn = jax.jit(lambda: nnx.to_pure_dict(nnx.state(GPT(m, rngs=nnx.Rngs(t.seed),
                                                                 runtime=model_shape.rt))),
                          out_shardings=p_shard)
        params = init_fn() if s.init_params is None else jax.device_put(s.init_params, p_shard)
        frozen_params = {}
    o_shard = sharding.like_params(jax.eval_shape(tx.init, params), p_shard, mesh)
    opt_state = jax.jit(tx.init, out_shardings=o_shard)(params)
    return State(params, opt_state, frozen=frozen_params), {"params": p_shard, "opt_state": o_shard,
                                                            "frozen": f_shard}


def restore_state(checkpointer: ckpt.Checkpointer, state: State, shards: dict[str, Any]) -> State:
    """The newest complete checkpoint, restored onto the current mesh (a LoRA run's base stays)."""
    abstract = lambda tree, sh: jax.tree.map(  # noqa: E731
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), jax.eval_shape(lambda: tree), sh)
    step, params, opt_state, meta = checkpointer.restore(abstract(state.params, shards["params"]),
                                                         abstract(state.opt_state, shards["opt_state"]))
    best = meta.get("best_val_loss")
    if best is not None and not finite_number(best):
        raise UserError(f"the checkpoint of step {step} records best_val_loss={best!r}, not a finite "
                        f"number; its metadata was edited or is damaged")
    return State(params, opt_state, step, best, state.frozen)


def build_run(s: Setup, mesh, out: Path, log: Callable[[str], None]) -> tuple[Run, State]:
    """Model, state (fresh or resumed), compiled steps, data and outputs: all before step one."""
    m, t = s.model_cfg, s.train_cfg
    rt: Runtime = on_mesh(resolve(m, s.compute_cfg), mesh)
    model_shape = abstract_model(m, t.seed, rt, s.lora)
    graphdef = nnx.graphdef(model_shape)
    tx = make_optimizer(t)
    state, shards = init_state(s, model_shape, tx, mesh)
    checkpointer = ckpt.Checkpointer(out, keep=t.keep_checkpoints)
    if t.init_from == "resume":
        state = restore_state(checkpointer, state, shards)
        log(f"resuming from step {state.step} in {out}")
    log(start_line(s, state, rt, mesh))
    for warning in schedule_warnings(t):
        log(f"warning: {warning}")
    if (whole := sharding.fsdp_left_whole(nnx.state(model_shape), mesh)) is not None:
        log(whole)
    copy_tokenizer_files(s, out)
    shards["batch"] = sharding.batch_sharding(mesh, ndim=3)
    shards["eval"] = sharding.batch_sharding(mesh, ndim=2)
    train_mode = rt.dropout > 0 or (s.lora is not None and s.lora.dropout > 0)
    step_fn = jax.jit(make_train_step(graphdef, tx, t.seed, train_mode, lr_schedule(t), moe_training(t)),
                      in_shardings=(shards["params"], shards["opt_state"], None, shards["batch"],
                                    shards["batch"], shards["frozen"]),
                      out_shardings=(shards["params"], shards["opt_state"], None, None),
                      donate_argnums=(0, 1), compiler_options=compiler_options(rt))
    # evaluation keeps XLA's defaults (command buffers too): it is not what is timed
    eval_fn = jax.jit(make_eval_step(graphdef), in_shardings=(shards["params"], shards["eval"],
                                                               shards["eval"], shards["frozen"]))
    layout = sharding.batch_process_layout(mesh)  # this process's block of the batch rows
    batches = batches_lib.Batches(s.data_dir, "train", m.block_size,
                                  t.batch_size * t.gradient_accumulation_steps, seed=t.seed,
                                  process_index=layout[0], process_count=layout[1],
                                  align_documents=t.align_documents, meta=s.meta,
                                  groups=t.gradient_accumulation_steps)
    batches.restore({"seed": t.seed, "index": state.step})
    if t.align_documents:
        log_packing_waste(batches)
    flops = flops_per_token(m, m.block_size) if s.lora is None else \
        lora_lib.flops_per_token(m, lora_lib.count(state.params), m.block_size)
    through = metrics_lib.Throughput(flops,
                                     metrics_lib.measure_matmul_tflops(rt.dtype),
                                     metrics_lib.vendor_peak_tflops(rt.dtype.name), mesh.size)
    mlog = metrics_lib.MetricsLog(out, resume_step=state.step if t.init_from == "resume" else None,
                                  enabled=sharding.is_main_process())
    distributed.before_stopping(mlog.flush)  # another process's failure stops this one
    return Run(s, mesh, step_fn, eval_fn, shards, batches, layout, checkpointer, mlog,
               through), state


def moe_training(t: TrainConfig) -> moe_lib.MoETraining:
    return moe_lib.MoETraining(t.expert_capacity_factor, t.moe_aux_loss_coef, t.moe_z_loss_coef)


def start_line(s: Setup, state: State, rt: Runtime, mesh) -> str:
    """Model size (a mixture of experts: also the parameters active per token; a LoRA run: its
    trainable part), state memory, compute dtype (and what differs from the defaults elsewhere)."""
    m = s.model_cfg
    chunks = loss_chunks_for(rt.loss_chunks, s.train_cfg.batch_size, m.block_size, m.padded_vocab_size)
    total_b, per_dev_b = sharding.state_bytes((state.params, state.opt_state, state.frozen))
    lora = f" ({lora_lib.describe(s.lora, lora_lib.count(state.params))})" if s.lora else ""
    moe = (f" ({num_params(m, active=True) / 1e6:.2f}M active per token: {m.n_expert_per_token} of "
           f"{m.n_expert} experts in {len(m.moe_layers)} of {m.n_layer} layers)") if m.n_expert else ""
    return (f"{num_params(m) / 1e6:.2f}M params{moe}{lora}; params+optimizer {total_b / 1e9:.3f} GB "
            f"in all, {per_dev_b / 1e9:.3f} GB per device on {mesh.size} (mesh {dict(mesh.shape)}); "
            f"compute {rt.dtype.name}{dtype_note(rt.dtype)}"
            + ("" if rt.residual == jnp.float32 else f", residual stream {rt.residual.name}")
            + ("" if chunks <= 1 else f", loss in {chunks} slices of T"))


def log_packing_waste(batches: batches_lib.Batches) -> None:
    """--align_documents: how much text packing cuts off (most, when documents dwarf a row)."""
    waste = batches.waste()
    warn = waste > 0.5
    sharding.log(f"{'warning: ' if warn else ''}align_documents: every row starts at a document start; "
                 f"{100 * waste:.1f}% of the tokens drawn are cut off at row ends (measured over 8 batches)"
                 + ("; documents are much longer than a row here, so most text is never seen: drop "
                    "--align_documents" if warn else ""))


def copy_tokenizer_files(s: Setup, out: Path) -> None:
    """The tokenizer's files next to the checkpoints, so sampling needs nothing else."""
    if sharding.is_main_process():
        folder = store.files_dir(s.data_dir, s.meta)
        for name in load_tokenizer(s.meta["tokenizer"], folder).files():
            (out / name).write_bytes((folder / name).read_bytes())


def next_batch(run: Run) -> tuple[jax.Array, jax.Array]:
    """The next [A, B, T] inputs and targets, placed on the mesh (this process's rows)."""
    t = run.s.train_cfg
    A, B, T = t.gradient_accumulation_steps, t.batch_size, run.s.model_cfg.block_size
    x, y = run.batches.next()
    rows = x.shape[0] // A
    return tuple(sharding.global_batch(a.reshape(A, rows, T), run.shardings["batch"], (A, B, T))
                 for a in (x, y))


def run_eval(run: Run, state: State, at_step: int) -> dict[str, float | None]:
    t, m = run.s.train_cfg, run.s.model_cfg
    shape = (t.batch_size, m.block_size)
    place = lambda a: sharding.global_batch(a, run.shardings["eval"], shape)
    eval_fn = lambda params, x_BT, y_BT: run.eval_fn(params, x_BT, y_BT, state.frozen)  # noqa: E731
    return evaluate(eval_fn, state.params, run.s.data_dir, run.s.meta, shape, at_step, t,
                    run.layout, place)


def save(run: Run, state: State, val_loss: float | None) -> None:
    s = run.s
    meta = {"format_version": ckpt.FORMAT_VERSION, "step": state.step,
            "config": {"model": to_dict(s.model_cfg), "compute": to_dict(s.compute_cfg),
                       "train": to_dict(s.train_cfg)},
            "tokenizer": s.meta["tokenizer"], "data_dir": str(s.data_dir.absolute()),
            "val_loss": val_loss, "best_val_loss": state.best_val}
    if s.lora is not None:  # the adapters are the params; the base is referenced, not copied
        meta["lora"] = lora_lib.meta_block(s.lora, s.base_ref)
    run.checkpointer.save(state.step, state.params, state.opt_state, meta, val_loss)


def diverged(run: Run) -> str:
    """The end of a divergence message: what is kept, and what to try (clipping only where the
    run does not already clip the gradient's norm at 1 or less)."""
    kept = "; the checkpoints saved before are kept" if ckpt.list_steps(run.checkpointer.dir.parent) else ""
    clip = "" if 0 < run.s.train_cfg.grad_clip <= 1 else " or --grad_clip=1.0"
    return f"stopped without saving it{kept}; try a lower --learning_rate{clip}"


def host_metrics(run: Run, metrics: dict, step: int) -> dict[str, float]:
    """The step's metrics on the host (the only device->host sync); a non-finite loss stops."""
    host = metrics_lib.to_host(metrics)
    if not math.isfinite(host["loss"]):
        raise UserError(f"the loss became {host['loss']} at step {step}; {diverged(run)}")
    return host


@jax.jit
def _norm_finite(tree: Any) -> jax.Array:
    return jnp.isfinite(optax.global_norm(tree))


def check_savable(run: Run, state: State) -> None:
    """Only weights of a finite float32 norm are saved (no NaN, no inf, none beyond about 1e19).
    The step's loss is of the weights before its update, so an update that blows them up shows
    only in the next step's loss, after a save at this one would have replaced the last good
    checkpoint. Checked at saves only: one reduction over the weights."""
    if not bool(_norm_finite(state.params)):
        raise UserError(f"the weights diverged (their norm is no longer finite) at step {state.step}; "
                        f"{diverged(run)}")


class Progress:
    """tqdm on process 0 (or plain log lines), and tokens/s between log points."""

    def __init__(self, t: TrainConfig, start: int, log: Callable[[str], None]):
        self.log, self.bar = log, None
        if sharding.is_main_process() and t.progress:
            from tqdm import tqdm
            self.bar = tqdm(total=t.max_iters, initial=start, dynamic_ncols=True, file=sys.stderr,
                            mininterval=1.0, disable=None)
        self.t0 = self.t_mark = time.perf_counter()
        self.tokens = 0

    def compiled(self) -> None:
        """The first step has compiled and run: throughput is timed from here, without that
        step's tokens (as nanoGPT leaves its first steps out of MFU)."""
        self.t_mark, self.tokens = time.perf_counter(), 0

    def rate(self, through: metrics_lib.Throughput) -> dict[str, float | None]:
        """Throughput since the last call; all None for an interval of no timed step (a log at
        the first step)."""
        now = time.perf_counter()
        rate = through(self.tokens, now - self.t_mark)
        if not self.tokens:
            rate = dict.fromkeys(rate)
        self.t_mark, self.tokens = now, 0
        return rate

    def show(self, host: dict, rate: dict, step: int) -> None:
        """The log step's figures on the bar, or as a line where there is none (--no_progress,
        or stderr not a terminal), as nanoGPT prints them."""
        mfu = f"{100 * rate['mfu']:.1f}%" if rate["mfu"] is not None else "-"
        tps = f"{rate['tokens_per_sec']:,.0f}" if rate["tokens_per_sec"] is not None else "-"
        if self.bar is not None and not self.bar.disable:
            self.bar.set_postfix_str(f"loss {host['loss']:.4f} lr {host['lr']:.2e} tok/s {tps} mfu {mfu}",
                                     refresh=False)
        else:
            self.log(f"step {step}: loss {host['loss']:.4f}, lr {host['lr']:.2e}, {tps} tok/s, mfu {mfu}")

    def write(self, msg: str) -> None:
        self.bar.write(msg, file=sys.stderr) if self.bar is not None else self.log(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def moe_record(host: dict, m: ModelConfig) -> dict[str, Any]:
    """A MoE model's routing figures for metrics.jsonl: the auxiliary losses, the share of token
    choices dropped by capacity, and each MoE layer's expert load ({"layer1": [share per expert]};
    layers counted from 0, so "layer1" is the second block)."""
    if "moe_load" not in host:
        return {}
    record = {k: host[k] for k in ("moe_aux_loss", "moe_z_loss", "moe_dropped_fraction")}
    record["moe_load"] = {f"layer{i}": load for i, load in zip(m.moe_layers, host["moe_load"])}
    return record


def log_and_evaluate(run: Run, state: State, metrics: dict, prog: Progress, at_log: bool,
                     at_eval: bool) -> tuple[float, dict | None]:
    """Write the train record (at a log step) and run an evaluation (at an eval step)."""
    host = host_metrics(run, metrics, state.step)
    rate = prog.rate(run.through)
    elapsed = time.perf_counter() - prog.t0
    if at_log:
        run.mlog.write({"kind": "train", "step": state.step, "loss": host["loss"], "lr": host["lr"],
                        "grad_norm": host["grad_norm"], **moe_record(host, run.s.model_cfg), **rate,
                        "elapsed_sec": elapsed})
        prog.show(host, rate, state.step)
    if not at_eval:
        return host["loss"], None
    ev = run_eval(run, state, state.step)
    if not math.isfinite(ev["val_loss"]):
        raise UserError(f"the val loss became {ev['val_loss']} at step {state.step}; {diverged(run)}")
    state.best_val = ev["val_loss"] if state.best_val is None else min(state.best_val, ev["val_loss"])
    run.mlog.write({"kind": "eval", "step": state.step, **ev, "lr": host["lr"],
                    "tokens_per_sec": rate["tokens_per_sec"], "mfu": rate["mfu"],
                    "mfu_vendor": rate["mfu_vendor"], "elapsed_sec": elapsed})
    run.mlog.plot()
    prog.write(f"step {state.step}: train loss {ev['train_loss']:.4f}, val loss {ev['val_loss']:.4f}"
               + (f", val bpb {ev['val_bpb']:.3f}" if ev["val_bpb"] else ""))
    prog.t_mark = time.perf_counter()  # do not charge evaluation to throughput
    return host["loss"], ev


def train(s: Setup, log: Callable[[str], None] = sharding.log) -> dict[str, Any]:
    """Run training in out_dir; --overwrite's old checkpoints are dropped only if this run saved."""
    t = s.train_cfg
    new_dir = not Path(t.out_dir).exists()
    out, aside, ours = Path(t.out_dir), None, True
    try:
        mesh = sharding.make_mesh(t.mesh)  # the mesh is validated before anything touches out_dir
        sharding.check_divisibility(s.model_cfg, mesh, t.batch_size, resuming=t.init_from == "resume")
        check_host_batch(t, s.model_cfg.block_size)
        out, aside = prepare_out_dir(s)
        return _run(s, mesh, out, log, aside)
    except ckpt.OutDirInUse:  # another run's folder (its new one, maybe still empty): left alone
        ours = False
        raise
    finally:  # the old checkpoints go once this run has one: else they come back
        if sharding.is_main_process():
            if ours:
                _clean_up(out, aside, new_dir)
            ckpt.release_out_dir(t.out_dir)  # prepare_setup's lock, also after a refusal above


def check_host_batch(t: TrainConfig, block_size: int) -> None:
    """A step's batch is built on the host (int32 rows of block_size + 1 tokens, this process's
    share): one larger than the memory available would have the kernel kill the run (Linux's
    MemAvailable; elsewhere not checked)."""
    rows = t.batch_size * t.gradient_accumulation_steps // jax.process_count()
    need = rows * (block_size + 1) * 4 * 2  # the windows, then x and y
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            free = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
    except (OSError, ValueError, StopIteration, IndexError):
        return
    if need > free:
        raise UserError(f"a step's batch ({rows:,} rows of {block_size + 1} tokens: --batch_size={t.batch_size} x "
                        f"--gradient_accumulation_steps={t.gradient_accumulation_steps}) needs {need / 1e9:.1f} GB "
                        f"of host memory, with {free / 1e9:.1f} GB available; lower them")


def _clean_up(out: Path, aside: Path | None, new_dir: bool) -> None:
    """Settle --overwrite's old checkpoints; remove an out_dir this run created and left empty.
    A failure here is a warning: it must not hide the run's own outcome."""
    try:
        ckpt.settle_aside(out, aside)
        if new_dir and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
    except OSError as e:
        print(f"warning: could not tidy {out} ({e}); the previous checkpoints, if any, are in "
              f"{out / ckpt.ASIDE}", file=sys.stderr)


def _run(s: Setup, mesh, out: Path, log: Callable[[str], None], aside: Path | None) -> dict[str, Any]:
    """The loop: step, then log / evaluate / save where due; a signal saves and stops."""
    t = s.train_cfg
    run, state = build_run(s, mesh, out, log)
    tokens_per_step = t.gradient_accumulation_steps * t.batch_size * s.model_cfg.block_size
    ckpt_interval = t.ckpt_interval or t.eval_interval
    state_b = sharding.state_bytes((state.params, state.opt_state, state.frozen))[0]
    summary: dict[str, Any] = {"start_step": state.step, "train_losses": [], "state_bytes": state_b,
                               "trainable_params": lora_lib.count(state.params)}
    if state.step >= t.max_iters:
        log(f"the run in {out} is already at step {state.step} (--max_iters={t.max_iters}): nothing to train; "
            f"pass a larger --max_iters to go on")
    stop, prog = StopFlag(), Progress(t, state.step, log)
    x, y = next_batch(run)
    try:
        while state.step < t.max_iters:
            state.params, state.opt_state, _, metrics = run.step_fn(
                state.params, state.opt_state, state.step, x, y, state.frozen)
            state.step += 1
            prog.tokens += tokens_per_step
            if state.step == summary["start_step"] + 1:  # compiled, and (once) waited for
                jax.block_until_ready(metrics)
                prog.compiled()
            last = state.step == t.max_iters
            if not last:
                x, y = next_batch(run)  # prefetch while the step runs (GPU/TPU; on CPU it has run)
            at_log = state.step % t.log_interval == 0 or last
            at_eval = state.step % t.eval_interval == 0 or last
            stopping = stop.agreed()  # read once: a later signal stops a step later
            at_ckpt = state.step % ckpt_interval == 0 or last or stopping
            if at_log or at_eval or at_ckpt:
                loss, ev = log_and_evaluate(run, state, metrics, prog, at_log, at_eval)
                summary["train_losses"].append((state.step, loss))
                if ev:
                    summary.update(ev, val_step=state.step)
                if at_ckpt:
                    check_savable(run, state)
                    save(run, state, ev["val_loss"] if ev else None)
                    aside = ckpt.drop_aside_once_saved(out, aside)  # the space comes back early
                    prog.t_mark = time.perf_counter()  # nor saving (the rate just reset the tokens)
            if prog.bar is not None:
                prog.bar.update(1)
            if stopping:
                run.checkpointer.wait()  # "saved" only once it is on disk
                log(f"\nreceived {signal.Signals(stop.signal).name}: saved step {state.step}; "
                    f"continue with --init_from=resume")
                break
    finally:
        prog.close()
        try:
            run.checkpointer.close()  # still under our handlers: a signal here cannot cut the save
            run.mlog.close()
        finally:
            stop.restore()
    summary.update(step=state.step, best_val_loss=state.best_val, interrupted=stop.signal is not None,
                   elapsed_sec=time.perf_counter() - prog.t0)
    return summary
