"""Typed configuration: model, training and sampling settings, presets, and nanoGPT-style overrides.

Settings are plain dataclasses. Command lines (`--n_layer=4`, `--dropout 0.0`, `--bias`), presets
(`--preset=gpt2`) and config files (`--config=run.toml` or `.json`) all land in the same fields, are
parsed by the field's declared type (never `eval`), and are validated once. Key names follow nanoGPT
so that a nanoGPT user's command line works unchanged.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import tomllib
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

from gpt.errors import UserError, finite_number

VOCAB_MULTIPLE = 128  # the embedding/LM head is padded to this multiple for fast matmuls


@dataclass(frozen=True)
class ModelConfig:
    """The architecture: what a checkpoint stores and must reproduce (every field shapes the
    parameters or the function they compute). How the model is run is `ComputeConfig`'s."""
    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_kv_head: int = 0  # key/value heads: grouped-query attention (1: multi-query); 0: n_head
    head_size: int = 0  # width of a head; 0: n_embd // n_head (Qwen3 sets it apart)
    ffn_dim: int = 0  # MLP width; 0: 4 * n_embd (gelu) or 8/3 * n_embd rounded up to 32 (swiglu)
    bias: bool = True  # biases in every linear layer and norm (GPT-2)
    qkv_bias: bool = False  # biases on the query/key/value projections only (Qwen2)
    pos_embedding: str = "learned"  # learned (GPT-2) | sinusoidal (Vaswani et al.) | rope | none
    rope_theta: float = 10000.0  # RoPE base
    # RoPE's frequencies stretched to a longer context than they were trained at (imported Llama
    # 3.1+ checkpoints): none | linear (every frequency / rope_factor) | llama3 (wavelengths over
    # rope_original_context / rope_low_freq_factor divided by rope_factor, those under
    # rope_original_context / rope_high_freq_factor kept, the ones between blended)
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    norm: str = "layernorm"  # layernorm | rmsnorm | dyt (dynamic tanh, no normalization)
    norm_eps: float = 1e-5
    mlp: str = "gelu"  # gelu | swiglu (gated, SiLU)
    activation: str = "gelu_tanh"  # gelu_tanh (GPT-2's "gelu_new") | gelu (exact, nanoGPT's nn.GELU)
    qk_norm: bool = False  # RMSNorm of queries and keys per head (Qwen3)
    tie_embeddings: bool = True  # the LM head is the token embedding
    # Mixture of experts (gpt/moe.py): the MLP of every moe_every-th block is a top-k router over
    # n_expert expert MLPs (GELU or SwiGLU, ffn wide each); 0 experts: a dense model
    n_expert: int = 0
    n_expert_per_token: int = 2  # k of the top-k routing
    moe_every: int = 1  # 1: every block; 2: blocks 2, 4, ... (1-based); must divide n_layer

    @property
    def padded_vocab_size(self) -> int:
        return math.ceil(self.vocab_size / VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    @property
    def head_dim(self) -> int:
        return self.head_size or self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The (0-based) layers whose MLP is a mixture of experts: the last of every moe_every."""
        if not self.n_expert:
            return ()
        return tuple(range(self.moe_every - 1, self.n_layer, self.moe_every))

    @property
    def ffn(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        return 4 * self.n_embd if self.mlp == "gelu" else 32 * math.ceil(8 * self.n_embd / 3 / 32)


@dataclass(frozen=True)
class ComputeConfig:
    """How the model is run on this machine: chosen per run, never stored as the architecture (a
    resumed or fine-tuned run takes them from its own command line)."""
    dropout: float = 0.0
    dtype: str = "auto"  # auto (bfloat16 on GPU/TPU and CPUs with AVX512_BF16/AMX, else float32) | float32 | bfloat16
    attention: str = "auto"  # auto | xla | cudnn | einsum (the plain reference implementation)
    remat: str = "none"  # none | block | dots: activation rematerialisation per block
    scan_layers: bool = False  # one compiled block applied with lax.scan (fast compile for deep models)
    # float32 | compute: the residual stream (and its gradient) in the compute dtype, as MaxText,
    # Levanter and llm.c keep it; fewer bytes per step on a GPU (BENCHMARKS.md)
    residual_dtype: str = "float32"
    # How many slices of T the loss forms the head's [B, T, V] logits in, each scored and
    # differentiated on its own, so neither they nor their gradient are ever whole in memory:
    # 0 = auto (on CPU, about 128 rows a slice once the vocabulary has 4,096 entries or more,
    # where it was faster; whole on GPU/TPU), 1 = whole, K = K slices
    loss_chunks: int = 0


@dataclass
class TrainConfig:
    # I/O
    out_dir: str = "out"
    data_dir: str = ""  # a prepared data dir (python -m gpt.data); empty: the bundled Shakespeare
    input: list[str] = field(default_factory=list, metadata={"sep": ","})  # files/folders/globs
    tokenizer: str = "char"  # with --input: gpt2 | char | bpe:N | hf:PATH/tokenizer.json
    text_field: str = "text"  # with --input: JSONL key (dotted: nested) or Parquet column of the text
    skip_bad_records: bool = False  # with --input: skip (and count) records without a string text field
    errors: str = "strict"  # with --input: invalid UTF-8 is an error (strict) or U+FFFD (replace)
    include: list[str] = field(default_factory=list, metadata={"sep": ","})  # with --input: folders' file
    # patterns (empty: gpt.data's, *.txt,*.txt.gz,*.jsonl,*.jsonl.gz,*.parquet)
    align_documents: bool = False  # each training row starts at a document start (packed best-fit)
    init_from: str = "scratch"  # scratch | resume | gpt2 | <checkpoint dir>
    overwrite: bool = False
    # LoRA fine-tuning of the --init_from model (gpt/lora.py): only the adapters train; rank 0: off
    lora_rank: int = 0
    lora_alpha: float = 16.0  # the adapters' update is scaled by lora_alpha / lora_rank
    lora_targets: list[str] = field(default_factory=lambda: ["attn", "mlp"], metadata={"sep": ","})
    lora_dropout: float = 0.0  # dropout on the adapters' inputs
    # Mixture-of-experts training (the experts themselves are ModelConfig's n_expert...): what the
    # training forward pass and objective do; evaluation and sampling never drop tokens.
    expert_capacity_factor: float = 1.25  # an expert's slots per sequence: factor * T * k / E; 0: no limit
    moe_aux_loss_coef: float = 0.01  # load-balancing loss (Switch Transformer; 1.0 when uniform)
    moe_z_loss_coef: float = 0.001  # router z-loss (ST-MoE): mean squared logsumexp of router logits
    seed: int = 1337
    # optimisation
    batch_size: int = 12
    gradient_accumulation_steps: int = 1
    max_iters: int = 2000
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    lr_schedule: str = "cosine"  # cosine | constant | wsd (warmup-stable-decay)
    warmup_iters: int = 100
    lr_decay_iters: int = 0  # 0: max_iters
    decay_fraction: float = 0.2  # wsd: the final fraction of steps that decays to min_lr
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # 0 disables clipping
    # evaluation, logging, checkpoints
    eval_interval: int = 250
    eval_iters: int = 20
    log_interval: int = 10
    ckpt_interval: int = 0  # 0: at each eval
    keep_checkpoints: int = 3
    progress: bool = True
    # scale-out
    mesh: str = ""  # e.g. data:8 or data:2,fsdp:4; empty: all local devices on data
    distributed: bool = False
    coordinator_address: str = ""
    num_processes: int = 0
    process_id: int = -1


@dataclass
class SampleConfig:
    out_dir: str = "out"
    prompt: str = "\n"
    prompt_file: str = ""
    num_samples: int = 1
    max_new_tokens: int = 500
    temperature: float = 0.8
    top_k: int = 200  # 0 disables
    top_p: float = 1.0
    seed: int = 1337
    stop: list[str] = field(default_factory=list)
    dtype: str = "auto"  # auto: float32 on CPU (decoding is faster there in float32), bfloat16 on GPU/TPU
    stream: bool = True
    draft_out_dir: str = ""  # a smaller model with the same tokenizer: speculative decoding (gpt/speculative.py)
    num_draft_tokens: int = 4  # with --draft_out_dir: tokens the draft proposes per target forward
    # GPU, one sample: each decoded token's layers as hand-written Pallas (Triton) kernels, three a
    # layer and a sum where XLA makes about fourteen (gpt/ops/decode_kernels.py; GPT-2's block, no RoPE).
    # auto: wherever they run (`gpt.sampling.decode_kernels_by_default`); true (a bare
    # --decode_kernels): a run where they cannot is refused; false: XLA's layers
    decode_kernels: str = field(default="auto", metadata={"flag": True})


MAX_DRAFT_TOKENS = 32  # each draft token is kept only if all before it were: longer drafts are waste


_GPT2_TRAIN = dict(
    tokenizer="gpt2", batch_size=12, gradient_accumulation_steps=40, max_iters=600000,
    learning_rate=6e-4, min_lr=6e-5, warmup_iters=2000, weight_decay=0.1, beta2=0.95,
    eval_interval=1000, eval_iters=200, log_interval=10,
)
_LLAMA = dict(pos_embedding="rope", norm="rmsnorm", mlp="swiglu")
PRESETS: dict[str, dict[str, Any]] = {
    # nanoGPT's CPU example (its README, "I only have a MacBook"): a minute on a 2-core CPU. Its
    # learning rate, 1e-3 (from the baby GPT's config), is too low for this small model and short
    # run: 4e-3 trains to val loss 1.77 instead of 1.90 (BENCHMARKS.md; --learning_rate=1e-3
    # --min_lr=1e-4 gives nanoGPT's exact recipe).
    "default": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, dropout=0.0, bias=False,
                    batch_size=12, max_iters=2000, lr_decay_iters=2000,
                    learning_rate=4e-3, min_lr=4e-4, warmup_iters=100, eval_interval=250,
                    eval_iters=20, log_interval=10),
    # nanoGPT's config/train_shakespeare_char.py ("baby GPT"). nanoGPT's nn.GELU() is exact; the
    # presets keep GPT-2's tanh form, which trained to the same loss (BENCHMARKS.md) and is cheaper.
    "shakespeare-char": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.2, bias=False,
                             batch_size=64, max_iters=5000, lr_decay_iters=5000, learning_rate=1e-3,
                             min_lr=1e-4, warmup_iters=100, beta2=0.99, weight_decay=0.1, grad_clip=1.0,
                             eval_interval=250, eval_iters=200, log_interval=10, tokenizer="char"),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257, bias=True,
                 dropout=0.0, **_GPT2_TRAIN),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024, vocab_size=50257,
                        bias=True, dropout=0.0, **_GPT2_TRAIN),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024, vocab_size=50257,
                       bias=True, dropout=0.0, **_GPT2_TRAIN),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024, vocab_size=50257,
                    bias=True, dropout=0.0, **_GPT2_TRAIN),
    # The modern block (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied head): for tests.
    "llama-tiny": dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=64, dropout=0.0,
                       bias=False, **_LLAMA, tie_embeddings=False, batch_size=4, max_iters=20,
                       lr_decay_iters=20, warmup_iters=2, eval_interval=10, eval_iters=2,
                       log_interval=5),
    # Shapes only (no weights are downloaded): HuggingFaceTB/SmolLM-135M and Llama 3.2 1B.
    "smollm-135m": dict(n_layer=30, n_head=9, n_kv_head=3, n_embd=576, ffn_dim=1536, block_size=2048,
                        vocab_size=49152, bias=False, **_LLAMA, dropout=0.0, **_GPT2_TRAIN),
    "llama-1b": dict(n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, ffn_dim=8192, block_size=2048,
                     vocab_size=128256, bias=False, **dict(_LLAMA, rope_theta=500000.0),
                     rope_scaling="llama3", rope_factor=32.0,
                     dropout=0.0, **_GPT2_TRAIN),
    # For tests: a model that compiles and trains in a second.
    "tiny": dict(n_layer=2, n_head=2, n_embd=32, block_size=32, dropout=0.0, bias=True,
                 batch_size=4, max_iters=20, lr_decay_iters=20, warmup_iters=2, eval_interval=10,
                 eval_iters=2, log_interval=5),
}

# --lora_targets: the groups, or the block weights by name (gpt/lora.py checks them against the model).
LORA_GROUPS = {"attn": ("w_qkv", "w_q", "w_kv", "w_o"), "mlp": ("w_fc", "w_proj")}
LORA_TARGETS = (*LORA_GROUPS, *(w for ws in LORA_GROUPS.values() for w in ws))

_CHOICES = {
    "pos_embedding": ("learned", "sinusoidal", "rope", "none"),
    "rope_scaling": ("none", "linear", "llama3"),
    "norm": ("layernorm", "rmsnorm", "dyt"),
    "mlp": ("gelu", "swiglu"),
    "activation": ("gelu_tanh", "gelu"),
    "dtype": ("auto", "float32", "bfloat16"),
    "attention": ("auto", "xla", "cudnn", "einsum"),
    "remat": ("none", "block", "dots"),
    "residual_dtype": ("float32", "compute"),
    "lr_schedule": ("cosine", "constant", "wsd"),
    "errors": ("strict", "replace"),
}


# ----------------------------------------------------------------------------- parsing


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


MAX_INT = 2**31 - 1


def _parse_int(key: str, raw: Any) -> int:
    if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
        raise UserError(f"--{key} expects an integer, got {raw!r}")
    try:
        return int(raw) if not isinstance(raw, str) else int(raw.replace("_", ""))
    except (ValueError, OverflowError):
        try:  # allow 1e4-style integers
            f = float(raw)
        except ValueError:
            f = math.nan
        if f.is_integer():
            return int(f)
        raise UserError(f"--{key} expects an integer, got {raw!r}") from None


def parse_value(key: str, raw: Any, typ: Any, sep: str | None = None) -> Any:
    """Convert `raw` (a string from the command line, or a TOML/JSON value) to the field's type.

    List fields take one item per flag (repeat the flag for more), or `sep`-separated items where
    the field declares a separator (paths: --input=a.txt,b/).
    """
    scalar = (str, int, float, bool)
    if typing.get_origin(typ) is list:
        if isinstance(raw, list):
            if not all(isinstance(x, scalar) for x in raw):
                raise UserError(f"--{key} expects a list of plain values, got {raw!r}")
            return [str(x) for x in raw]
        if not isinstance(raw, scalar):
            raise UserError(f"--{key} expects a value or a list of them, got {raw!r}")
        return [x for x in str(raw).split(sep) if x] if sep else [str(raw)]
    if not isinstance(raw, scalar):  # a config file's list, table or null
        raise UserError(f"--{key} expects a single value, got {raw!r}")
    if typ is bool:
        if isinstance(raw, bool):
            return raw
        s = str(raw).strip().lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
        raise UserError(f"--{key} expects true or false, got {raw!r}")
    if typ is int:
        value = _parse_int(key, raw)
        if abs(value) > MAX_INT:  # sizes past int32 fail deep in XLA or numpy, with a traceback or abort
            raise UserError(f"--{key}={raw} is beyond what any setting takes (at most {MAX_INT:,})")
        return value
    if typ is float:
        if isinstance(raw, bool):
            raise UserError(f"--{key} expects a number, got {raw!r}")
        try:
            value = float(raw)
        except ValueError:
            raise UserError(f"--{key} expects a number, got {raw!r}") from None
        if not math.isfinite(value):
            raise UserError(f"--{key} must be a finite number, got {raw!r}")
        return value
    return str(raw)


def split_argv(argv: Sequence[str], bool_keys: set[str]) -> list[tuple[str, str]]:
    """Turn `--k=v`, `--k v` and bare boolean `--flag` into (key, raw value) pairs, in order."""
    pairs: list[tuple[str, str]] = []
    i = 0
    argv = list(argv)
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise UserError(f"unexpected argument {arg!r} (settings are given as --key=value)")
        name, eq, rest = arg[2:].partition("=")
        body = name.replace("-", "_") + eq + rest  # --no-progress, --scan-layers as --no_progress ...
        if "=" in body:
            key, value = body.split("=", 1)
        elif body in bool_keys and (i + 1 >= len(argv) or argv[i + 1].startswith("--")):
            key, value = body, "true"
        elif body.startswith("no_") and body[3:] in bool_keys:
            key, value = body[3:], "false"
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            key, value = body, argv[i + 1]
            i += 1
        else:
            raise UserError(f"--{body} needs a value (use --{body}=VALUE)")
        pairs.append((key, value))
        i += 1
    return pairs


def _unknown_key(key: str, valid: Sequence[str]) -> UserError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"did you mean --{close[0]}?" if close else "run with --help to list the settings"
    return UserError(f"unknown setting --{key} ({hint})")


def read_config_file(path: str) -> dict[str, Any]:
    """Flat keys, or [model]/[compute]/[train]/[sample] tables (the sections of a checkpoint's
    config), from a TOML or JSON file (never executed)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file {path} not found (pass an existing .toml or .json file)")
    try:
        if p.suffix == ".toml":
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        elif p.suffix == ".json":
            data = json.loads(p.read_text(encoding="utf-8"))
        else:
            raise UserError(f"config file {path} must end in .toml or .json")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise UserError(f"config file {path} is not valid: {str(e) or type(e).__name__}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a table of settings")
    flat: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict) and k in ("model", "compute", "train", "sample"):
            flat.update(v)
        else:
            flat[k] = v
    return flat


