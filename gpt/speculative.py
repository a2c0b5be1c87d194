"""Speculative decoding (Leviathan et al., 2023; Chen et al., 2023): a small draft model proposes K
tokens from its own KV cache, the target scores all K+1 positions in one cached forward, and a
rejection rule keeps a prefix of the proposals plus one token of the target's own. The output is
distributed exactly as sampling from the target alone with the same settings (at temperature 0 it
is token for token the target's greedy output); a round costs K draft steps and about one target
step, and emits between 1 and K+1 tokens.

The acceptance rule (`verify`) works on the *filtered* distributions p (target) and q (draft):
temperature, top-k and top-p applied to each exactly as plain sampling applies them. Draft token
d_i is kept with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the replacement
is drawn from normalize(max(0, p_i - q_i)); if all K are kept, a bonus token is drawn from p_K+1.

Caches: rows of a batch keep different numbers of tokens per round, so both caches carry a per-row
index (see `gpt.model.KVCache`). Between rounds the target cache holds each row's tokens but the
last, which the verifying forward feeds again in front of the proposals; the draft cache holds all
but the last two, which its first call of a round feeds (so a round is K draft forwards, the first
of two tokens, whether the previous round accepted everything or not). Rolling back a rejection is
lowering the index: the rejected keys/values stay in their slots, masked, until overwritten.

Past block_size: caches that roll (RoPE, no positions) keep K spare slots, so the K+1 tokens a
round writes never overwrite what its first query still attends to. A model with learned or
sinusoidal positions must recompute its window for every token past block_size (see
`gpt.sampling`); once a round no longer fits its cache, decoding continues with target-only steps
(exactly `gpt.sampling`'s), for good: the draft is idle from then on.

The whole loop is one `lax.while_loop` of rounds (a `lax.cond` picks a speculative round or a
target-only step), so nothing is retraced per token. `SpeculativeSampler` jits it and runs a few
rounds per call for streaming, with the same interface as `gpt.sampling.Sampler`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from gpt.config import MAX_DRAFT_TOKENS
from gpt.model import GPT, KVCache, for_decoding, init_cache
from gpt.sampling import SamplingSettings, fill_cache, filter_logits, left_pad, rolls, sample_token


class SpecState(NamedTuple):
    tokens_BN: jax.Array  # left-padded prompts, then generated tokens; row b's first length_B[b] are real
    start_B: jax.Array  # first real token of each row in tokens_BN
    length_B: jax.Array  # tokens in each row (its padding included): where its next token goes
    target: KVCache  # per-row index: holds each row's tokens but the last
    draft: KVCache  # per-row index: holds each row's tokens but the last two
    done_B: jax.Array  # rows that emitted the end-of-text token
    speculating: jax.Array  # bool: False once a round no longer fits a cache that cannot roll
    key: jax.Array
    drafted_B: jax.Array  # draft tokens proposed to each row
    accepted_B: jax.Array  # of those, accepted
    rounds: jax.Array  # target forwards so far (speculative rounds and target-only steps)


# ----------------------------------------------------------------------------- acceptance


def probs(logits_xV: jax.Array, s: SamplingSettings) -> jax.Array:
    """The distribution plain sampling draws from: softmax of the filtered logits (any leading axes)."""
    flat_MV = logits_xV.reshape(-1, logits_xV.shape[-1])
    filtered_MV = filter_logits(flat_MV, s.temperature, s.top_k, s.top_p)
    return jax.nn.softmax(filtered_MV, axis=-1).reshape(logits_xV.shape)


def leading_true(ok_BK: jax.Array) -> jax.Array:
    """How many entries of each row are True before its first False."""
    return jnp.sum(jnp.cumprod(ok_BK.astype(jnp.int32), axis=1), axis=1)


def verify(key: jax.Array, p_logits_BTV: jax.Array, q_logits_BKV: jax.Array, draft_BK: jax.Array,
           s: SamplingSettings) -> tuple[jax.Array, jax.Array]:
    """The rejection rule: (how many draft tokens each row keeps [B], the token after them [B]).

    p_logits are the target's logits at the K+1 positions (after each prefix of the proposals),
    q_logits the draft's at the K positions it sampled `draft_BK` from; both raw, filtered here as
    `sample_token` filters them. At temperature 0 a token is kept while it equals the target's
    argmax, and the next token is the target's argmax after the kept ones.
    """
    B, K = draft_BK.shape
    if s.temperature == 0.0:
        best_BT = jnp.argmax(p_logits_BTV, axis=-1).astype(jnp.int32)
        kept_B = leading_true(draft_BK == best_BT[:, :K])
        return kept_B, jnp.take_along_axis(best_BT, kept_B[:, None], axis=1)[:, 0]
    p_BTV, q_BKV = probs(p_logits_BTV, s), probs(q_logits_BKV, s)
    pick = lambda x_BKV: jnp.take_along_axis(x_BKV, draft_BK[..., None], axis=-1)[..., 0]
    key_accept, key_resample = jax.random.split(key)
    u_BK = jax.random.uniform(key_accept, (B, K))
    kept_B = leading_true(u_BK * pick(q_BKV) < pick(p_BTV[:, :K]))  # probability min(1, p/q)
    # After all K are kept the "residual" is p_K+1 itself (q padded with a zero row).
    q_BTV = jnp.concatenate([q_BKV, jnp.zeros_like(p_BTV[:, :1])], axis=1)
    at = lambda x_BTV: jnp.take_along_axis(x_BTV, kept_B[:, None, None], axis=1)[:, 0]
    p_BV = at(p_BTV)
    residual_BV = jnp.maximum(p_BV - at(q_BTV), 0.0)
    # Rejection implies p < q somewhere, hence mass elsewhere; only rounding can leave none.
    residual_BV = jnp.where(residual_BV.sum(-1, keepdims=True) > 0, residual_BV, p_BV)
    return kept_B, jax.random.categorical(key_resample, jnp.log(residual_BV), axis=-1).astype(jnp.int32)


# ----------------------------------------------------------------------------- caches


def cache_slots(cfg, context: int, k: int) -> int:
    """Slots of a model's cache for `context` tokens (the cropped prompt plus the new ones): a cache
    that rolls keeps k spare slots past block_size (see the module docstring); one that cannot
    roll stops at block_size."""
    if rolls(cfg):
        return min(context, cfg.block_size) + k
    return min(context + k, cfg.block_size)


def prefill_cache(model: GPT, prompt_BP: jax.Array, start_B: jax.Array, max_new_tokens: int, k: int,
                  behind: int) -> KVCache:
    """A per-row cache filled with the prompts as plain sampling fills it (`fill_cache`), its index
    set `behind` tokens back: those are fed again by the first round."""
    B, P = prompt_BP.shape
    S = cache_slots(model.cfg, min(P, model.cfg.block_size) + max_new_tokens, k)
    _, cache = fill_cache(model, prompt_BP, start_B, S, model.rt.dtype)
    return cache._replace(index=jnp.broadcast_to(cache.index - behind, (B,)).astype(jnp.int32))


def always_fits(cache: KVCache, cfg) -> bool:
    """Whether every round fits this cache whatever happens: it rolls, or block_size did not cap
    it (then it has room for the whole prompt, every new token and k more)."""
    return rolls(cfg) or cache.slots < cfg.block_size


def fits(cache: KVCache, cfg, k: int, active_B: jax.Array) -> jax.Array:
    """Whether every active row can write k + 1 more tokens (always, for a cache that rolls)."""
    if rolls(cfg):
        return jnp.array(True)
    return jnp.all(~active_B | (cache.index + k + 1 <= cache.slots))


def keep(written: KVCache, before: KVCache, count_B: jax.Array) -> KVCache:
    """The cache a call wrote into, keeping only `count_B` of its tokens past the index it had
    `before` the call: the rollback is this index (no copy)."""
    return written._replace(index=before.index + count_B)


# ----------------------------------------------------------------------------- one round


def last_tokens(st: SpecState, n: int) -> jax.Array:
    """Each row's last n tokens [B, n]."""
    at_Bn = st.length_B[:, None] - n + jnp.arange(n)
    return jnp.take_along_axis(st.tokens_BN, at_Bn, axis=1)


