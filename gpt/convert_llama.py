"""Hugging Face Llama-family checkpoints (Llama, Mistral, Qwen2, Qwen3) <-> our parameters.

gpt/convert.py reads and writes the directories (config.json, safetensors, atomic output); this
module maps their configs and tensors. Layout (torch Linear weights are [out, in], ours [in, out]):
    model.embed_tokens.weight [V, D]        <-> wte [V_padded, D]
    lm_head.weight [V, D] (untied models)   <-> w_head [V_padded, D]
    layers.i.input_layernorm.weight         <-> blocks.ln1_scale[i]
    layers.i.self_attn.{q,k,v}_proj.weight  <-> blocks.w_qkv[i] [D, 3, H, K] (n_kv_head == n_head)
                                                or w_q[i] [D, H, K] and w_kv[i] [D, 2, G, K]
    layers.i.self_attn.{q,k,v}_proj.bias    <-> b_qkv / b_q, b_kv (Qwen2)
    layers.i.self_attn.{q,k}_norm.weight    <-> q_norm / k_norm [K] (Qwen3)
    layers.i.self_attn.o_proj.weight [D, H*K] <-> w_o[i] [H, K, D]
    layers.i.post_attention_layernorm       <-> ln2_scale[i]
    layers.i.mlp.{gate,up}_proj.weight      <-> w_fc[i] [D, 2, F];  down_proj <-> w_proj[i] [F, D]
    model.norm.weight                       <-> lnf_scale
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from gpt.config import ModelConfig, validate_model
from gpt.errors import UserError

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


DEFAULT_WINDOW = 4096  # transformers' sliding_window for Mistral (and Qwen2/3 with use_sliding_window)
QWEN3_HEAD_DIM = 128  # Qwen3Config's head_dim where config.json has none (not hidden / heads)
ROPE_SCALINGS = ("linear", "llama3")  # a fixed change of the frequencies (gpt.model.rope_frequencies)


def _number(d: dict[str, Any], key: str, where: str, integer: bool = False) -> float:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)) or not 0 < v < math.inf:
        raise UserError(f"{where}: {key}={v!r} must be a positive {'integer' if integer else 'number'}")
    return v


def _optional_int(hf: dict[str, Any], key: str, default: int, where: str) -> int:
    """hf[key], or `default` where it is absent or null (the weights' shapes are checked against
    it later). A value that is set must be a positive integer: `hf.get(key) or default` took 0 for
    unset and True for 1."""
    return default if hf.get(key) is None else int(_number(hf, key, where, integer=True))


def hf_bool(hf: dict[str, Any], key: str, default: bool, where: str) -> bool:
    """hf[key] (`default` where absent), which must be true or false: bool("false") is True, which
    read an untied head as tied and dropped it."""
    v = hf.get(key, default)
    if not isinstance(v, bool):
        raise UserError(f"{where}: {key}={v!r} must be true or false")
    return v


def _rope(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Our RoPE fields from the config: rope_theta (top level, or transformers 5's rope_parameters)
    and the scaling of rope_parameters or the older rope_scaling. Linear and Llama 3's scaling are
    a fixed change of the frequencies; YaRN's and the dynamic kinds also change the attention or
    depend on the length, and are refused."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise UserError(f"{where}: rope_parameters={params!r} is not an object of RoPE settings")
    if hf.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UserError(f"{where}: partial_rotary_factor is not supported (RoPE over the whole head)")
    out: dict[str, Any] = {}
    for d in (params, scaling):
        kind = d.get("rope_type", d.get("type", "default")) if isinstance(d, dict) else d
        if kind == "default" or out:
            continue
        if kind not in ROPE_SCALINGS:
            raise UserError(f"{where}: rope scaling {kind!r} is not supported (plain RoPE, 'linear' and "
                            f"'llama3' are); use a model without it")
        fields = d if isinstance(d, dict) else {}
        get = lambda key: _number(fields, key, where, integer=key.startswith("original"))  # noqa: E731
        out = {"rope_scaling": kind, "rope_factor": float(get("factor"))}
        if kind == "llama3":
            out.update(rope_low_freq_factor=float(get("low_freq_factor")),
                       rope_high_freq_factor=float(get("high_freq_factor")),
                       rope_original_context=get("original_max_position_embeddings"))
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    return {"rope_theta": float(_number({"rope_theta": theta}, "rope_theta", where)), **out}


def hf_rope(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json keys of `cfg`'s RoPE: rope_theta, transformers 5's rope_parameters and, for
    a scaled RoPE, the rope_scaling that transformers 4 reads."""
    out: dict[str, Any] = {"rope_theta": cfg.rope_theta,
                           "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}
    if cfg.rope_scaling == "none":
        return out
    scaling = {"rope_type": cfg.rope_scaling, "factor": cfg.rope_factor}
    if cfg.rope_scaling == "llama3":
        scaling.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                       original_max_position_embeddings=cfg.rope_original_context)
    out["rope_parameters"] = {**scaling, "rope_theta": cfg.rope_theta}
    out["rope_scaling"] = scaling
    return out