def build(classes: Sequence[type], argv: Sequence[str], default_preset: str | None = None
          ) -> tuple[list[Any], set[str]]:
    """Build one instance of each dataclass from preset, config file and command line, in that order.

    Returns the instances and the set of keys the user set explicitly (file or command line), which
    callers use to decide e.g. whether a checkpoint's value or the user's wins.
    """
    types: dict[str, Any] = {}
    seps: dict[str, str] = {}
    for cls in classes:
        types.update(_field_types(cls))
        seps.update({f.name: f.metadata["sep"] for f in fields(cls) if "sep" in f.metadata})
    presettable = any(types.keys() & p.keys() for p in PRESETS.values())  # not sample.py's settings
    valid = sorted(types) + ["preset"] * presettable + ["config"]
    # bools, and settings of more values that a bare --flag sets to true (--no_flag: false)
    flags = {f.name for cls in classes for f in fields(cls) if f.metadata.get("flag")}
    pairs = split_argv(argv, {k for k, t in types.items() if t is bool} | flags)
    if not presettable and any(k == "preset" for k, _ in pairs):  # it would do nothing
        raise UserError("--preset sets none of this command's settings (a model's come from its "
                        "checkpoint); leave it out, or run with --help to list the settings")

    values: dict[str, Any] = {}
    preset = next((v for k, v in pairs if k == "preset"), default_preset)
    if preset is not None:
        if preset not in PRESETS:
            close = difflib.get_close_matches(preset, list(PRESETS), n=1)
            hint = f"did you mean {close[0]}?" if close else f"choose from {', '.join(PRESETS)}"
            raise UserError(f"unknown preset {preset!r} ({hint})")
        values.update({k: v for k, v in PRESETS[preset].items() if k in types})
    explicit: set[str] = set()
    for k, v in pairs:
        if k == "config":
            for fk, fv in read_config_file(v).items():
                if fk == "config" or (fk == "preset" and presettable):
                    raise UserError(f"config file {v} sets {fk}, which is a command-line flag: pass --{fk}=... "
                                    f"beside --config (a file holds the settings themselves)")
                if fk == "preset":
                    raise UserError(f"config file {v} sets preset, which sets none of this command's "
                                    f"settings; leave it out")
                if fk not in types:
                    raise _unknown_key(fk, valid)
                values[fk] = parse_value(fk, fv, types[fk], seps.get(fk))
                explicit.add(fk)
    seen: set[str] = set()
    for k, v in pairs:
        if k in ("preset", "config"):
            continue
        if k not in types:
            raise _unknown_key(k, valid)
        value = parse_value(k, v, types[k], seps.get(k))
        if typing.get_origin(types[k]) is list and k in seen:
            value = values[k] + value  # a repeated list flag accumulates: --stop A --stop B
        values[k] = value
        seen.add(k)
        explicit.add(k)
    instances = [cls(**{k: v for k, v in values.items() if k in _field_types(cls)})
                 for cls in classes]
    return instances, explicit