def propose(draft: GPT, st: SpecState, key: jax.Array, s: SamplingSettings, k: int
            ) -> tuple[jax.Array, jax.Array, KVCache]:
    """The draft's K tokens [B, K], the logits they were sampled from [B, K, V], and its cache:
    one forward of the last two tokens, then K-1 of one token (the K-th proposal is not fed)."""
    logits_B2V, cache = draft(last_tokens(st, 2), cache=st.draft)
    keys = jax.random.split(key, k)

    def step(carry, key_i):
        logits_BV, cache = carry
        tok_B = sample_token(key_i, logits_BV, s)
        next_B1V, cache = draft(tok_B[:, None], cache=cache)
        return (next_B1V[:, -1], cache), (tok_B, logits_BV)

    (last_BV, cache), (toks_KB, logits_KBV) = jax.lax.scan(step, (logits_B2V[:, -1], cache), keys[:-1])
    draft_BK = jnp.concatenate([toks_KB.T, sample_token(keys[-1], last_BV, s)[:, None]], axis=1)
    return draft_BK, jnp.concatenate([logits_KBV.transpose(1, 0, 2), last_BV[:, None]], axis=1), cache


def emit(st: SpecState, new_BT: jax.Array, count_B: jax.Array, active_B: jax.Array,
         s: SamplingSettings) -> tuple[SpecState, jax.Array]:
    """Append the first count_B of new_BT to each active row, cut after a token that ends a row;
    returns the state and how many tokens each row took."""
    T = new_BT.shape[1]
    j_T = jnp.arange(T)
    ends_BT = s.ends(new_BT) & (j_T < count_B[:, None])
    hit_B = ends_BT.any(axis=1) & active_B
    count_B = jnp.where(hit_B, jnp.argmax(ends_BT, axis=1) + 1, count_B)
    done_B = st.done_B | hit_B
    count_B = jnp.where(active_B, count_B, 0)
    N = st.tokens_BN.shape[1]
    at_BT = jnp.where(active_B[:, None], st.length_B[:, None] + j_T, N)  # N: dropped
    tokens_BN = st.tokens_BN.at[jnp.arange(new_BT.shape[0])[:, None], at_BT].set(new_BT, mode="drop")
    return st._replace(tokens_BN=tokens_BN, length_B=st.length_B + count_B, done_B=done_B), count_B


