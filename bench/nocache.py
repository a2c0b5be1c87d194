"""The no-cache decoding baseline (nanoGPT's loop): re-run the whole (cropped) context per token.

Not part of the library: the tests use it as the reference that cached decoding must equal (past
block_size only for learned/sinusoidal positions: RoPE models keep absolute positions in a rolling
cache instead, see tests/test_sampling.py), and bench/sample.py as the baseline it is timed against.
"""
from __future__ import annotations

import weakref
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from gpt.model import GPT
from gpt.sampling import SamplingSettings, sample_token

_RECOMPUTE_FNS: "weakref.WeakKeyDictionary[GPT, Any]" = weakref.WeakKeyDictionary()


def _last_logits_fn(model: GPT):
    """One jitted full forward per model, so repeated baseline runs do not recompile."""
    if model not in _RECOMPUTE_FNS:
        gd = nnx.graphdef(model)

        @jax.jit
        def last_logits(params, ctx_BT, last):
            logits, _ = nnx.merge(gd, params)(ctx_BT)
            return logits[:, last]
        _RECOMPUTE_FNS[model] = last_logits
    return _RECOMPUTE_FNS[model]


def full_recompute_generate(model: GPT, prompt: list[int], key: jax.Array, s: SamplingSettings
                            ) -> list[int]:
    """The no-cache baseline (nanoGPT's loop): re-run the whole (cropped) context for every token.

    """
    W = model.cfg.block_size
    params = nnx.state(model)
    last_logits = _last_logits_fn(model)
    ids = list(prompt)
    for _ in range(s.max_new_tokens):
        ctx = ids[-W:]
        # Right-pad to a multiple of 32 so lengths share compilations; causal attention means the
        # padding cannot change the logits at the last real position.
        padded = min(-(-len(ctx) // 32) * 32, W)
        ctx_BT = jnp.array([ctx + [0] * (padded - len(ctx))], jnp.int32)
        key, sub = jax.random.split(key)
        tok = int(sample_token(sub, last_logits(params, ctx_BT, len(ctx) - 1), s)[0])
        ids.append(tok)
        if tok in s.end_ids:
            break
    return ids[len(prompt):]