# ----------------------------------------------------------------------------- validation


def _check_choice(obj: Any, name: str) -> None:
    value = getattr(obj, name)
    if value not in _CHOICES[name]:
        raise UserError(f"--{name}={value} is not valid (choose from {', '.join(_CHOICES[name])})")


def _check_positive(obj: Any, *names: str, allow_zero: bool = False) -> None:
    for n in names:
        v = getattr(obj, n)
        if v < 0 or (v == 0 and not allow_zero):
            need = "zero or more" if allow_zero else "positive"
            raise UserError(f"--{n}={v} must be {need}")


def validate_model(m: ModelConfig) -> ModelConfig:
    _check_positive(m, "vocab_size", "block_size", "n_layer", "n_head", "n_embd", "rope_theta",
                    "norm_eps")
    _check_positive(m, "n_kv_head", "head_size", "ffn_dim", allow_zero=True)
    if m.n_embd % m.n_head and not m.head_size:
        raise UserError(f"--n_embd={m.n_embd} must be divisible by --n_head={m.n_head} (or set "
                        f"--head_size)")
    if m.n_head % m.kv_heads:
        raise UserError(f"--n_head={m.n_head} must be divisible by --n_kv_head={m.n_kv_head} (each "
                        f"key/value head serves a whole group of query heads)")
    for name in ("pos_embedding", "activation", "norm", "mlp"):
        _check_choice(m, name)
    _validate_moe(m)
    if m.pos_embedding == "sinusoidal" and m.n_embd % 2:
        raise UserError(f"--n_embd={m.n_embd} must be even for sinusoidal position embeddings")
    if m.pos_embedding == "rope" and m.head_dim % 2:
        raise UserError(f"RoPE needs an even head dimension, got {m.head_dim} (n_embd / n_head); "
                        f"change --n_embd or --n_head")
    _validate_rope_scaling(m)
    return m