def speculative_round(target: GPT, draft: GPT, st: SpecState, active_B: jax.Array,
                      s: SamplingSettings, k: int) -> SpecState:
    """Draft K tokens, verify them in one target forward, keep the accepted prefix plus one."""
    key, key_draft, key_verify = jax.random.split(st.key, 3)
    draft_BK, q_logits_BKV, draft_cache = propose(draft, st, key_draft, s, k)
    fed_BT = jnp.concatenate([last_tokens(st, 1), draft_BK], axis=1)
    p_logits_BTV, target_cache = target(fed_BT, cache=st.target)
    kept_B, next_B = verify(key_verify, p_logits_BTV, q_logits_BKV, draft_BK, s)
    new_BT = jnp.where(jnp.arange(k + 1) < kept_B[:, None], jnp.pad(draft_BK, ((0, 0), (0, 1))),
                       next_B[:, None])  # the kept proposals, then the target's token
    st, count_B = emit(st, new_BT, kept_B + 1, active_B, s)
    return st._replace(target=keep(target_cache, st.target, count_B),
                       draft=keep(draft_cache, st.draft, count_B), key=key,
                       drafted_B=st.drafted_B + jnp.where(active_B, k, 0),
                       accepted_B=st.accepted_B + jnp.where(active_B, kept_B, 0),
                       rounds=st.rounds + 1)


