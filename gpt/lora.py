"""LoRA fine-tuning (Hu et al., 2021): low-rank adapters on the block matrices of a frozen model.

A targeted weight W (contracted axes first, as every block weight is: w_qkv [D, 3, H, K], w_o
[H, K, D], ...) gets A [in..., r] and B [r, out...], and the layer computes

    x W + (alpha / r) (x A) B        (B starts at zero: a fresh LoRA model is its base)

Fused projections (w_qkv, w_kv and SwiGLU's w_fc hold q|k|v, k|v and gate|up on a slot axis) get
one adapter per slot, A [D, slots, r] and B [slots, r, out...], so rank r means what it means in
the LoRA paper and in PEFT: a rank-r update of each of q_proj, k_proj, v_proj, gate_proj, up_proj.

What comes from Flax NNX: the adapters are `nnx.LoRAParam` variables (a `Param` subclass) created
inside `Block`, so `nnx.state(model, nnx.LoRAParam)` is the trainable state and the optimizer is
built over it alone (the base holds no optimizer state, gets no gradient and no weight decay); A
is initialised with `nnx.LoRA`'s default (He uniform), B with zeros. `nnx.LoRA` itself is not used:
it is a 2-D `x @ a @ b` layer, while our weights are stacked on a layer axis, have several
contracted/output axes with their sharding names, and must go through `gpt.ops.dense` (bf16
matmuls with float32 accumulation and the hand-written backward), with alpha / r scaling and
per-slot adapters for fused projections; the few lines below do that.

A LoRA run's checkpoints hold the adapters (as `params`) and their optimizer state; `meta["lora"]`
holds the settings and a reference to the base: its path, step and the sha256 of its parameters.
Loading (sampling, export, `--merge_lora`) reads the base, checks the hash and merges
W + (alpha / r) A B once, in float32.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gpt.config import LORA_GROUPS, ModelConfig, TrainConfig, model_from_dict
from gpt.errors import UserError
from gpt.ops.dropout import dropout

TRAINABLE = nnx.LoRAParam
FROZEN = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
WEIGHTS = ("w_qkv", "w_q", "w_kv", "w_o", "w_fc", "w_proj")  # the block matrices, in this order
RANK = "r"  # the rank axis's letter in the adapters' einsum specs (no block weight uses it)


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """The adapters of a run: rank, alpha, the block weights they adapt, dropout on their input."""
    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank  # the LoRA paper's scaling: tuning alpha ~ tuning the lr

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets),
                "dropout": self.dropout}


def adapter_names(weight: str) -> tuple[str, str]:
    return f"lora_a_{weight}", f"lora_b_{weight}"


def layout(weight: str, ndim: int) -> tuple[int, bool]:
    """(number of contracted leading axes, whether a slot axis of fused projections follows) of a
    block weight of `ndim` axes (without the layer axis)."""
    fused = weight in ("w_qkv", "w_kv") or (weight == "w_fc" and ndim == 3)
    return (2 if weight == "w_o" else 1), fused


def matrix_shape(weight: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """(in, out) of the matrix one adapter adapts (one slot of a fused projection)."""
    nc, fused = layout(weight, len(shape))
    return math.prod(shape[:nc]), math.prod(shape[nc + fused:])


# ----------------------------------------------------------------------------- the model's side


def add_adapters(block: nnx.Module, lora: LoRAConfig, rngs: nnx.Rngs) -> None:
    """Give `block` (being built, one layer) an A and a B per targeted weight, sharded like it:
    A keeps the weight's input axes' names, B its output axes' names."""
    for weight in lora.targets:
        w = getattr(block, weight)
        nc, fused = layout(weight, w.ndim)
        axes = tuple(w.get_metadata()["out_sharding"])
        slots = w.shape[nc:nc + 1] if fused else ()
        a = init_a(rngs.params(), (*w.shape[:nc], *slots, lora.rank), nc, fused)
        b = jnp.zeros((*slots, lora.rank, *w.shape[nc + fused:]), jnp.float32)
        name_a, name_b = adapter_names(weight)
        setattr(block, name_a, nnx.LoRAParam(a, sharding_names=axes[:nc] + (None,) * (1 + fused),
                                             eager_sharding=False))
        setattr(block, name_b, nnx.LoRAParam(b, sharding_names=(None,) * (1 + fused) + axes[nc + fused:],
                                             eager_sharding=False))