def _validate_rope_scaling(m: ModelConfig) -> None:
    _check_choice(m, "rope_scaling")
    _check_positive(m, "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_context")
    if m.rope_scaling != "none" and m.pos_embedding != "rope":
        raise UserError(f"--rope_scaling={m.rope_scaling} needs --pos_embedding=rope; drop it or use RoPE")
    if m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        raise UserError(f"--rope_high_freq_factor={m.rope_high_freq_factor} must exceed "
                        f"--rope_low_freq_factor={m.rope_low_freq_factor} (llama3 scaling blends the "
                        f"frequencies between the two)")


def _validate_moe(m: ModelConfig) -> None:
    _check_positive(m, "n_expert", allow_zero=True)
    _check_positive(m, "n_expert_per_token", "moe_every")
    if not m.n_expert:
        return
    if m.n_expert_per_token > m.n_expert:
        raise UserError(f"--n_expert_per_token={m.n_expert_per_token} must be at most --n_expert={m.n_expert} "
                        f"(each token goes to that many different experts)")
    if m.n_layer % m.moe_every:
        raise UserError(f"--moe_every={m.moe_every} must divide --n_layer={m.n_layer} (the layers repeat in "
                        f"groups of moe_every blocks, the last of each a mixture of experts)")


MOE_FLAGS = ("n_expert_per_token", "moe_every", "expert_capacity_factor", "moe_aux_loss_coef",
             "moe_z_loss_coef")