def window_logits(model: GPT, st: SpecState) -> jax.Array:
    """Each row's next-token logits from its last block_size tokens recomputed at positions from 0
    (nanoGPT's crop, as `gpt.sampling` does past block_size for learned/sinusoidal positions)."""
    W = model.cfg.block_size
    B, N = st.tokens_BN.shape
    first_B = st.length_B - W
    window_BW = jnp.take_along_axis(st.tokens_BN, jnp.clip(first_B[:, None] + jnp.arange(W), 0, N - 1),
                                    axis=1)
    cache = init_cache(model.cfg, B, W, model.rt.dtype, jnp.clip(st.start_B - first_B, 0, W - 1))
    logits_BWV, _ = model(window_BW, cache=cache)
    return logits_BWV[:, -1]


def target_step(target: GPT, st: SpecState, active_B: jax.Array, s: SamplingSettings) -> SpecState:
    """One token from the target alone, as plain sampling makes it: a cached step where the cache
    rolls, the recomputed window otherwise (the target cache is then left as it is)."""
    key, sub = jax.random.split(st.key)
    written = st.target
    if rolls(target.cfg):
        logits_B1V, written = target(last_tokens(st, 1), cache=st.target)
        logits_BV = logits_B1V[:, -1]
    else:
        logits_BV = window_logits(target, st)
    new_st, count_B = emit(st, sample_token(sub, logits_BV, s)[:, None], jnp.ones_like(st.length_B),
                           active_B, s)
    cache = keep(written, st.target, count_B) if rolls(target.cfg) else st.target
    return new_st._replace(target=cache, key=key, rounds=st.rounds + 1)


# ----------------------------------------------------------------------------- the loop


def end_of(st: SpecState, k: int) -> int:
    """Row length at which generation is complete (the buffer has k spare columns past it)."""
    return st.tokens_BN.shape[1] - k


def active(st: SpecState, k: int) -> jax.Array:
    return ~st.done_B & (st.length_B < end_of(st, k))


def prefill_speculative(target: GPT, draft: GPT, prompt_BP: jax.Array, start_B: jax.Array,
                        key: jax.Array, s: SamplingSettings, k: int) -> SpecState:
    """Both caches filled with the (left-padded) prompts. One more padding column in front makes
    every row at least two tokens long, which the draft's first call needs."""
    prompt_BP = jnp.pad(prompt_BP.astype(jnp.int32), ((0, 0), (1, 0)))
    start_B = start_B.astype(jnp.int32) + 1
    B, P = prompt_BP.shape
    N = s.max_new_tokens
    tokens_BN = jnp.zeros((B, P + N + k), jnp.int32).at[:, :P].set(prompt_BP)
    zeros_B = jnp.zeros((B,), jnp.int32)
    return SpecState(tokens_BN, start_B, jnp.full((B,), P, jnp.int32),
                     prefill_cache(target, prompt_BP, start_B, N, k, behind=1),
                     prefill_cache(draft, prompt_BP, start_B, N, k, behind=2),
                     jnp.zeros((B,), bool), jnp.array(True), key, zeros_B, zeros_B,
                     jnp.array(0, jnp.int32))


def decode_speculative(target: GPT, draft: GPT, st: SpecState, s: SamplingSettings, k: int,
                       max_rounds: int | jax.Array) -> SpecState:
    """Up to `max_rounds` rounds (a traced count is fine: one compilation serves any), stopping
    early once every row has max_new_tokens tokens or has ended."""

    def body(carry):
        st, r = carry
        active_B = active(st, k)
        if always_fits(st.target, target.cfg) and always_fits(st.draft, draft.cfg):
            return speculative_round(target, draft, st, active_B, s, k), r + 1  # no branch needed
        spec = st.speculating & fits(st.target, target.cfg, k, active_B) & \
            fits(st.draft, draft.cfg, k, active_B)
        st = jax.lax.cond(spec, lambda st: speculative_round(target, draft, st, active_B, s, k),
                          lambda st: target_step(target, st, active_B, s), st._replace(speculating=spec))
        return st, r + 1

    cond = lambda carry: (carry[1] < max_rounds) & jnp.any(active(carry[0], k))
    st, _ = jax.lax.while_loop(cond, body, (st, jnp.array(0, jnp.int32)))
    return st