def _qwen_slides(hf: dict[str, Any], where: str) -> bool:
    """Whether a Qwen config's window applies to any layer: with use_sliding_window, transformers
    slides the layers from max_window_layers on (default 28), or those its layer_types name."""
    if not hf_bool(hf, "use_sliding_window", False, where):
        return False
    if isinstance(hf.get("layer_types"), list):
        return "sliding_attention" in hf["layer_types"]
    layers, full = hf.get("num_hidden_layers"), hf.get("max_window_layers", 28)
    return not (isinstance(layers, int) and isinstance(full, int) and layers <= full)


def _check_unsupported(hf: dict[str, Any], model_type: str, where: str) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"{where}: hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    # transformers' default where the key is left out (Mistral's, and Qwen's with use_sliding_window)
    window, context = hf.get("sliding_window", DEFAULT_WINDOW), hf.get("max_position_embeddings")
    covers = isinstance(window, int) and isinstance(context, int) and window >= context  # full attention
    if window is not None and (model_type == "mistral" or _qwen_slides(hf, where)) and not covers:
        raise UserError(f"{where}: sliding-window attention (sliding_window={window}, shorter than "
                        f"max_position_embeddings={context}) is not supported; set sliding_window to "
                        f"null for full attention")
    for key in ("attention_bias", "mlp_bias"):  # "false" (a string) is neither: refused as such
        if hf_bool(hf, key, False, where):
            raise UserError(f"{where}: {key}=true is not supported (Llama-family models without "
                            f"biases, or Qwen2's q/k/v biases, are)")