def schedule_warnings(t: TrainConfig) -> list[str]:
    """Settings that make the schedule other than its name says: warmup past the run's end or past
    the decay's, and (wsd) a decay that starts before warmup ends or after the run."""
    decay_iters, out = t.lr_decay_iters or t.max_iters, []
    if t.warmup_iters >= t.max_iters:
        out.append(f"--warmup_iters={t.warmup_iters} is not below --max_iters={t.max_iters}: the learning rate "
                   f"never reaches --learning_rate={t.learning_rate:g}")
    elif t.lr_schedule != "constant" and decay_iters < t.warmup_iters:
        out.append(f"--lr_decay_iters={decay_iters} ends before --warmup_iters={t.warmup_iters}: the learning rate "
                   f"drops from its peak to --min_lr={t.min_lr:g} in one step after warmup")
    elif t.lr_schedule == "wsd" and decay_iters * (1 - t.decay_fraction) < t.warmup_iters:
        out.append(f"wsd's decay (the last {t.decay_fraction:g} of {decay_iters} steps) starts before "
                   f"--warmup_iters={t.warmup_iters} ends: it never holds the peak")
    elif t.lr_schedule == "wsd" and decay_iters * (1 - t.decay_fraction) >= t.max_iters:
        out.append(f"wsd's decay (the last {t.decay_fraction:g} of --lr_decay_iters={decay_iters} steps) starts "
                   f"after --max_iters={t.max_iters}: the run ends at the peak rate (--lr_decay_iters=0 decays "
                   f"over the run)")
    return out