def output_tokens(st: SpecState, eot_id: int | None, k: int) -> jax.Array:
    """[B, 1 + P + max_new_tokens]: each row as plain `generate` lays it out (behind the extra
    padding column), end-of-text repeated after a row's end as plain decoding repeats it."""
    tokens_BN = st.tokens_BN[:, :end_of(st, k)]
    if eot_id is None:
        return tokens_BN
    past_BN = jnp.arange(tokens_BN.shape[1]) >= st.length_B[:, None]
    return jnp.where(past_BN & st.done_B[:, None], eot_id, tokens_BN)


def generate_speculative(target: GPT, draft: GPT, prompt_BP: jax.Array, key: jax.Array,
                         s: SamplingSettings, k: int, start_B: jax.Array | None = None) -> jax.Array:
    """Pure: left-padded prompts [B, P] -> tokens [B, P + max_new_tokens] distributed exactly as
    `gpt.sampling.generate(target, ...)`'s, drafting k tokens per round (jit-able, static s and k).
    Draft and target must share the tokenizer (and so the vocabulary)."""
    return output_tokens(speculate(target, draft, prompt_BP, key, s, k, start_B), s.eot_id, k)[:, 1:]


def speculate(target: GPT, draft: GPT, prompt_BP: jax.Array, key: jax.Array, s: SamplingSettings,
              k: int, start_B: jax.Array | None = None) -> SpecState:
    """`generate_speculative`'s final state (its counts give the acceptance rate)."""
    check_pair(target, draft, k)
    if start_B is None:
        start_B = jnp.zeros((prompt_BP.shape[0],), jnp.int32)
    st = prefill_speculative(target, draft, prompt_BP, start_B, key, s, k)
    return decode_speculative(target, draft, st, s, k, s.max_new_tokens)  # each round: >= 1 token a row


def check_pair(target: GPT, draft: GPT, k: int) -> None:
    """What the algorithm needs of its arguments (programming errors, not user input)."""
    if target.cfg.vocab_size != draft.cfg.vocab_size:
        raise ValueError(f"draft vocabulary {draft.cfg.vocab_size} != target vocabulary "
                         f"{target.cfg.vocab_size}: speculative decoding needs one tokenizer")
    if not 1 <= k <= MAX_DRAFT_TOKENS:
        raise ValueError(f"k={k} draft tokens per round: use 1..{MAX_DRAFT_TOKENS}")


# ----------------------------------------------------------------------------- streaming


class SpeculativeSampler:
    """`gpt.sampling.Sampler`'s interface (start, chunks, generate, new_tokens) for speculative
    decoding: prefill and the round loop jitted once; each chunk runs `rounds` rounds."""

    def __init__(self, target: GPT, draft: GPT, settings: SamplingSettings, k: int, rounds: int = 4):
        check_pair(target, draft, k)
        (gd_t, self.target_params), (gd_d, self.draft_params) = (nnx.split(for_decoding(m))
                                                                  for m in (target, draft))
        self.settings, self.k, self.rounds = settings, k, rounds
        merge = lambda pt, pd: (nnx.merge(gd_t, pt), nnx.merge(gd_d, pd))

        def _prefill(pt, pd, prompt_BP, start_B, key):
            return prefill_speculative(*merge(pt, pd), prompt_BP, start_B, key, settings, k)

        def _decode(pt, pd, st, n):
            return decode_speculative(*merge(pt, pd), st, settings, k, n)

        self._prefill = jax.jit(_prefill)
        self._decode = jax.jit(_decode, donate_argnums=2)

    def start(self, prompts: list[list[int]], key: jax.Array) -> SpecState:
        prompt_BP, start_B = left_pad(prompts)
        return self._prefill(self.target_params, self.draft_params, prompt_BP, start_B, key)

    def chunks(self, st: SpecState):
        """Yield the state after every `rounds` rounds (for streaming) until every row is complete."""
        while bool(jnp.any(active(st, self.k))):
            st = self._decode(self.target_params, self.draft_params, st, jnp.array(self.rounds, jnp.int32))
            yield st

    def generate(self, prompts: list[list[int]], key: jax.Array) -> list[list[int]]:
        """Generated ids of each row (prompt excluded, cut after the end-of-text token)."""
        st = self.start(prompts, key)
        for st in self.chunks(st):
            pass
        return self.new_tokens(st, prompts)

    def new_tokens(self, st: SpecState, prompts: list[list[int]]) -> list[list[int]]:
        first = 1 + max(len(p) for p in prompts)  # behind the extra padding column
        last = first + self.settings.max_new_tokens
        tokens, lengths = jax.device_get((st.tokens_BN, st.length_B))
        return [row[first:min(n, last)].tolist() for row, n in zip(tokens, lengths)]

    @staticmethod
    def stats(st: SpecState) -> dict:
        """Acceptance rate (accepted / drafted tokens) and target forwards so far."""
        drafted, accepted, rounds = (int(jnp.sum(x)) for x in (st.drafted_B, st.accepted_B, st.rounds))
        return {"drafted": drafted, "accepted": accepted, "target_forwards": rounds,
                "acceptance_rate": accepted / drafted if drafted else 0.0}