def init_a(key: jax.Array, shape: tuple[int, ...], nc: int, fused: bool) -> jax.Array:
    """A's initial values: He uniform over its `nc` input axes (nnx.LoRA's default), each slot
    of a fused projection drawn as a matrix of its own."""
    init = jax.nn.initializers.he_uniform(in_axis=tuple(range(nc)), out_axis=-1,
                                          batch_axis=(nc,) if fused else ())
    return init(key, shape, jnp.float32)


def init_adapters(cfg: ModelConfig, lora: LoRAConfig, seed: int) -> dict[str, Any]:
    """Fresh stacked adapters as host arrays, drawn as `init_a` draws them (A He uniform, B zero)
    but with numpy: compiling random initialisers costs seconds on a CPU, drawing them here
    nothing (and every process draws the same values)."""
    shapes = abstract_adapters(cfg, lora)["blocks"]
    blocks = {}
    for i, weight in enumerate(lora.targets):
        name_a, name_b = adapter_names(weight)
        a_shape = shapes[name_a].shape
        bound = math.sqrt(6.0 / math.prod(a_shape[1:1 + layout(weight, 0)[0]]))  # fan in
        rng = np.random.default_rng([seed, i])
        blocks[name_a] = rng.uniform(-bound, bound, a_shape).astype(np.float32)
        blocks[name_b] = np.zeros(shapes[name_b].shape, np.float32)
    return {"blocks": blocks}


def update(x: jax.Array, a: jax.Array, b: jax.Array, spec: str, lora: LoRAConfig, mm,
           key: jax.Array | None) -> jax.Array:
    """(alpha / r) (dropout(x) A) B for the weight multiplied by `spec` ("btd,dchk->btchk"), with
    the same dense op `mm` as the weight (compute dtype, float32 accumulation, custom backward)."""
    xs, ws, out = spec.replace(" ", "").replace("->", ",").split(",")
    assert RANK not in spec, spec
    contract = "".join(c for c in ws if c in xs)
    x_free = xs[:len(xs) - len(contract)]
    fused = a.ndim == len(contract) + 2
    if key is not None and lora.dropout > 0:
        x = dropout(x, lora.dropout, key)
    slot = ws[len(contract)] if fused else ""
    free = ws[len(contract) + len(slot):]
    h = mm(x, a, f"{xs},{contract}{slot}{RANK}->{x_free}{slot}{RANK}") * lora.scale
    if not fused:
        return mm(h, b, f"{x_free}{RANK},{RANK}{free}->{out}")
    # Each slot's own B (a batched einsum would leave dense's fast path): q, k, v stacked back.
    i = len(x_free)
    parts = [mm(jnp.take(h, s, axis=i), b[s], f"{x_free}{RANK},{RANK}{free}->{x_free}{free}")
             for s in range(b.shape[0])]
    return jnp.stack(parts, axis=i)


def split_state(model: nnx.Module, lora: LoRAConfig | None) -> tuple[nnx.State, nnx.State]:
    """(trainable, frozen) states: the adapters and the base for a LoRA model; everything and
    nothing for a plain one."""
    if lora is None:
        return nnx.state(model), nnx.State({})
    return nnx.state(model, TRAINABLE, FROZEN)


def abstract_adapters(cfg: ModelConfig, lora: LoRAConfig) -> Any:
    """Shapes/dtypes of the adapters (no memory) on one device: what a LoRA checkpoint holds."""
    from gpt.model import abstract_model
    shapes = nnx.to_pure_dict(split_state(abstract_model(cfg, lora=lora), lora)[0])
    sd = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sd), shapes)