def check_moe_flags(m: ModelConfig, t: TrainConfig, explicit: set[str]) -> None:
    """A mixture-of-experts setting on a dense model would be silently ignored. `m` is the run's
    model: the flags' for a run from scratch, else the checkpoint's (--init_from's, a LoRA run's base
    or the resumed run's, whose architecture no flag changes), known once it is read."""
    given = sorted(k for k in MOE_FLAGS if k in explicit)
    if not given or m.n_expert:
        return
    if t.init_from == "scratch":
        raise UserError(f"--{given[0]} needs --n_expert=N (a mixture-of-experts model)")
    raise UserError(f"--{given[0]} is a mixture-of-experts setting, and the model of --init_from={t.init_from} "
                    f"is dense (n_expert=0); drop the flag")


def validate_compute(c: ComputeConfig) -> ComputeConfig:
    if not 0.0 <= c.dropout < 1.0:
        raise UserError(f"--dropout={c.dropout} must be in [0, 1)")
    for name in ("dtype", "attention", "remat", "residual_dtype"):
        _check_choice(c, name)
    _check_positive(c, "loss_chunks", allow_zero=True)
    return c


def validate_train(t: TrainConfig) -> TrainConfig:
    _check_positive(t, "batch_size", "gradient_accumulation_steps", "max_iters", "learning_rate",
                    "eval_interval", "eval_iters", "log_interval", "keep_checkpoints")
    _check_positive(t, "min_lr", "warmup_iters", "lr_decay_iters", "weight_decay", "grad_clip",
                    "ckpt_interval", allow_zero=True)
    if t.min_lr > t.learning_rate and t.lr_schedule != "constant":
        raise UserError(f"--min_lr={t.min_lr} must not exceed --learning_rate={t.learning_rate} (the "
                        f"schedule decays to min_lr); set it too, e.g. --min_lr={t.learning_rate / 10:g}")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(t, name) < 1.0:
            raise UserError(f"--{name}={getattr(t, name)} must be in [0, 1)")
    if not 0.0 < t.decay_fraction <= 1.0:
        raise UserError(f"--decay_fraction={t.decay_fraction} must be in (0, 1]")
    _check_choice(t, "lr_schedule")
    _check_choice(t, "errors")
    if not t.out_dir:
        raise UserError("--out_dir must not be empty")
    if not t.init_from:
        raise UserError("--init_from must not be empty: scratch, resume, gpt2 or a directory of checkpoints")
    _check_seed(t.seed)
    _validate_lora(t)
    _check_positive(t, "expert_capacity_factor", "moe_aux_loss_coef", "moe_z_loss_coef", allow_zero=True)
    return t


