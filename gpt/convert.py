"""Hugging Face GPT-2 and Llama-family models <-> our checkpoints.

    python -m gpt.convert --from_hf HF_DIR --out_dir OUT [--overwrite]
    python -m gpt.convert --to_hf --out_dir OUT --hf_dir HF_DIR [--overwrite]
    python -m gpt.convert --merge_lora --out_dir LORA_OUT --merged_dir NEW_DIR

--to_hf of a LoRA run writes its adapters merged into the base; --merge_lora writes them merged
as a plain checkpoint of ours (gpt/lora.py).

A Hugging Face directory is `config.json` + `model.safetensors` (or sharded safetensors with
`model.safetensors.index.json`); the architecture comes from config.json's model_type: gpt2
(GPT2LMHeadModel, mapped below) or llama / mistral / qwen2 / qwen3 (gpt/convert_llama.py). Weights
are read with safetensors only: pickle files (`pytorch_model.bin`) can run arbitrary code when
loaded, so they are never opened.

GPT-2 layout:
(HF's Conv1D weights are [in, out], the same orientation as ours)
    wte [V, D]             <-> wte [V_padded, D] (padded rows are zero; dropped on export)
    wpe [P, D]             <-> wpe [block_size, D]
    h.i.ln_1.{weight,bias} <-> blocks.ln1_{scale,bias}[i]
    h.i.attn.c_attn.weight [D, 3D] (q|k|v, each head-major H*K) <-> w_qkv[i] [D, 3, H, K]
    h.i.attn.c_attn.bias   [3D]    <-> b_qkv[i] [3, H, K]
    h.i.attn.c_proj.weight [H*K, D] <-> w_o[i] [H, K, D];  .bias <-> b_o[i]
    h.i.ln_2.*             <-> blocks.ln2_*[i]
    h.i.mlp.c_fc.*  [D, 4D] <-> w_fc / b_fc;  h.i.mlp.c_proj.* [4D, D] <-> w_proj / b_proj
    ln_f.*                 <-> lnf_{scale,bias}
    lm_head.weight         tied to wte (absent from HF's own safetensors files)
"""
from __future__ import annotations

import glob
import json
import math
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from gpt import convert_llama as llama
from gpt.config import ModelConfig, to_dict, validate_model
from gpt.errors import ArgParser, UserError, read_json_object, run_main

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Hugging Face activation names -> ours: GPT-2's tanh approximation (two spellings) or exact GELU.
HF_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
GPT2_VOCAB = 50257
GPT2_EOT = 50256
_UNSET = object()

# HF name suffix per layer (after "h.{i}.") -> our blocks key.
_LAYER_KEYS = {
    "ln_1.weight": "ln1_scale", "ln_1.bias": "ln1_bias",
    "attn.c_attn.weight": "w_qkv", "attn.c_attn.bias": "b_qkv",
    "attn.c_proj.weight": "w_o", "attn.c_proj.bias": "b_o",
    "ln_2.weight": "ln2_scale", "ln_2.bias": "ln2_bias",
    "mlp.c_fc.weight": "w_fc", "mlp.c_fc.bias": "b_fc",
    "mlp.c_proj.weight": "w_proj", "mlp.c_proj.bias": "b_proj",
}


# ----------------------------------------------------------------------------- config


