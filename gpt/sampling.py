"""KV-cached autoregressive sampling with temperature, top-k and renormalized top-p.

`prefill` runs the (left-padded) prompts through the model once, filling a preallocated cache
(`gpt.model.KVCache`); `decode` then generates one token per step attending to the cache, inside a
`lax.scan`, so nothing is retraced per token. Both are pure functions of arrays, usable inside other
JAX code; `Sampler` jits them once per settings and decodes in chunks for streaming.

Past `block_size`, every new token attends to the last `block_size` tokens. With learned or
sinusoidal positions the sampler does what nanoGPT does: the window is recomputed at positions
0..block_size-1 for each token (they shift with each token, so the cache cannot be reused; a
`lax.cond` branch). With RoPE or no position embedding attention depends only on relative
positions, so the cache becomes a ring of the last `block_size` tokens at their absolute positions
(see `KVCache`) and decoding stays one cached step per token. That is sliding-window attention of
width block_size in every layer, as Mistral's: a deeper layer still carries, through the keys it
attends to, what has left the window. A longer prompt goes through the same window (`fill_cache`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gpt.config import check_sampling
from gpt.errors import UserError
from gpt.model import GPT, KVCache, decode_kernels_problem, for_decoding, init_cache, slot_tokens
from gpt.runtime import decode_kernels_on


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int = 100
    temperature: float = 1.0  # 0: greedy (argmax)
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    eot_id: int | None = None  # generation of a row stops after it emits this token
    stop_ids: tuple[int, ...] = ()  # more ids that end a row (a model's other EOS ids); need eot_id

    def __post_init__(self):  # as the command line's: a negative temperature drew padding ids
        check_sampling(self.temperature, self.top_k, self.top_p)
        if self.max_new_tokens < 0:
            raise UserError(f"max_new_tokens={self.max_new_tokens} must be zero or more")

    @property
    def end_ids(self) -> tuple[int, ...]:
        """Every id that ends a row; the first (eot_id) also fills the row after its end."""
        return () if self.eot_id is None else (self.eot_id, *self.stop_ids)

    def ends(self, tok: jax.Array) -> jax.Array:
        """Where `tok` holds an id that ends a row (all False without an eot_id)."""
        if not self.end_ids:
            return jnp.zeros(tok.shape, bool)
        return jnp.isin(tok, jnp.array(self.end_ids, jnp.int32))


# ----------------------------------------------------------------------------- filters


def _nucleus(sorted_BV: jax.Array, top_p: float) -> jax.Array:
    """Logits sorted in descending order with every entry past the top-p nucleus set to -inf: an
    entry is kept while the mass of the entries before it is below p (the first always is)."""
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # mass of strictly more likely tokens
    return jnp.where(before_BV < top_p, sorted_BV, -jnp.inf)


def _top_p(logits_BV: jax.Array, top_p: float) -> jax.Array:
    """Top-p over the whole vocabulary (a stable sort, so equal logits rank by index)."""
    order_BV = jnp.argsort(-logits_BV, axis=-1, stable=True)
    kept_BV = _nucleus(jnp.take_along_axis(logits_BV, order_BV, axis=-1), top_p)
    rows_B1 = jnp.arange(logits_BV.shape[0])[:, None]
    return jnp.full_like(logits_BV, -jnp.inf).at[rows_B1, order_BV].set(kept_BV)


def _top_k(logits_BV: jax.Array, top_k: int, top_p: float) -> tuple[jax.Array, jax.Array]:
    """The top_k largest logits in descending order (ties: lower index first) with top-p applied
    to them, and their vocabulary indices [B, k]."""
    vals_Bk, idx_Bk = jax.lax.top_k(logits_BV, top_k)
    return (_nucleus(vals_Bk, top_p) if top_p < 1.0 else vals_Bk), idx_Bk


def filter_logits(logits_BV: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """Logits / temperature, then top-k, then top-p; removed entries become -inf.

    top-k keeps exactly k entries (ties broken by lower index); top-p keeps the smallest set of the
    most likely tokens whose probability reaches p. A softmax of the result is the renormalized
    distribution the sampler draws from.
    """
    logits_BV = logits_BV.astype(jnp.float32) / temperature
    B, V = logits_BV.shape
    if 0 < top_k < V:
        vals_Bk, idx_Bk = _top_k(logits_BV, top_k, top_p)
        return jnp.full((B, V), -jnp.inf).at[jnp.arange(B)[:, None], idx_Bk].set(vals_Bk)
    return _top_p(logits_BV, top_p) if top_p < 1.0 else logits_BV


def sample_token(key: jax.Array, logits_BV: jax.Array, s: SamplingSettings) -> jax.Array:
    """A token per row from the filtered distribution (`filter_logits`); greedy at temperature 0.
    With top-k the draw is among the k kept entries only: the same distribution, without noise
    drawn for, and a pass over, the whole vocabulary per token."""
    if s.temperature == 0.0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    if 0 < s.top_k < logits_BV.shape[-1]:
        vals_Bk, idx_Bk = _top_k(logits_BV.astype(jnp.float32) / s.temperature, s.top_k, s.top_p)
        pick_B1 = jax.random.categorical(key, vals_Bk, axis=-1)[:, None]
        return jnp.take_along_axis(idx_Bk, pick_B1, axis=-1)[:, 0].astype(jnp.int32)
    filtered = filter_logits(logits_BV, s.temperature, s.top_k, s.top_p)
    return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)


# ----------------------------------------------------------------------------- the loop


class DecodeState(NamedTuple):
    tokens_BN: jax.Array  # left-padded prompt followed by generated tokens
    start_B: jax.Array  # first real token of each row in tokens_BN
    cache: KVCache
    next_logits_BV: jax.Array  # the model's prediction for position `pos`
    pos: jax.Array  # int32: where the next token goes in tokens_BN
    done_B: jax.Array  # rows that emitted the end-of-text token
    key: jax.Array


def rolls(cfg) -> bool:
    """Whether the cache rolls past block_size (relative positions) instead of recomputing."""
    return cfg.pos_embedding in ("rope", "none")


def _window_logits(model: GPT, tokens_BN: jax.Array, start_B: jax.Array, end: jax.Array,
                   dtype) -> jax.Array:
    """Next-token logits conditioned on the last block_size tokens before `end` (nanoGPT's crop)."""
    W = model.cfg.block_size
    B = tokens_BN.shape[0]
    first = end - W
    window_BW = jax.lax.dynamic_slice(tokens_BN, (0, first), (B, W))
    cache = init_cache(model.cfg, B, W, dtype, jnp.clip(start_B - first, 0, W - 1))
    logits_BWV, _ = model(window_BW, cache=cache)
    return logits_BWV[:, -1]


def fill_cache(model: GPT, prompt_BP: jax.Array, start_B: jax.Array, slots: int, dtype
               ) -> tuple[jax.Array, KVCache]:
    """(the last prompt token's logits [B, V], a cache of `slots` slots holding the prompts) for
    left-padded prompts whose real tokens start at start_B. A prompt longer than block_size is
    cropped to its last block_size tokens, as nanoGPT does, unless the cache rolls: there
    decoding is sliding-window attention of width block_size in every layer (as Mistral's), and
    the prompt goes through the same window (`_windowed_fill`), so where a prompt ends and
    generation begins changes nothing."""
    B, P = prompt_BP.shape
    W = model.cfg.block_size
    if rolls(model.cfg) and P > W:
        return _windowed_fill(model, prompt_BP, start_B, slots, dtype)
    P0 = min(P, W)
    cache = init_cache(model.cfg, B, slots, dtype, jnp.clip(start_B - (P - P0), 0, slots - 1))
    logits_BPV, cache = model(prompt_BP[:, P - P0:], cache=cache)
    return logits_BPV[:, -1], cache


def _windowed_fill(model: GPT, prompt_BP: jax.Array, start_B: jax.Array, slots: int, dtype
                   ) -> tuple[jax.Array, KVCache]:
    """`fill_cache` for a rolling cache and a prompt longer than its window W = block_size: the
    prompt in chunks of W (a shorter one first) through a ring of 2W slots with a per-row index
    (a chunk may wrap it), so every query sees the W tokens up to its own; then the newest tokens
    moved into a ring of `slots` (>= W), token t at slot t mod slots, with the shared index P."""
    B, P = prompt_BP.shape
    W = model.cfg.block_size
    ring = init_cache(model.cfg, B, 2 * W, dtype, start_B)._replace(index=jnp.zeros((B,), jnp.int32))
    first = P % W or W
    logits_BTV, ring = model(prompt_BP[:, :first], cache=ring)
    chunks_CBW = prompt_BP[:, first:].reshape(B, -1, W).transpose(1, 0, 2)

    def chunk(ring: KVCache, x_BW: jax.Array) -> tuple[KVCache, jax.Array]:
        logits_BWV, ring = model(x_BW, cache=ring)
        return ring, logits_BWV[:, -1]

    ring, last_CBV = jax.lax.scan(chunk, ring, chunks_CBW)
    from_S = jnp.mod(slot_tokens(jnp.array(P - 1), slots), 2 * W)  # where each new slot's token is
    cache = KVCache(jnp.take(ring.k_LBGKS, from_S, axis=-1), jnp.take(ring.v_LBGSK, from_S, axis=-2),
                    jnp.array(P, jnp.int32), start_B)
    return (last_CBV[-1] if chunks_CBW.shape[0] else logits_BTV[:, -1]), cache


def prefill(model: GPT, prompt_BP: jax.Array, start_B: jax.Array, key: jax.Array,
            max_new_tokens: int, cache_dtype=None) -> DecodeState:
    """Fill the cache with the prompts (left-padded; row b's real tokens start at start_B[b])."""
    B, P = prompt_BP.shape
    S = min(P + max_new_tokens, model.cfg.block_size)
    tokens_BN = jnp.zeros((B, P + max_new_tokens), jnp.int32).at[:, :P].set(prompt_BP.astype(jnp.int32))
    start_B = start_B.astype(jnp.int32)
    last_BV, cache = fill_cache(model, prompt_BP, start_B, S, cache_dtype or model.rt.dtype)
    return DecodeState(tokens_BN, start_B, cache, last_BV, jnp.array(P, jnp.int32),
                       jnp.zeros((B,), bool), key)


def decode(model: GPT, state: DecodeState, n_steps: int, s: SamplingSettings) -> DecodeState:
    """Generate `n_steps` tokens into state.tokens_BN; rows that emitted eot keep emitting eot."""
    S = state.cache.slots
    overflow_possible = state.tokens_BN.shape[1] > model.cfg.block_size and not rolls(model.cfg)
    dtype = state.cache.v_LBGSK.dtype

    def step(st: DecodeState, _):
        key, sub = jax.random.split(st.key)
        tok_B = sample_token(sub, st.next_logits_BV, s)
        if s.eot_id is not None:
            tok_B = jnp.where(st.done_B, s.eot_id, tok_B)
        done_B = st.done_B | s.ends(tok_B)
        tokens_BN = jax.lax.dynamic_update_slice(st.tokens_BN, tok_B[:, None], (0, st.pos))

        def cached(_):
            logits_B1V, cache = model(tok_B[:, None], cache=st.cache)
            return logits_B1V[:, -1], cache

        def recompute(_):
            return _window_logits(model, tokens_BN, st.start_B, st.pos + 1, dtype), st.cache

        if overflow_possible:
            next_logits, cache = jax.lax.cond(st.cache.index < S, cached, recompute, None)
        else:
            next_logits, cache = cached(None)
        return DecodeState(tokens_BN, st.start_B, cache, next_logits, st.pos + 1, done_B, key), None

    state, _ = jax.lax.scan(step, state, None, length=n_steps)
    return state


def generate(model: GPT, prompt_BP: jax.Array, key: jax.Array, s: SamplingSettings,
             start_B: jax.Array | None = None) -> jax.Array:
    """Pure: left-padded prompts [B, P] -> tokens [B, P + max_new_tokens] (jit-able, static `s`)."""
    if start_B is None:
        start_B = jnp.zeros((prompt_BP.shape[0],), jnp.int32)
    state = prefill(model, prompt_BP, start_B, key, s.max_new_tokens)
    return decode(model, state, s.max_new_tokens, s).tokens_BN


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[jax.Array, jax.Array]:
    """Rows of different lengths -> ([B, P] left-padded ids, [B] index of each row's first token)."""
    if len(prompts) == 0 or any(len(p) == 0 for p in prompts):
        raise UserError("a prompt is empty (or there are none); give each row at least one token")
    P = max(len(p) for p in prompts)
    rows = [[pad_id] * (P - len(p)) + list(p) for p in prompts]
    return jnp.array(rows, jnp.int32), jnp.array([P - len(p) for p in prompts], jnp.int32)


class Sampler:
    """Jit-compiled prefill and chunked decode for one model and one set of sampling settings."""

    def __init__(self, model: GPT, settings: SamplingSettings, chunk: int = 16):
        self.graphdef, self.params = nnx.split(for_decoding(model))
        self.settings = settings
        self.chunk = chunk
        self.cfg = model.cfg
        gd = self.graphdef

        def _prefill(params, prompt_BP, start_B, key):
            return prefill(nnx.merge(gd, params), prompt_BP, start_B, key, settings.max_new_tokens)

        def _decode(params, state, n):
            return decode(nnx.merge(gd, params), state, n, settings)

        self._prefill = jax.jit(_prefill)
        self._decode = jax.jit(_decode, static_argnums=2, donate_argnums=1)

    def start(self, prompts: list[list[int]], key: jax.Array) -> DecodeState:
        prompt_BP, start_B = left_pad(prompts)
        return self._prefill(self.params, prompt_BP, start_B, key)

    def chunks(self, state: DecodeState):
        """Yield the state after each chunk of decoded tokens (for streaming)."""
        left = self.settings.max_new_tokens
        while left > 0:
            n = min(self.chunk, left)
            state = self._decode(self.params, state, n)
            left -= n
            yield state
            if self.settings.eot_id is not None and bool(jnp.all(state.done_B)):
                return

    def generate(self, prompts: list[list[int]], key: jax.Array) -> list[list[int]]:
        """Generated ids of each row (prompt excluded, cut after the end-of-text token)."""
        state = self.start(prompts, key)
        for state in self.chunks(state):
            pass
        return self.new_tokens(state, prompts)

    def new_tokens(self, state: DecodeState, prompts: list[list[int]]) -> list[list[int]]:
        """Each row's tokens after its prompt (through its end-of-text token), read whole and cut
        on the host: a slice to the current position on the device would be a program of its own
        for every position, compiled anew each chunk (20x the decoding time of a small model)."""
        P = max(len(p) for p in prompts)
        tokens_BN, pos = jax.device_get((state.tokens_BN, state.pos))
        new_BN = np.asarray(tokens_BN)[:, P:int(pos)]
        if new_BN.shape[1] == 0:  # nothing decoded (max_new_tokens=0): numpy's argmax of no column raises
            return [[] for _ in new_BN]
        # Found by numpy: a scan of every row in Python, at every chunk, was quadratic in its length.
        end_BN = np.isin(new_BN, list(self.settings.end_ids))
        lengths = np.where(end_BN.any(1), end_BN.argmax(1) + 1, new_BN.shape[1])
        return [row[:n].tolist() for row, n in zip(new_BN, lengths)]


def decode_kernels_by_default(model: GPT, rows: int, speculative: bool, backend: str) -> bool:
    """Whether sample.py decodes through gpt/ops/decode_kernels.py when --decode_kernels is not
    given: wherever `with_decode_kernels` accepts the run (a GPU, one row, no draft, GPT-2's
    block). On an H200 a GPT-2 token took 0.36 ms against 0.39 with XLA's layers (BENCHMARKS.md)."""
    return (backend == "gpu" and rows == 1 and not speculative
            and decode_kernels_problem(model.cfg) is None)


def with_decode_kernels(model: GPT, rows: int, speculative: bool, backend: str) -> GPT:
    """The model set to decode one row's tokens through the Pallas kernels of
    gpt/ops/decode_kernels.py (sample.py --decode_kernels), or a UserError saying why it cannot."""
    lacks, problem = decode_kernels_problem(model.cfg), None
    if backend != "gpu":
        problem = f"needs an NVIDIA GPU (Triton kernels), and this run is on {backend}"
    elif rows != 1 or speculative:
        problem = "decodes one row, without a draft: use --num_samples=1 and no --draft_out_dir"
    elif lacks is not None:
        problem = f"runs GPT-2's block only, and this model has {lacks}"
    if problem is not None:
        raise UserError(f"--decode_kernels {problem}; drop --decode_kernels")
    out = nnx.merge(*nnx.split(model))  # a twin sharing its arrays
    out.rt = dataclasses.replace(model.rt, decode_kernels=decode_kernels_on(backend))
    return out


def settings_from(cfg: Any, eot_id: int | None, stop_ids: tuple[int, ...] = ()) -> SamplingSettings:
    """SamplingSettings from a SampleConfig (top_k beyond the vocabulary is checked by the caller)."""
    return SamplingSettings(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                            top_k=cfg.top_k, top_p=cfg.top_p, eot_id=eot_id, stop_ids=tuple(stop_ids))