MAX_SEED = MAX_INT  # what every consumer of the seed (PRNG keys, numpy generators) takes


def _check_seed(seed: int) -> None:
    if not 0 <= seed <= MAX_SEED:
        raise UserError(f"--seed={seed} must be in [0, {MAX_SEED}]")


MAX_NEW_TOKENS = 1_000_000  # per sample, per call: already hours of decoding
MAX_SAMPLES = 65_536  # rows of one batch


def _validate_lora(t: TrainConfig) -> None:
    _check_positive(t, "lora_rank", allow_zero=True)
    _check_positive(t, "lora_alpha")
    if not 0.0 <= t.lora_dropout < 1.0:
        raise UserError(f"--lora_dropout={t.lora_dropout} must be in [0, 1)")
    unknown = [n for n in t.lora_targets if n not in LORA_TARGETS]
    if unknown or not t.lora_targets:
        what = f"unknown target {unknown[0]!r}" if unknown else "no targets"
        raise UserError(f"--lora_targets: {what} (choose from {', '.join(LORA_TARGETS)}, comma-separated)")
    if t.lora_rank and t.init_from == "scratch":
        raise UserError("--lora_rank fine-tunes a trained model: pass --init_from=DIR (a training output "
                        "or a converted Hugging Face checkpoint) or --init_from=gpt2")


def check_lora_flags(t: TrainConfig, explicit: set[str]) -> None:
    """What validation of the values alone cannot see: an explicit --lora_rank=0, and LoRA settings
    without a rank (a resumed run takes its rank from the checkpoint)."""
    if "lora_rank" in explicit and t.lora_rank <= 0:
        raise UserError(f"--lora_rank={t.lora_rank} must be positive (leave it out to train all weights)")
    given = sorted(k for k in ("lora_alpha", "lora_targets", "lora_dropout") if k in explicit)
    if given and not t.lora_rank and t.init_from != "resume":
        raise UserError(f"--{given[0]} needs --lora_rank=N (LoRA fine-tuning)")


TEMPERATURES = (1e-4, 1e4)  # --temperature's range besides 0


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """The filters' settings, from the command line or `gpt.sampling.SamplingSettings`."""
    if temperature != 0 and not TEMPERATURES[0] <= temperature <= TEMPERATURES[1]:
        # beyond these, logits / T over- or underflows float32 and the padded -inf entries become
        # NaN: the samples are padding, not text
        raise UserError(f"--temperature={temperature} must be 0 (greedy) or between {TEMPERATURES[0]:g} "
                        f"and {TEMPERATURES[1]:g} (0.7-1.0 is typical)")
    if top_k < 0:
        raise UserError(f"--top_k={top_k} must be zero (off) or positive")
    if not 0.0 < top_p <= 1.0:
        raise UserError(f"--top_p={top_p} must be in (0, 1]")


def auto_or_bool(key: str, raw: str) -> str:
    """A setting of auto, true or false (a bool's spellings: 1/0, yes/no, on/off) as one of those
    three words."""
    if str(raw).strip().lower() == "auto":
        return "auto"
    try:
        return str(parse_value(key, raw, bool)).lower()
    except UserError:
        raise UserError(f"--{key} expects auto, true or false, got {raw!r}") from None