def merge(base: dict[str, Any], adapters: dict[str, Any], lora: LoRAConfig) -> dict[str, Any]:
    """The base's parameters with W + (alpha / r) A B in every targeted weight (float32, full
    precision matmuls: TPUs and GPUs would otherwise round float32 products to bf16/tf32)."""
    blocks = dict(base["blocks"])
    for weight in lora.targets:
        w = jnp.asarray(blocks[weight], jnp.float32)
        a, b = (jnp.asarray(adapters["blocks"][n], jnp.float32) for n in adapter_names(weight))
        L, r = a.shape[0], lora.rank
        _, fused = layout(weight, w.ndim - 1)
        if fused:
            slots = b.shape[1]
            d = jnp.einsum("lmsr,lsrn->lmsn", a.reshape(L, -1, slots, r), b.reshape(L, slots, r, -1),
                           precision=jax.lax.Precision.HIGHEST)
        else:
            d = jnp.einsum("lmr,lrn->lmn", a.reshape(L, -1, r), b.reshape(L, r, -1),
                           precision=jax.lax.Precision.HIGHEST)
        blocks[weight] = w + lora.scale * d.reshape(w.shape)
    return {**base, "blocks": blocks}


def count(tree: Any) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))


def flops_per_token(cfg: ModelConfig, n_adapter: int, seq_len: int) -> float:
    """Training FLOPs per token of a LoRA step: the frozen weights skip their gradient matmul
    (2N of the usual 6N), the adapters (n_adapter parameters) pay the full 6 per parameter."""
    from gpt.model import flops_per_token as full, num_params
    n = num_params(cfg, include_position=False) - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.n_embd)
    return full(cfg, seq_len) - 2 * n + 6 * n_adapter


# ----------------------------------------------------------------------------- settings


def resolve(t: TrainConfig, m: ModelConfig) -> LoRAConfig | None:
    """The run's LoRAConfig for base model `m` (None without --lora_rank): `attn`/`mlp` expanded to
    the weights this architecture has, and every adapted matrix at least as large as the rank."""
    if not t.lora_rank:
        return None
    if m.n_expert:
        raise UserError(f"--lora_rank: LoRA fine-tuning of a mixture-of-experts model (n_expert={m.n_expert}) "
                        f"is not supported; fine-tune all its weights (leave out --lora_rank)")
    shapes = _block_shapes(m)
    wanted: set[str] = set()
    for name in t.lora_targets:
        if name in LORA_GROUPS:
            wanted.update(w for w in LORA_GROUPS[name] if w in shapes)
        elif name not in shapes:
            raise UserError(f"--lora_targets: this model has no {name} (its block matrices: "
                            f"{', '.join(w for w in WEIGHTS if w in shapes)}; or use attn, mlp)")
        else:
            wanted.add(name)
    targets = tuple(w for w in WEIGHTS if w in wanted)
    for w in targets:
        n_in, n_out = matrix_shape(w, shapes[w])
        if t.lora_rank > min(n_in, n_out):
            raise UserError(f"--lora_rank={t.lora_rank} is larger than the matrix it adapts ({w}: "
                            f"{n_in} x {n_out}); use at most {min(n_in, n_out)}")
    return LoRAConfig(t.lora_rank, t.lora_alpha, targets, t.lora_dropout)