# ----------------------------------------------------------------------------- the command line


def check_draft(draft_dir: str, target_tok, target_dir: str):
    """The draft's tokenizer, read without its arrays (`load_tokenizer_of`) and checked against the
    target's: sample.py calls it before either model's weights are read, so that a mistyped
    --draft_out_dir or a draft with another tokenizer is told at once, not after loading gigabytes."""
    from gpt.checkpoint import list_steps, load_tokenizer_of
    from gpt.errors import UserError
    from gpt.tokenizer import fingerprint

    if not list_steps(draft_dir):
        there = "does not exist" if not Path(draft_dir).exists() else "holds no checkpoint"
        raise UserError(f"--draft_out_dir={draft_dir} {there}; give a small model trained with the "
                        f"target's tokenizer (python train.py --out_dir=DIR on the same data)")
    try:
        draft_tok = load_tokenizer_of(draft_dir)
    except UserError as e:
        raise UserError(f"--draft_out_dir={draft_dir}: {e}") from None
    if fingerprint(draft_tok, draft_dir) != fingerprint(target_tok, target_dir):
        raise UserError(f"the draft's tokenizer ({describe(draft_tok)}, in {draft_dir}) is not the "
                        f"target's ({describe(target_tok)}, in {target_dir}); speculative decoding "
                        f"needs a draft trained with the same tokenizer")
    return draft_tok


def load_draft(draft_dir: str, dtype: str, target: GPT, target_tok, target_dir: str, k: int,
               draft_tok: Any = None) -> GPT:
    """The draft model of `sample.py --draft_out_dir`, checked against the target: a missing or
    damaged checkpoint, another tokenizer or vocabulary, or k past a model's block_size is one
    UserError line; a draft larger than the target is allowed (it only makes decoding slower)
    with one warning. `draft_tok`: what `check_draft` returned, if the caller called it."""
    import sys

    from gpt.checkpoint import load_model
    from gpt.errors import UserError
    from gpt.model import num_params

    draft_tok = draft_tok or check_draft(draft_dir, target_tok, target_dir)
    try:
        draft, _, _ = load_model(draft_dir, dtype, tok=draft_tok)
    except UserError as e:
        raise UserError(f"--draft_out_dir={draft_dir}: {e}") from None
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise UserError(f"the draft's vocabulary ({draft.cfg.vocab_size} tokens, {draft_dir}) differs "
                        f"from the target's ({target.cfg.vocab_size} tokens, {target_dir}); speculative "
                        f"decoding compares their distributions token by token")
    for name, m in (("draft", draft), ("target", target)):
        if k >= m.cfg.block_size:
            raise UserError(f"--num_draft_tokens={k} must be less than the {name}'s block_size "
                            f"({m.cfg.block_size})")
    n_draft, n_target = num_params(draft.cfg), num_params(target.cfg)
    if n_draft > n_target:
        print(f"warning: the draft ({n_draft / 1e6:.2f}M parameters) is larger than the target "
              f"({n_target / 1e6:.2f}M); the output is still the target's, but slower to get than "
              f"without --draft_out_dir", file=sys.stderr)
    return draft


def describe(tok) -> str:
    return f"{tok.spec.get('kind', '?')}, {tok.vocab_size} tokens"