def is_utf8(text: str) -> bool:
    """Whether `text` encodes as UTF-8 (a lone surrogate does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def validate_sample(s: SampleConfig) -> SampleConfig:
    if s.num_samples < 1:
        raise UserError(f"--num_samples={s.num_samples} must be at least 1")
    if s.max_new_tokens < 0:
        raise UserError(f"--max_new_tokens={s.max_new_tokens} must be zero or more")
    if s.max_new_tokens > MAX_NEW_TOKENS or s.num_samples > MAX_SAMPLES:
        raise UserError(f"--max_new_tokens={s.max_new_tokens} --num_samples={s.num_samples} is beyond what one "
                        f"call can hold or finish (at most {MAX_NEW_TOKENS:,} tokens and {MAX_SAMPLES:,} samples); "
                        f"ask for less, or call it several times")
    _check_seed(s.seed)
    check_sampling(s.temperature, s.top_k, s.top_p)
    if any(not stop for stop in s.stop):
        raise UserError("--stop is an empty string, which would cut every sample at its start; pass the "
                        "text to stop at, or leave --stop out")
    if not all(map(is_utf8, s.stop)):  # bytes that are not UTF-8 reach argv as lone surrogates
        raise UserError("--stop is not valid UTF-8 text, which no decoded sample holds (it would never "
                        "stop one); pass the stop string as UTF-8")
    if s.dtype not in _CHOICES["dtype"]:
        raise UserError(f"--dtype={s.dtype} is not valid (choose from {', '.join(_CHOICES['dtype'])})")
    s.decode_kernels = auto_or_bool("decode_kernels", s.decode_kernels)
    if not 1 <= s.num_draft_tokens <= MAX_DRAFT_TOKENS:
        raise UserError(f"--num_draft_tokens={s.num_draft_tokens} must be 1 to {MAX_DRAFT_TOKENS} (a "
                        f"draft token is kept only if all before it were, so long drafts are wasted "
                        f"work; 2-8 is typical)")
    return s


TRAIN_CLASSES = (ModelConfig, ComputeConfig, TrainConfig)


def build_train(argv: Sequence[str], default_preset: str | None = "default"
                ) -> tuple[ModelConfig, ComputeConfig, TrainConfig, set[str]]:
    """train.py's settings, validated: architecture, how it is computed, and the run."""
    (m, c, t), explicit = build(TRAIN_CLASSES, argv, default_preset)
    m, c, t = validate_model(m), validate_compute(c), validate_train(t)
    if "input" in explicit and not t.input:  # --input="$UNSET" trained on the bundled Shakespeare
        raise UserError("--input names no file; pass text files, folders or globs, or leave --input out "
                        "to train on the bundled Shakespeare")
    check_lora_flags(t, explicit)
    if t.init_from == "scratch":  # else the checkpoint's model, once read (gpt.train._with_data)
        check_moe_flags(m, t, explicit)
    return m, c, t, explicit


def to_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)


def model_from_dict(d: dict[str, Any]) -> ModelConfig:
    """Rebuild a ModelConfig from JSON (a checkpoint's), ignoring keys it does not hold: checkpoints
    written before the architecture was split from `ComputeConfig` also stored dtype, dropout, ..."""
    return validate_model(ModelConfig(**json_fields(ModelConfig, d)))


def compute_from_dict(d: dict[str, Any]) -> ComputeConfig:
    """Rebuild a ComputeConfig from JSON (a checkpoint's), ignoring keys it does not hold."""
    return validate_compute(ComputeConfig(**json_fields(ComputeConfig, d)))


def json_fields(cls: type, d: Any) -> dict[str, Any]:
    """The fields of `cls` in JSON object `d`, each of the field's type (a file may have been
    edited: a wrong type is one line here, not a TypeError deep in validation)."""
    if not isinstance(d, dict):
        raise UserError(f"the checkpoint's {cls.__name__} section is {type(d).__name__}, not an object; the "
                        f"checkpoint metadata was edited or is damaged")
    out = {}
    for name, typ in _field_types(cls).items():
        if name not in d:
            continue
        v = d[name]
        ok = {int: isinstance(v, int) and not isinstance(v, bool), bool: isinstance(v, bool), str: isinstance(v, str),
              float: finite_number(v)}.get(typ, True)
        if typing.get_origin(typ) is list:
            ok = isinstance(v, list) and all(isinstance(x, str) for x in v)
        if not ok:
            want = "a finite number" if typ is float else getattr(typ, '__name__', typ)
            raise UserError(f"the checkpoint's {cls.__name__} has {name}={v!r}, not {want}; "
                            f"the checkpoint metadata was edited or is damaged")
        out[name] = float(v) if typ is float else v
    return out


def help_text(classes: Sequence[type], argv: Sequence[str] = (), default_preset: str | None = None) -> str:
    """Every setting with the value a run with `argv` starts from, as `build` combines the preset
    (argv's, else `default_preset`), a --config file and the command line; where argv does not
    build, the error and the fields' own defaults. A data directory or checkpoint may still change
    some (the vocabulary), as the run reports."""
    try:
        instances, _ = build(classes, [a for a in argv if a not in ("-h", "--help")], default_preset)
        source = "as this command line sets them"
    except UserError as e:
        instances, source = [cls() for cls in classes], f"defaults ({e})"
    names = {f.name for cls in classes for f in fields(cls)}
    presets = any(names & p.keys() for p in PRESETS.values())  # not sample.py's: no preset sets any
    lines = [f"settings (--key=value; {'--preset=NAME; ' if presets else ''}--config=FILE.toml|json):",
             *([f"  presets: {', '.join(PRESETS)}"] if presets else []), f"  values {source}:"]
    for obj in instances:
        lines += [f"  --{f.name}={getattr(obj, f.name)!r}" for f in fields(obj)]
    return "\n".join(lines)