def _hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor we need from an HF GPT-2 file (without prefix) and its shape."""
    D, V, P = cfg.n_embd, cfg.vocab_size, cfg.block_size
    per_layer = {
        "ln_1.weight": (D,), "ln_1.bias": (D,),
        "attn.c_attn.weight": (D, 3 * D), "attn.c_attn.bias": (3 * D,),
        "attn.c_proj.weight": (D, D), "attn.c_proj.bias": (D,),
        "ln_2.weight": (D,), "ln_2.bias": (D,),
        "mlp.c_fc.weight": (D, 4 * D), "mlp.c_fc.bias": (4 * D,),
        "mlp.c_proj.weight": (4 * D, D), "mlp.c_proj.bias": (D,),
    }
    shapes = {"wte.weight": (V, D), "wpe.weight": (P, D)}
    for i in range(cfg.n_layer):
        shapes.update({f"h.{i}.{k}": s for k, s in per_layer.items()})
    shapes.update({"ln_f.weight": (D,), "ln_f.bias": (D,)})
    return shapes


def _read_hf_config(path: Path) -> dict[str, Any]:
    return read_json_object(path, "a Hugging Face model config")


def _int_getter(hf: dict[str, Any], where: str):
    """get(*names): the first of `names` present in `hf`, which must be a positive integer."""
    def get_int(*names: str) -> int:
        for n in names:
            v = hf.get(n)
            if v is not None:
                if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                    raise UserError(f"{where}: {n}={v!r} must be a positive integer")
                return v
        raise UserError(f"{where} has no {names[0]} (not a complete {hf.get('model_type')} config)")
    return get_int


def config_from_hf(hf: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Our ModelConfig from a Hugging Face config dict; anything we cannot run is a UserError."""
    model_type = hf.get("model_type")
    get_int = _int_getter(hf, where)
    if isinstance(model_type, str) and model_type in llama.ARCHITECTURES:
        return llama.config_from_hf(hf, where, get_int)
    if model_type != "gpt2":
        names = hf.get("architectures") if isinstance(hf.get("architectures"), list) else []
        arch = ", ".join(map(str, names)) or "unknown architecture"
        raise UserError(f"{where} describes model_type {model_type!r} ({arch}), which is not "
                        f"supported; supported: gpt2, {', '.join(llama.ARCHITECTURES)}")
    n_embd, n_layer, n_head = get_int("n_embd"), get_int("n_layer"), get_int("n_head")
    block_size, vocab_size = get_int("n_positions", "n_ctx"), get_int("vocab_size")
    act = hf.get("activation_function", "gelu_new")
    if not isinstance(act, str) or act not in HF_ACTIVATIONS:
        raise UserError(f"{where}: activation_function {act!r} is not supported; use one of "
                        f"{', '.join(HF_ACTIVATIONS)}")
    eps = hf.get("layer_norm_epsilon", 1e-5)
    if not isinstance(eps, (int, float)) or not math.isclose(eps, 1e-5, rel_tol=1e-6):
        raise UserError(f"{where}: layer_norm_epsilon {eps!r} is not supported (only 1e-5, GPT-2's)")
    n_inner = hf.get("n_inner")
    if n_inner is not None and n_inner != 4 * n_embd:
        raise UserError(f"{where}: n_inner={n_inner} is not supported (the MLP width must be "
                        f"4 * n_embd = {4 * n_embd})")
    llama.hf_bool(hf, "tie_word_embeddings", True, where)  # load_hf reads it (GPT-2 ties them)
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        if hf.get(key, want) != want:
            raise UserError(f"{where}: {key}={hf[key]!r} is not supported (GPT-2 uses {want})")
    cfg = ModelConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
                      n_embd=n_embd, bias=True, pos_embedding="learned",
                      activation=HF_ACTIVATIONS[act], norm_eps=1e-5)
    try:
        return validate_model(cfg)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def hf_config(cfg: ModelConfig, eot_id: Any = _UNSET, dropout: float = 0.0) -> dict[str, Any]:
    """A GPT2Config dict for `cfg` (what GPT2LMHeadModel.save_pretrained writes); `dropout` is the
    rate the checkpoint was trained with (HF keeps it in the config)."""
    if eot_id is _UNSET:
        eot_id = GPT2_EOT if cfg.vocab_size == GPT2_VOCAB else cfg.vocab_size - 1
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "activation_function": "gelu_new" if cfg.activation == "gelu_tanh" else "gelu",
        "attn_pdrop": dropout,
        "embd_pdrop": dropout,
        "resid_pdrop": dropout,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-5,
        "n_ctx": cfg.block_size,
        "n_positions": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_head": cfg.n_head,
        "n_inner": None,
        "n_layer": cfg.n_layer,
        "vocab_size": cfg.vocab_size,
        "reorder_and_upcast_attn": False,
        "scale_attn_by_inverse_layer_idx": False,
        "scale_attn_weights": True,
        "summary_activation": None,
        "summary_first_dropout": 0.1,
        "summary_proj_to_labels": True,
        "summary_type": "cls_index",
        "summary_use_proj": True,
        "tie_word_embeddings": True,
        "use_cache": True,
        "dtype": "float32",
    }


# ----------------------------------------------------------------------------- reading