def config_from_hf(hf: dict[str, Any], where: str, get_int: Callable[..., int]) -> ModelConfig:
    """Our ModelConfig from a Llama/Mistral/Qwen2/Qwen3 config dict."""
    model_type = hf["model_type"]
    _check_unsupported(hf, model_type, where)
    D, H = get_int("hidden_size"), get_int("num_attention_heads")
    G = _optional_int(hf, "num_key_value_heads", H, where)
    head = _optional_int(hf, "head_dim", QWEN3_HEAD_DIM if model_type == "qwen3" else D // H, where)
    eps = _number({"rms_norm_eps": hf.get("rms_norm_eps", 1e-6)}, "rms_norm_eps", where)
    tie = hf_bool(hf, "tie_word_embeddings", False, where)  # transformers' default for all four
    cfg = ModelConfig(
        vocab_size=get_int("vocab_size"), block_size=get_int("max_position_embeddings"),
        n_layer=get_int("num_hidden_layers"), n_head=H, n_embd=D,
        n_kv_head=0 if G == H else G, head_size=0 if head * H == D else head,
        ffn_dim=get_int("intermediate_size"), bias=False, qkv_bias=model_type == "qwen2",
        pos_embedding="rope", **_rope(hf, where), norm="rmsnorm", norm_eps=float(eps),
        mlp="swiglu", qk_norm=model_type == "qwen3",
        tie_embeddings=tie)
    try:
        return validate_model(cfg)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of `cfg` and its shape."""
    D, H, G, K, F, V = cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.ffn, cfg.vocab_size
    layer = {"input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
             "self_attn.q_proj.weight": (H * K, D), "self_attn.k_proj.weight": (G * K, D),
             "self_attn.v_proj.weight": (G * K, D), "self_attn.o_proj.weight": (D, H * K),
             "mlp.gate_proj.weight": (F, D), "mlp.up_proj.weight": (F, D), "mlp.down_proj.weight": (D, F)}
    if cfg.qkv_bias:
        layer.update({"self_attn.q_proj.bias": (H * K,), "self_attn.k_proj.bias": (G * K,),
                      "self_attn.v_proj.bias": (G * K,)})
    if cfg.qk_norm:
        layer.update({"self_attn.q_norm.weight": (K,), "self_attn.k_norm.weight": (K,)})
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (V, D)
    for i in range(cfg.n_layer):
        shapes.update({f"model.layers.{i}.{k}": s for k, s in layer.items()})
    return shapes


def _pad_vocab(a: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    out = np.zeros((cfg.padded_vocab_size, a.shape[1]), np.float32)
    out[: cfg.vocab_size] = a
    return out


def _layer_params(t: Callable[[str], np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    D, H, G, K = cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.head_dim
    w = lambda name, *shape: t(f"self_attn.{name}_proj.weight").T.reshape(D, *shape)
    b = lambda name, *shape: t(f"self_attn.{name}_proj.bias").reshape(*shape)
    p = {"ln1_scale": t("input_layernorm.weight"), "ln2_scale": t("post_attention_layernorm.weight"),
         "w_o": t("self_attn.o_proj.weight").T.reshape(H, K, D),
         "w_fc": np.stack([t("mlp.gate_proj.weight").T, t("mlp.up_proj.weight").T], axis=1),
         "w_proj": t("mlp.down_proj.weight").T}
    if G == H:
        p["w_qkv"] = np.stack([w("q", H, K), w("k", H, K), w("v", H, K)], axis=1)
        if cfg.qkv_bias:
            p["b_qkv"] = np.stack([b("q", H, K), b("k", H, K), b("v", H, K)])
    else:
        p["w_q"], p["w_kv"] = w("q", H, K), np.stack([w("k", G, K), w("v", G, K)], axis=1)
        if cfg.qkv_bias:
            p["b_q"], p["b_kv"] = b("q", H, K), np.stack([b("k", G, K), b("v", G, K)])
    if cfg.qk_norm:
        p["q_norm"], p["k_norm"] = t("self_attn.q_norm.weight"), t("self_attn.k_norm.weight")
    return p


def params_from_hf(t: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, Any]:
    """Our parameter tree from HF tensors."""
    layers = [_layer_params(lambda k, i=i: t[f"model.layers.{i}.{k}"], cfg) for i in range(cfg.n_layer)]
    params: dict[str, Any] = {
        "wte": _pad_vocab(t["model.embed_tokens.weight"], cfg), "lnf_scale": t["model.norm.weight"],
        "blocks": {k: np.stack([layer[k] for layer in layers]) for k in layers[0]}}
    if not cfg.tie_embeddings:
        params["w_head"] = _pad_vocab(t["lm_head.weight"], cfg)
    return params


def hf_tensors(params: dict[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """HF tensors (float32) from our parameter tree: the inverse of `params_from_hf`."""
    D, H, G, K, V = cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.vocab_size
    f32 = lambda x: np.asarray(x, np.float32)
    bl = {k: f32(v) for k, v in params["blocks"].items()}
    out = {"model.embed_tokens.weight": f32(params["wte"])[:V], "model.norm.weight": f32(params["lnf_scale"])}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = f32(params["w_head"])[:V]
    for i in range(cfg.n_layer):
        if G == H:
            q, k, v = (bl["w_qkv"][i][:, j] for j in range(3))
            qb, kb, vb = (bl["b_qkv"][i][j] for j in range(3)) if cfg.qkv_bias else (None,) * 3
        else:
            q, k, v = bl["w_q"][i], bl["w_kv"][i][:, 0], bl["w_kv"][i][:, 1]
            qb, kb, vb = (bl["b_q"][i], bl["b_kv"][i][0], bl["b_kv"][i][1]) if cfg.qkv_bias else (None,) * 3
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": bl["ln1_scale"][i],
                    p + "post_attention_layernorm.weight": bl["ln2_scale"][i],
                    p + "self_attn.q_proj.weight": q.reshape(D, H * K).T,
                    p + "self_attn.k_proj.weight": k.reshape(D, G * K).T,
                    p + "self_attn.v_proj.weight": v.reshape(D, G * K).T,
                    p + "self_attn.o_proj.weight": bl["w_o"][i].reshape(H * K, D).T,
                    p + "mlp.gate_proj.weight": bl["w_fc"][i][:, 0].T,
                    p + "mlp.up_proj.weight": bl["w_fc"][i][:, 1].T,
                    p + "mlp.down_proj.weight": bl["w_proj"][i].T})
        if cfg.qkv_bias:
            out.update({p + "self_attn.q_proj.bias": qb.reshape(-1), p + "self_attn.k_proj.bias": kb.reshape(-1),
                        p + "self_attn.v_proj.bias": vb.reshape(-1)})
        if cfg.qk_norm:
            out.update({p + "self_attn.q_norm.weight": bl["q_norm"][i],
                        p + "self_attn.k_norm.weight": bl["k_norm"][i]})
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def check_compatible(cfg: ModelConfig) -> None:
    """A Llama-family export needs the modern block exactly."""
    want = {"pos_embedding": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False}
    bad = [f"{k}={getattr(cfg, k)}" for k, v in want.items() if getattr(cfg, k) != v]
    if bad:
        raise UserError(f"this model ({', '.join(bad)}) is neither GPT-2 nor Llama-family; Hugging Face "
                        f"Llama/Qwen export needs pos_embedding=rope, norm=rmsnorm, mlp=swiglu, bias=False")
    if cfg.qk_norm and cfg.qkv_bias:
        raise UserError("this model has both qk_norm and qkv_bias; no Hugging Face architecture has both")


def model_type_for(cfg: ModelConfig, source: str | None = None) -> str:
    """qwen3 for QK-norm, qwen2 for q/k/v biases, else the imported type (llama or mistral)."""
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias:
        return "qwen2"
    return source if source in ("llama", "mistral") else "llama"


def hf_config(cfg: ModelConfig, model_type: str, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """A config.json for `AutoModelForCausalLM.from_pretrained`."""
    config = {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
        "hidden_size": cfg.n_embd, "intermediate_size": cfg.ffn, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.block_size, **hf_rope(cfg),
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True, "dtype": "float32",
        "bos_token_id": bos_id, "eos_token_id": eos_id,
    }
    if model_type in ("llama", "mistral", "qwen3"):
        config.update(attention_bias=False)
    if model_type == "llama":
        config.update(mlp_bias=False)
    if model_type != "llama":
        config.update(sliding_window=None, use_sliding_window=False)
    return config