def _block_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each block matrix of model `m` (without the layer axis), by name."""
    from gpt.model import abstract_model
    return {k: v.shape[1:] for k, v in nnx.to_pure_dict(nnx.state(abstract_model(m).blocks)).items()
            if k in WEIGHTS}


def from_meta(block: dict[str, Any], where: str | Path, m: ModelConfig) -> LoRAConfig:
    """The LoRAConfig recorded in a checkpoint's meta["lora"], checked as `resolve` checks flags
    (the file may be damaged or edited: repeated targets would add an update twice, a NaN alpha
    would poison every merged weight), and against the model `m` it adapts."""
    try:
        cfg = LoRAConfig(int(block["rank"]), float(block["alpha"]), tuple(block["targets"]),
                         float(block.get("dropout", 0.0)))
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"the LoRA settings recorded in {where} are incomplete ({e}); the checkpoint's "
                        f"metadata is damaged") from None
    shapes = _block_shapes(m)
    ok = (type(block["rank"]) is int and cfg.rank >= 1 and math.isfinite(cfg.alpha) and cfg.alpha > 0
          and 0.0 <= cfg.dropout < 1.0 and isinstance(block.get("base"), dict)
          and cfg.targets == tuple(w for w in WEIGHTS if w in set(cfg.targets)) and cfg.targets
          and all(w in shapes and cfg.rank <= min(matrix_shape(w, shapes[w])) for w in cfg.targets))
    if not ok:
        raise UserError(f"the LoRA settings recorded in {where} are not valid for its model; the checkpoint's "
                        f"metadata is damaged")
    return cfg


# ----------------------------------------------------------------------------- the base


@dataclasses.dataclass
class Base:
    """A frozen base model: its architecture, parameters (host or one device), the reference a
    LoRA checkpoint records, and its tokenizer spec (None for a Hugging Face directory)."""
    cfg: ModelConfig
    params: dict[str, Any]
    ref: dict[str, Any]
    tokenizer: dict[str, Any] | None


def params_sha256(params: Any) -> str:
    """sha256 of the parameters (paths, shapes and float32 bytes): the base's identity."""
    h = hashlib.sha256()
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, x in sorted(leaves, key=lambda kv: jax.tree_util.keystr(kv[0])):
        a = np.ascontiguousarray(np.asarray(x, np.float32))
        h.update(f"{jax.tree_util.keystr(path)}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def is_hf_dir(src: Path) -> bool:
    return (src / "config.json").is_file() and not (src / "checkpoints").exists()


def read_base(src: str | Path, step: int | None = None) -> Base:
    """A base to fine-tune: a Hugging Face directory or a training output (its newest step, or
    `step`). A LoRA run is not a base: merge it first (`python -m gpt.convert --merge_lora`)."""
    from gpt import checkpoint as ckpt
    src = Path(src).absolute()
    if is_hf_dir(src):
        from gpt.convert import hf_dir_tokenizer, load_hf
        cfg, params = load_hf(src)
        tokenizer = hf_dir_tokenizer(src, cfg)  # what the data must be tokenized with (check_tokenizer)
        return Base(cfg, params, {"kind": "hf", "path": str(src), "step": None,
                                  "sha256": params_sha256(params)}, tokenizer and tokenizer[0])
    _, meta = ckpt.read_meta(src, step)
    if "lora" in meta:
        raise UserError(f"{src} is a LoRA run; fine-tune its merged weights: python -m gpt.convert "
                        f"--merge_lora --out_dir={src} --merged_dir=NEW_DIR, then --init_from=NEW_DIR")
    step, cfg, params, meta = restore_params(src, step)  # None: the newest step that restores
    return Base(cfg, params, {"kind": "checkpoint", "path": str(src), "step": step,
                              "sha256": params_sha256(params)}, meta.get("tokenizer"))


def base_of(ref: Any, where: str | Path) -> tuple[Path, int | None, str]:
    """(path, step, its name in messages) of the base a LoRA run in `where` recorded, checked from
    metadata alone (the reference readable, the base still there): a caller that reads its input
    first (gpt.evaluate, sample.py) tells a base that is gone before that work."""
    from gpt import checkpoint as ckpt
    if not isinstance(ref, dict) or not all(isinstance(ref.get(k), str) for k in ("path", "sha256", "kind")):
        raise UserError(f"the base model reference recorded in {where} is damaged; the LoRA run cannot "
                        f"be loaded")
    path, step = Path(ref["path"]), ref.get("step")
    if ref["kind"] == "checkpoint" and type(step) is not int:
        raise UserError(f"the base recorded in {where} has step {step!r}, not a step number; the checkpoint's "
                        f"metadata is damaged")
    which = f"{path} (step {step})" if ref["kind"] == "checkpoint" else str(path)
    gone = not is_hf_dir(path) if ref["kind"] == "hf" else step not in ckpt.list_steps(path)
    if gone:
        raise UserError(f"the base model of the LoRA run in {where}, {which}, is gone; put it back "
                        f"there (a LoRA checkpoint holds only the adapters)")
    return path, step, which


def load_base(ref: Any, where: str | Path) -> Base:
    """The base a LoRA run in `where` recorded, checked to be the very weights it was trained on."""
    path, step, which = base_of(ref, where)
    base = read_base(path, step if ref["kind"] == "checkpoint" else None)
    if base.ref["sha256"] != ref["sha256"]:
        raise UserError(f"the base model of the LoRA run in {where}, {which}, has changed since the "
                        f"adapters were trained (sha256 of its weights differs); put the original "
                        f"back there")
    return base


def check_tokenizer(base: Base, data_spec: dict[str, Any], src: str) -> None:
    """The data must be tokenized as the base was (else every id means another token)."""
    from gpt.tokenizer import check_data_tokenizer, tokenizer_hint
    check_data_tokenizer(base.tokenizer, data_spec, f"the base model {src}",
                         f"prepare the data with {tokenizer_hint(base.tokenizer, src)}")


# ----------------------------------------------------------------------------- loading and merging


def restore_params(out_dir: str | Path, step: int | None = None
                   ) -> tuple[int, ModelConfig, dict[str, Any], dict[str, Any]]:
    """(step, architecture, parameters, meta) of a training output's newest complete step (falling
    back past damaged ones, as `Checkpointer.restore` does) or of `step`; a LoRA run's adapters come
    merged into its base, which must be unchanged."""
    from gpt import checkpoint as ckpt
    from gpt.model import abstract_params
    newest, meta = ckpt.read_meta(out_dir, step)  # the config, the same in every step
    try:
        cfg = model_from_dict(meta["config"]["model"])
    except (KeyError, TypeError) as e:
        raise UserError(f"the checkpoint in {out_dir} (step {newest}) has no model config ({e}); "
                        f"it is damaged") from None
    reader = ckpt.Checkpointer(out_dir, read_only=True)
    if not isinstance(meta.get("lora"), dict):
        s, params, _, meta = reader.restore(abstract_params(cfg), step=step)
        return s, cfg, params, meta
    lora = from_meta(meta["lora"], out_dir, cfg)
    base = load_base(meta["lora"]["base"], out_dir)
    s, adapters, _, meta = reader.restore(abstract_adapters(cfg, lora), step=step)
    return s, cfg, merge(base.params, adapters, lora), meta


def write_merged(out_dir: str | Path, merged_dir: str | Path) -> str:
    """`python -m gpt.convert --merge_lora`: a LoRA run's newest step, merged into its base, as a
    plain checkpoint of ours in `merged_dir` (new or empty; it appears complete or not at all)."""
    from gpt import checkpoint as ckpt
    from gpt.convert import recover_killed_write
    dest = Path(merged_dir).absolute()
    recover_killed_write(dest)  # the temporary copy of a merge killed part way (named as the export's)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UserError(f"--merged_dir {dest} exists and is not empty; choose a new or empty directory")
    _, meta = ckpt.read_meta(out_dir)
    if not isinstance(meta.get("lora"), dict):
        raise UserError(f"{out_dir} is not a LoRA run (its checkpoints hold all the weights already); "
                        f"nothing to merge")
    step, cfg, params, meta = restore_params(out_dir)
    files = _tokenizer_files(meta, out_dir)
    new_meta = {"format_version": ckpt.FORMAT_VERSION, "step": step,
                "config": {"model": meta["config"]["model"], "compute": meta["config"].get("compute", {}),
                           "train": {}},
                "tokenizer": meta.get("tokenizer"),
                "merged_from": {"path": str(Path(out_dir).absolute()), "step": step, "lora": meta["lora"]}}
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.{os.getpid()}.", suffix=".tmp", dir=dest.parent))
    try:
        c = ckpt.Checkpointer(tmp, keep=1, async_save=False)
        c.save(step, params, {"none": np.zeros((), np.int32)}, new_meta, val_loss=None)  # as --from_hf
        c.close()
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        if dest.exists():
            dest.rmdir()  # empty (checked above)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return f"merged step {step} of {out_dir} (LoRA rank {meta['lora']['rank']}) into {dest}"


def _tokenizer_files(meta: dict[str, Any], out_dir: str | Path) -> dict[str, bytes]:
    """The tokenizer's files beside the checkpoints (bpe ranks, tokenizer.json), checked."""
    if not isinstance(meta.get("tokenizer"), dict):
        return {}
    from gpt.tokenizer import load_tokenizer
    tok = load_tokenizer(meta["tokenizer"], out_dir)
    return {name: (Path(out_dir) / name).read_bytes() for name in tok.files()}


def describe(lora: LoRAConfig, n_adapter: int) -> str:
    return (f"LoRA rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.targets)}: "
            f"{n_adapter / 1e6:.3f}M trainable")


def meta_block(lora: LoRAConfig, ref: dict[str, Any]) -> dict[str, Any]:
    """What a LoRA checkpoint's meta records: the settings and the base's reference."""
    return {**lora.to_dict(), "base": dict(ref)}