def _weight_files(d: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The directory's safetensors file(s), and for a sharded model its index's weight_map."""
    if (d / WEIGHTS_FILE).is_file():
        return [d / WEIGHTS_FILE], None
    if (d / INDEX_FILE).is_file():
        index = read_json_object(d / INDEX_FILE, "a safetensors index (model.safetensors.index.json)")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise UserError(f"{d / INDEX_FILE} has no weight_map (not a safetensors index)")
        values = list(weight_map.values())
        bad = [repr(n) for n in values if not isinstance(n, str) or Path(n).name != n or n in ("", ".", "..")]
        if bad:
            raise UserError(f"{d / INDEX_FILE} names shard files outside its directory ({bad[0]}); "
                            f"only plain file names beside it are read, fix the index")
        files = [d / f for f in sorted(set(values))]
        for f in files:
            if not f.is_file():
                raise UserError(f"{f} (named in {INDEX_FILE}) is missing; download it too")
        return files, weight_map
    pickles = [p.name for pattern in ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack")
               for p in sorted(d.glob(pattern))]
    if pickles:
        raise UserError(
            f"{d} has no {WEIGHTS_FILE}, only {', '.join(pickles[:3])}: pickle and other non-safetensors "
            f"files are not read "
            f"(loading them can run arbitrary code); make safetensors in a trusted environment with "
            f"AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR, safe_serialization=True) "
            f"or download model.safetensors from the Hub")
    raise UserError(f"{d} has no {WEIGHTS_FILE}; download the model's safetensors weights "
                    f"(config.json + model.safetensors)")


def _open_weights(d: Path) -> dict[str, Any]:
    """name -> safetensors handle for every tensor in the directory's safetensors file(s). A
    sharded model's tensors are read from the shard its index names, as `transformers` loads them:
    a tensor the index places in a shard that lacks it is an error, not a silent pick of another."""
    from safetensors import safe_open

    files, weight_map = _weight_files(d)
    opened: dict[str, Any] = {}
    for f in files:
        try:
            opened[f.name] = safe_open(str(f), framework="numpy")
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise UserError(f"{f} is not a readable safetensors file "
                            f"({' '.join(str(e).split())[:160]}); download it again") from None
    if weight_map is None:
        return {k: h for h in opened.values() for k in h.keys()}
    names = {file: set(h.keys()) for file, h in opened.items()}
    for name, file in weight_map.items():
        if name not in names[file]:
            raise UserError(f"{d / file} lacks {name}, which {INDEX_FILE} places there; the shards and "
                            f"their index do not match, download them again")
    return {name: opened[file] for name, file in weight_map.items()}


def hf_dir_config(hf_dir: str | Path) -> tuple[dict, ModelConfig]:
    """A Hugging Face model directory's config.json, checked, and the ModelConfig it describes:
    what `load_hf` reads before the weights, and --from_hf before anything (the tokenizer is
    checked against it before gigabytes of weights are read)."""
    d = Path(hf_dir)
    if not d.is_dir():
        raise UserError(f"Hugging Face model directory {d} does not exist (pass a directory with "
                        f"config.json and model.safetensors)")
    if not (d / CONFIG_FILE).is_file():
        raise UserError(f"{d} has no {CONFIG_FILE}; a Hugging Face GPT-2 directory needs config.json "
                        f"and model.safetensors")
    hf = _read_hf_config(d / CONFIG_FILE)
    return hf, config_from_hf(hf, str(d / CONFIG_FILE))


def load_hf(hf_dir: str | Path, config: tuple[dict, ModelConfig] | None = None
            ) -> tuple[ModelConfig, dict[str, Any]]:
    """Read a Hugging Face GPT-2 directory: (ModelConfig, our parameters as float32 numpy arrays).
    `config`: its `hf_dir_config`, where the caller has read it already."""
    d = Path(hf_dir)
    hf, cfg = config or hf_dir_config(d)
    handles = _open_weights(d)
    gpt2 = hf.get("model_type") == "gpt2"
    prefix = "transformer." if gpt2 and "transformer.wte.weight" in handles else ""

    def read(name: str, shape: tuple[int, ...], key: str | None = None) -> np.ndarray:
        key = key or prefix + name
        if key not in handles:
            raise UserError(f"{d} is missing tensor {key} (expected shape {list(shape)}); "
                            f"the weights do not match config.json or the file is incomplete")
        found = tuple(handles[key].get_slice(key).get_shape())
        if found != shape:
            raise UserError(f"tensor {key} in {d} has shape {list(found)}, expected {list(shape)} "
                            f"(from config.json); the weights do not match the config")
        a = handles[key].get_tensor(key)
        if not np.issubdtype(a.dtype, np.floating) and a.dtype.name != "bfloat16":
            raise UserError(f"tensor {key} in {d} has dtype {a.dtype}, expected floating point")
        a = np.asarray(a, dtype=np.float32)
        if not np.isfinite(a).all():
            raise UserError(f"tensor {key} in {d} contains NaN or infinite values; the weights are corrupt")
        return a

    # The last layer's first: a layer count far past the files' (num_hidden_layers=10**7) built a
    # table of every tensor's name, gigabytes, before the first missing one was reported.
    last = cfg.n_layer - 1
    read(f"h.{last}.ln_1.weight" if gpt2 else f"model.layers.{last}.input_layernorm.weight", (cfg.n_embd,))
    shapes = _hf_shapes(cfg) if gpt2 else llama.hf_shapes(cfg)
    t = {name: read(name, shape) for name, shape in shapes.items()}
    if not gpt2:
        return cfg, llama.params_from_hf(t, cfg)
    # Our LM head is the token embedding. A tied HF model ignores any stored lm_head.weight; an
    # untied one is accepted only if its head equals the embedding anyway.
    if hf.get("tie_word_embeddings", True) is False:
        head = read("", (cfg.vocab_size, cfg.n_embd), "lm_head.weight") if "lm_head.weight" in handles \
            else None
        if head is None or not np.array_equal(head, t["wte.weight"]):
            raise UserError(f"{d} has an LM head that is not tied to the token embedding "
                            f"(tie_word_embeddings false); this model ties them, so it cannot be converted")
    return cfg, params_from_hf(t, cfg)


def params_from_hf(t: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, Any]:
    """Our parameter tree from HF tensors (names without the "transformer." prefix)."""
    D, H, K, L = cfg.n_embd, cfg.n_head, cfg.head_dim, cfg.n_layer
    wte = np.zeros((cfg.padded_vocab_size, D), np.float32)
    wte[: cfg.vocab_size] = t["wte.weight"]
    reshape = {
        "w_qkv": (D, 3, H, K), "b_qkv": (3, H, K), "w_o": (H, K, D),
    }
    blocks = {}
    for suffix, ours in _LAYER_KEYS.items():
        layers = [t[f"h.{i}.{suffix}"] for i in range(L)]
        if ours in reshape:
            layers = [x.reshape(reshape[ours]) for x in layers]
        blocks[ours] = np.stack(layers)
    return {"wte": wte, "wpe": np.array(t["wpe.weight"], np.float32),
            "lnf_scale": t["ln_f.weight"], "lnf_bias": t["ln_f.bias"], "blocks": blocks}


# ----------------------------------------------------------------------------- writing


def gpt2_differences(cfg: ModelConfig) -> list[str]:
    """What keeps `cfg` from being a GPT-2 model (empty: it is one)."""
    want = dict(pos_embedding="learned", norm="layernorm", mlp="gelu", n_kv_head=0, head_size=0,
                qkv_bias=False, qk_norm=False, tie_embeddings=True, norm_eps=1e-5)
    diff = [f"{k}={getattr(cfg, k)}" for k, v in want.items() if getattr(cfg, k) not in (v,)]
    if cfg.ffn_dim not in (0, 4 * cfg.n_embd):
        diff.append(f"ffn_dim={cfg.ffn_dim}")
    return diff


def check_gpt2_compatible(cfg: ModelConfig) -> None:
    if not cfg.bias:
        raise UserError("this model has no biases (bias=False); Hugging Face GPT-2 always has them, "
                        "so it cannot be exported as GPT-2")
    if cfg.pos_embedding != "learned":
        raise UserError(f"this model uses {cfg.pos_embedding} position embeddings; Hugging Face GPT-2 "
                        f"needs learned ones, so it cannot be exported as GPT-2")
    diff = gpt2_differences(cfg)
    if diff:
        raise UserError(f"this model ({', '.join(diff)}) is not a GPT-2 model and not Llama-family "
                        f"(rope + rmsnorm + swiglu), so it cannot be exported to Hugging Face")


def check_not_moe(cfg: ModelConfig) -> None:
    if cfg.n_expert:
        raise UserError(f"this model has mixture-of-experts layers (n_expert={cfg.n_expert}); exporting them "
                        f"to Hugging Face is not supported")


def is_llama_family(cfg: ModelConfig) -> bool:
    return cfg.pos_embedding == "rope" or cfg.norm == "rmsnorm" or cfg.mlp == "swiglu"


def hf_tensors(params: dict[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """HF GPT-2 tensors ("transformer." prefix, float32, contiguous) from our parameter tree."""
    check_gpt2_compatible(cfg)
    D, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size

    def arr(x, shape, name):
        a = np.asarray(x, dtype=np.float32)
        if a.shape != shape:
            raise UserError(f"parameter {name} has shape {list(a.shape)}, expected {list(shape)} "
                            f"for the recorded config; the checkpoint is inconsistent")
        return a

    try:
        b = params["blocks"]
        out = {
            "wte.weight": arr(params["wte"], (cfg.padded_vocab_size, D), "wte")[:V],
            "wpe.weight": arr(params["wpe"], (cfg.block_size, D), "wpe"),
            "ln_f.weight": arr(params["lnf_scale"], (D,), "lnf_scale"),
            "ln_f.bias": arr(params["lnf_bias"], (D,), "lnf_bias"),
        }
        ours_shapes = {
            "ln1_scale": (D,), "ln1_bias": (D,), "w_qkv": (D, 3, cfg.n_head, cfg.head_dim),
            "b_qkv": (3, cfg.n_head, cfg.head_dim), "w_o": (cfg.n_head, cfg.head_dim, D), "b_o": (D,),
            "ln2_scale": (D,), "ln2_bias": (D,), "w_fc": (D, 4 * D), "b_fc": (4 * D,),
            "w_proj": (4 * D, D), "b_proj": (D,),
        }
        hf_shapes = _hf_shapes(cfg)
        for suffix, ours in _LAYER_KEYS.items():
            stacked = arr(b[ours], (L, *ours_shapes[ours]), f"blocks.{ours}")
            for i in range(L):
                out[f"h.{i}.{suffix}"] = stacked[i].reshape(hf_shapes[f"h.{i}.{suffix}"])
    except KeyError as e:
        raise UserError(f"parameter {e.args[0]} is missing; the checkpoint is not a GPT-2 style model") \
            from None
    return {f"transformer.{k}": np.ascontiguousarray(v) for k, v in out.items()}


def to_hf(params: dict[str, Any], cfg: ModelConfig, hf_dir: str | Path, *, eot_id: Any = _UNSET,
          dropout: float = 0.0, overwrite: bool = False, source_type: str | None = None,
          bos_id: int | None = None, stop_ids: Sequence[int] = (),
          files: dict[str, bytes] | None = None, keep: Sequence[tuple[str, Path]] = ()) -> Path:
    """Write `config.json` + `model.safetensors` loadable by AutoModelForCausalLM.from_pretrained:
    GPT2LMHeadModel, or for the modern block Llama/Qwen2/Qwen3 (Mistral if it came from one).
    `stop_ids`: the model's other EOS ids, written after eot_id as the config's list of them.
    `files`: more files to write beside them (the tokenizer.json a converted model came with).
    `overwrite` and `keep`: as `check_hf_dest`.
    """
    check_not_moe(cfg)
    if is_llama_family(cfg):
        llama.check_compatible(cfg)
        tensors = llama.hf_tensors(params, cfg)
        eos = None if eot_id is _UNSET else eot_id
        config = llama.hf_config(cfg, llama.model_type_for(cfg, source_type), eos if bos_id is None else bos_id,
                                 eos)
    else:
        tensors, config = hf_tensors(params, cfg), hf_config(cfg, eot_id, dropout)
    if stop_ids:
        config["eos_token_id"] = [config["eos_token_id"], *stop_ids]
    dest = Path(hf_dir).absolute()
    recover_killed_write(dest)
    check_hf_dest(dest, overwrite, keep)
    write_model_dir(dest, config, tensors, files or {})
    return dest


def check_hf_dest(dest: Path, overwrite: bool, keep: Sequence[tuple[str, Path]] = ()) -> None:
    """An existing non-empty `dest` is replaced only with `overwrite`, and only if it looks like a
    model directory (holds config.json), and never if it is or holds one of the `keep` (what,
    path) pairs: the checkpoint exported, a LoRA run's base."""
    if dest.exists() and not dest.is_dir():
        raise UserError(f"{dest} exists and is not a directory; pass a new --hf_dir")
    nonempty = dest.is_dir() and any(dest.iterdir())
    if nonempty and not overwrite:
        raise UserError(f"{dest} already exists and is not empty; pass --overwrite to replace it "
                        f"or choose another --hf_dir")
    if nonempty and not (dest / CONFIG_FILE).is_file():
        raise UserError(f"{dest} is not empty and holds no config.json, so it does not look like a "
                        f"model directory; refusing to replace it, choose another --hf_dir")
    if (dest / "checkpoints").exists():  # a model converted in place: replacing it would delete them
        raise UserError(f"{dest} holds checkpoints/ (a training or conversion output); refusing to replace "
                        f"it, choose another --hf_dir")
    for what, path in keep:
        path = Path(path).resolve()
        if nonempty and (path == dest.resolve() or dest.resolve() in path.parents):
            raise UserError(f"--hf_dir {dest} holds {what} {path}; replacing it would delete that, choose "
                            f"another --hf_dir")


def recover_killed_write(dest: Path) -> None:
    """What a `write_model_dir` killed part way left beside `dest`: its temporary copy
    (.NAME.PID.*.tmp, a whole model's bytes, hidden) is removed, and the previous model, moved to
    .NAME.old-PID just before the new one took its place, is put back where `dest` is missing.
    Only the leftovers of processes no longer running are touched."""
    # Exactly the names write_model_dir gives (mkdtemp's random part is [a-z0-9_]): a looser match
    # took a sibling export's (`dest.name` + ".5": ".NAME.5.old-PID") or a user's ".NAME.2024".
    ours = re.compile(rf"\.{re.escape(dest.name)}\."
                      rf"(?:old-(?P<old>[0-9]{{1,9}})|(?P<pid>[0-9]{{1,9}})\.[a-z0-9_]+\.tmp)")
    for p in sorted(dest.parent.glob(glob.escape(f".{dest.name}.") + "*")):
        m = ours.fullmatch(p.name)
        if m is None or not p.is_dir():
            continue
        old, pid = m["old"] is not None, m["old"] or m["pid"]
        if _running(int(pid)):
            continue
        if old and not dest.exists():
            os.replace(p, dest)
        else:
            shutil.rmtree(p, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def write_model_dir(dest: Path, config: dict, tensors: dict[str, np.ndarray], files: dict[str, bytes]) -> None:
    """The directory appears complete or not at all: every file is written and synced into a
    temporary sibling directory, which then takes `dest`'s place."""
    from safetensors.numpy import save_file

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.{os.getpid()}.", suffix=".tmp", dir=dest.parent))
    try:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        for f in (CONFIG_FILE, WEIGHTS_FILE, *files):
            with open(tmp / f, "rb") as fh:
                os.fsync(fh.fileno())
        os.chmod(tmp, 0o755)
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            os.replace(dest, old)  # an empty dir, or a model dir we were told to overwrite
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ----------------------------------------------------------------------------- commands


def from_hf_to_checkpoint(hf_dir: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> str:
    """--from_hf, holding out_dir's lock (`ckpt.hold_out_dir`: no training run writes there meanwhile;
    a lock this process held before the call stays held)."""
    from gpt import checkpoint as ckpt
    held = ckpt.holds_out_dir(out_dir)
    try:
        return _from_hf_to_checkpoint(hf_dir, out_dir, overwrite=overwrite)
    finally:
        if not held:
            ckpt.release_out_dir(out_dir)


def _from_hf_to_checkpoint(hf_dir: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> str:
    from gpt import checkpoint as ckpt

    out = Path(out_dir)
    for d in (out, *out.parents):
        if d.exists() and not d.is_dir():
            raise UserError(f"--out_dir {out}: {d} is a file, not a folder; choose another --out_dir")
    if out.absolute() == Path(hf_dir).absolute():
        raise UserError(f"--out_dir is the Hugging Face directory {out} itself; choose another --out_dir")
    ckpt.hold_out_dir(out)
    ckpt.settle_aside(out, out.absolute() / ckpt.ASIDE)  # an earlier --overwrite that died first
    steps = ckpt.list_steps(out)
    if ckpt.foreign_entries(out):
        raise UserError(f"{ckpt.checkpoint_dir(out)} holds files our conversions never write "
                        f"({', '.join(ckpt.foreign_entries(out)[:3])}); choose another --out_dir")
    if steps and not overwrite:
        raise UserError(f"{out} already holds checkpoints (steps {steps}); pass --overwrite to replace "
                        f"them or choose another --out_dir")
    hf, cfg = hf_dir_config(hf_dir)  # the tokenizer and the out_dir's own checked before the weights
    tokenizer = hf_dir_tokenizer(Path(hf_dir), cfg)
    from gpt.tokenizer import HF_FILE, atomic_write_bytes
    new_tokenizer = _tokenizer_dest_is_new(out, steps, tokenizer[1] if tokenizer is not None else None)
    cfg, params = load_hf(hf_dir, (hf, cfg))
    meta: dict[str, Any] = {"format_version": ckpt.FORMAT_VERSION, "step": 0,
                            "config": {"model": to_dict(cfg), "train": {}},
                            "source": str(Path(hf_dir).absolute()), "hf_model_type": hf.get("model_type")}
    if tokenizer is not None:
        meta["tokenizer"] = tokenizer[0]
    else:
        print(f"warning: {hf_dir} has no tokenizer.json (and is not a GPT-2 model with GPT-2's "
              f"vocabulary), so no tokenizer is recorded; sampling from this checkpoint needs one",
              file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    ckpt.hold_out_dir(out)  # a folder new at the start is locked once made
    aside = ckpt.set_aside(out) if steps else None  # --overwrite: deleted only once the new one is saved
    try:
        if tokenizer is not None and tokenizer[1] is not None:  # before the checkpoint that names it: a
            atomic_write_bytes(out / HF_FILE, tokenizer[1])  # kill between the two left it unreadable
        c = ckpt.Checkpointer(out, keep=1, async_save=False)
        # Orbax refuses an empty pytree, so the (absent) optimizer state is a one-element placeholder;
        # restoring params only (abstract_opt_state=None) never reads it.
        c.save(0, params, {"none": np.zeros((), np.int32)}, meta, val_loss=None)
        c.close()
    except BaseException:
        if aside is None and new_tokenizer and not ckpt.list_steps(out):  # (--overwrite: settle_aside's)
            (out / HF_FILE).unlink(missing_ok=True)
        raise
    finally:
        ckpt.settle_aside(out, aside)
    padding = (cfg.padded_vocab_size - cfg.vocab_size) * cfg.n_embd
    n = sum(int(np.prod(a.shape)) for a in _leaves(params)) - padding
    return (f"converted {hf_dir} ({n / 1e6:.1f}M params, {cfg.n_layer} layers, n_embd {cfg.n_embd}, "
            f"vocab {cfg.vocab_size}) to {ckpt.checkpoint_dir(out)}/0")


def _tokenizer_dest_is_new(out: Path, steps: list[int], data: bytes | None) -> bool:
    """Whether --from_hf writes a tokenizer.json (`data`) where out had none (a failed conversion
    then removes it). One there without checkpoints beside it is someone else's (another model's
    folder, a tokenizer kept there): refused, not replaced, unless it holds these very bytes (a
    conversion of this model killed before its save). --overwrite sets it aside with its checkpoints."""
    from gpt.tokenizer import HF_FILE
    path = out / HF_FILE
    if data is None or steps or not path.exists():
        return data is not None
    if not (path.is_file() and path.read_bytes() == data):
        raise UserError(f"{path} is there already, with no checkpoints beside it, and is not this model's "
                        f"tokenizer.json; move it away or choose another --out_dir")
    return False


def hf_dir_tokenizer(hf_dir: Path, cfg) -> tuple[dict, bytes | None] | None:
    """(spec, tokenizer.json bytes to copy) for a Hugging Face model directory: GPT-2's tokenizer
    (our bundled tiktoken copy) for a GPT-2 model of GPT-2's vocabulary whose tokenizer.json, if
    any, is GPT-2's (`is_gpt2`), else its tokenizer.json with the model's BOS/EOS ids and its prompt
    template (a GPT-2-architecture model of another vocabulary or BPE too), else None. Validated
    here; nothing is written."""
    from gpt.tokenizer import HF_FILE, gpt2_tokenizer, hf_spec, hf_tokenizer, is_gpt2, warn_if_no_eos

    path = hf_dir / HF_FILE
    gpt2_sized = not is_llama_family(cfg) and cfg.vocab_size == GPT2_VOCAB
    if gpt2_sized and not path.exists():
        return gpt2_tokenizer().spec, None
    if not path.exists():
        return None
    data, hf, spec = hf_spec(path, f"fix or remove {path}")
    if gpt2_sized and is_gpt2(hf):
        return gpt2_tokenizer().spec, None
    tok = hf_tokenizer(data, hf, {**spec, "prompt_template": True}, path)
    if tok.vocab_size > cfg.vocab_size:
        raise UserError(f"{path} has {tok.vocab_size} tokens but the model's vocabulary is "
                        f"{cfg.vocab_size}; use the tokenizer.json that belongs to this model")
    warn_if_no_eos(tok, path)
    return tok.spec, data


def checkpoint_to_hf(out_dir: str | Path, hf_dir: str | Path, *, overwrite: bool = False) -> str:
    """Export the newest step of `out_dir` (a LoRA run's adapters merged into its base)."""
    from gpt import checkpoint as ckpt
    from gpt.config import compute_from_dict, model_from_dict
    from gpt.lora import restore_params

    step, meta = ckpt.read_meta(out_dir)
    try:
        cfg = model_from_dict(meta["config"]["model"])
        # Checkpoints written before ComputeConfig existed kept the dropout in the model's config.
        dropout = compute_from_dict(meta["config"].get("compute", meta["config"]["model"])).dropout
    except (KeyError, TypeError) as e:
        raise UserError(f"the checkpoint in {out_dir} (step {step}) has no model config ({e}); "
                        f"it is damaged") from None
    check_not_moe(cfg)
    if is_llama_family(cfg):
        llama.check_compatible(cfg)
    else:
        check_gpt2_compatible(cfg)
    step, _, params, meta = restore_params(out_dir)  # past a damaged newest step, as sampling does
    tok = meta.get("tokenizer")
    eot = tok.get("eot_id") if isinstance(tok, dict) and "eot_id" in tok else _UNSET
    source = meta.get("hf_model_type") if isinstance(meta.get("hf_model_type"), str) else None
    files, bos, stops = {}, None, ()
    if isinstance(tok, dict) and tok.get("kind") == "hf":  # its tokenizer.json goes along
        from gpt.tokenizer import HF_FILE, load_tokenizer
        hf_tok = load_tokenizer(tok, out_dir)  # checks the file against the recorded sha256
        bos, stops = hf_tok.bos_id, hf_tok.stop_ids
        files[HF_FILE] = (Path(out_dir) / hf_tok.files()[0]).read_bytes()
    keep = [("the checkpoint being exported", Path(out_dir))]
    if isinstance(meta.get("lora"), dict) and isinstance(meta["lora"].get("base"), dict):
        keep.append(("the LoRA run's base", Path(str(meta["lora"]["base"].get("path")))))
    dest = to_hf(params, cfg, hf_dir, eot_id=eot, dropout=dropout, overwrite=overwrite,
                 source_type=source, bos_id=bos, stop_ids=stops, files=files, keep=keep)
    return f"exported step {step} of {out_dir} ({cfg.n_layer} layers, n_embd {cfg.n_embd}, " \
           f"vocab {cfg.vocab_size}) to {dest}"


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    else:
        yield tree


def main(argv: Sequence[str]) -> int:
    p = ArgParser(prog="python -m gpt.convert",
                description="Convert between Hugging Face checkpoints (GPT-2, Llama, Mistral, Qwen2, Qwen3; "
                            "safetensors) and ours.")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--from_hf", metavar="HF_DIR",
                      help="import a Hugging Face dir (config.json + safetensors [+ tokenizer.json]) of "
                           "GPT-2, Llama, Mistral, Qwen2 or Qwen3")
    mode.add_argument("--to_hf", action="store_true", help="export --out_dir's newest checkpoint to --hf_dir")
    mode.add_argument("--merge_lora", action="store_true",
                      help="write a LoRA run's (--out_dir) adapters merged into its base to --merged_dir")
    p.add_argument("--out_dir", required=True, help="our checkpoint directory")
    p.add_argument("--hf_dir", help="with --to_hf: the Hugging Face directory to write")
    p.add_argument("--merged_dir", help="with --merge_lora: the new checkpoint directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace existing checkpoints / --hf_dir")
    a = p.parse_args(list(argv))
    if a.merged_dir and not a.merge_lora:
        raise UserError("--merged_dir is only used with --merge_lora")
    if a.merge_lora:
        if a.hf_dir or a.overwrite:
            raise UserError("--merge_lora writes only --merged_dir, a new or empty directory (no --hf_dir, "
                            "no --overwrite)")
        if not a.merged_dir:
            raise UserError("--merge_lora needs --merged_dir DIR (a new or empty directory for the merged "
                            "checkpoint)")
        from gpt.lora import write_merged
        print(write_merged(a.out_dir, a.merged_dir))
    elif a.to_hf:
        if not a.hf_dir:
            raise UserError("--to_hf needs --hf_dir DIR (where to write config.json, model.safetensors "
                            "and any tokenizer.json)")
        print(checkpoint_to_hf(a.out_dir, a.hf_dir, overwrite=a.overwrite))
    else:
        if a.hf_dir:
            raise UserError("--hf_dir is only used with --to_hf; with --from_hf the source is --from_hf DIR")
        print(from_hf_to_checkpoint(a.from_hf, a.out_dir, overwrite=a.overwrite))
    return 0


if __name__ == "__main__":
    run_main(main)
