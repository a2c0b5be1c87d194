"""Sampling benchmark: KV-cached prefill + decode against the no-cache baseline.

    python bench/sample.py [--configs=tiny,shakespeare-char,gpt2] [--batches=1,16]
                           [--prompt_len=16] [--new_tokens=256] [--baseline_tokens=N]
                           [--baseline_batches=1] [--dtype=auto] [--reps=3] [--baseline_reps=1]
                           [--weights=compute|float32] [--transformers] [--decode_kernels]

Models are randomly initialised (vocabulary 65 for the char configs, 50257 for gpt2). For each
config and batch size it reports the prefill time (the prompt through the model, filling the cache),
decode tokens/s (batch x new tokens / decode time, the sampler's jitted scan) and, for the batch
sizes in --baseline_batches, the no-cache baseline (bench/nocache.py: full_recompute_generate, which
re-runs the whole context per token; one row at a time, so its tokens/s at batch B is its batch-1
rate). Compile time is excluded everywhere: each function runs once to warm up, then --reps times
(median). The baseline decodes --baseline_tokens tokens (default: --new_tokens) after a warm-up run
over the same lengths, so every context-length bucket it compiles is compiled before it is timed.
Both paths sample with temperature 1 and top-k 200, so they do the same per-token work.
--weights=compute casts the parameters to the compute dtype once (what a bf16 decode should read per
token); float32 keeps them as trained. Each row also gives the memory-bandwidth bound of a decode
step (the bytes it must read: the weights as held plus the keys/values written so far, at the
average context of the run, over the copy bandwidth measured in the same run) and the fraction of
it reached (`bw_util`): batch-1 decoding is bound by reading the weights, not by FLOPs. The same
bound at the read-only bandwidth (`measure_read_gbps`, measured alongside: a read stream need not
reach the copy figure, which counts reads and writes together) is `read_bound_ms` / `read_util`.
--transformers also times Hugging Face `generate` (test-only torch, CPU) on a randomly initialised
GPT2LMHeadModel of each config's shape, same batch, prompt length, new tokens, temperature 1 and
top-k 200, as the decoding reference (`transformers_tokens_per_sec`, `vs_transformers`).
--decode_kernels also times batch 1 with the layers as gpt/ops/decode_kernels.py's Pallas kernels
(sample.py --decode_kernels; rows with `decode_kernels` true; off a GPU in Pallas's interpreter,
which only says they run).

Speculative decoding (gpt/speculative.py), plain and speculative side by side on the same target:

    python bench/sample.py --speculative [--configs=] [--pair=NAME] [--pair_iters=N] [--draft_iters=N]
                           [--distill_rows=N] [--target_dir=DIR --draft_dir=DIR] [--num_draft_tokens=4]
                           [--spec_tokens=200] [--spec_batch=1]

A trained pair is needed (random weights accept almost nothing): --target_dir/--draft_dir, or a
pair trained here on the bundled Shakespeare with train.py and cached by its flags under
$GPT_BENCH_CACHE (default ~/.cache/gpt-jax-bench): `shakespeare` is the shakespeare-char target
(10.7M parameters) and a 2-layer, 128-wide draft (0.4M, 25x smaller); `shakespeare-small-batch`
the same target trained on 8 rows of 256 a step without dropout, with a 4-layer draft (0.8M, 13x
smaller), cheap enough to train on a small CPU; `tiny` is a smoke test. --distill_rows=N distils
the pair's draft from its target (`distillation_text`): it trains on the target's greedy
continuations of N windows of the training text mixed with the corpus (the target is the pair's
own, cached as without it). --draft_iters: the draft's training steps (default --pair_iters; a
draft is cheap to train longer, its target is not).
Greedy (temperature 0), so both paths must give the same tokens (checked). The plain, draft, verify
and speculative loops are timed in alternation (--reps rounds, medians). Reported: tokens/s of
plain cached decoding and of speculative decoding (decode only, prefill excluded), the measured
speedup, the acceptance rate (accepted / drafted tokens), tokens per target forward (per round),
Leviathan et al.'s per-token acceptance a solved from them ((1 - a^(K+1)) / (1 - a) tokens per
round), the step times of the target, the draft (and its first call of a round, which feeds two
tokens) and the target's (K+1)-token verifying forward, and the speedup they predict: tokens per
round over the round's cost (the draft's first call, K-1 draft steps, one verifying forward) in
target steps.
The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from gpt import metrics as metrics_lib  # noqa: E402
from gpt.config import (PRESETS, ComputeConfig, ModelConfig, validate_compute,  # noqa: E402
                        validate_model)
from gpt.model import GPT, decode_kernels_problem, for_decoding, num_params  # noqa: E402
from gpt.runtime import decode_kernels_on, decoding_dtype, resolve, run_cpu_programs_inline  # noqa: E402
from bench.nocache import full_recompute_generate  # noqa: E402
from gpt.sampling import SamplingSettings, decode, prefill  # noqa: E402
from gpt import speculative as spec  # noqa: E402

CHAR_VOCAB = 65


def preset_model(name: str) -> ModelConfig:
    """Preset `name`'s architecture, all of it (a Llama preset's RoPE, RMSNorm, SwiGLU and
    grouped-query heads too: only GPT-2's fields were taken before)."""
    p = PRESETS[name]
    kw = {f.name: p[f.name] for f in dataclasses.fields(ModelConfig) if f.name in p}
    kw.setdefault("vocab_size", CHAR_VOCAB)  # the char presets take their vocabulary from the data
    return validate_model(ModelConfig(**kw))


def build_model(name: str, dtype: str, kernels: bool = False) -> tuple[ModelConfig, GPT]:
    """Preset `name`'s architecture with random weights, computed in `dtype`; with `kernels`, its
    one-row decoding steps through gpt/ops/decode_kernels.py (the interpreter off a GPU)."""
    cfg = preset_model(name)
    mode = decode_kernels_on(jax.default_backend()) if kernels else ""
    rt = resolve(cfg, validate_compute(ComputeConfig(dtype=dtype)), decode_kernels=mode)
    return cfg, GPT(cfg, rngs=nnx.Rngs(0), runtime=rt)


def interleaved(fns: dict, reps: int) -> dict:
    """{name: (median seconds, output)}: each function warmed up, then timed once per round, the
    rounds alternating between them, so that a machine whose speed drifts over minutes (a shared
    VM) slows every one alike and the ratios hold."""
    out = {name: fn() for name, fn in fns.items()}  # compile and warm up
    jax.block_until_ready(list(out.values()))
    ts = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            out[name] = jax.block_until_ready(fn())
            ts[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(ts[name]), out[name]) for name in fns}


def timed(fn, reps: int):
    """(median seconds, output) of `fn` after a warm-up call that compiles it."""
    return interleaved({"fn": fn}, reps)["fn"]


def bench_config(name: str, args, kernels: bool = False) -> list[dict]:
    """`name`'s rows: a row per batch size, or with `kernels` batch 1 through the decoding kernels
    (no baseline, no transformers: the rows without them have those)."""
    cfg, model = build_model(name, args.dtype, kernels)
    model = for_decoding(model)  # as gpt.sampling.Sampler holds it
    gd, params = nnx.split(model)
    dtype = model.rt.dtype
    if args.weights == "compute":
        params = hold_in(params, dtype)
    weight_bytes = step_weight_bytes(cfg, params)
    s = SamplingSettings(max_new_tokens=args.new_tokens, temperature=1.0, top_k=200)
    P, N = args.prompt_len, args.new_tokens
    pf = jax.jit(lambda params, prompt, start, key: prefill(nnx.merge(gd, params), prompt, start,
                                                            key, N))
    dec = jax.jit(lambda params, state: decode(nnx.merge(gd, params), state, N, s))
    rows = []
    for B in [1] if kernels else args.batches:
        prompt = jax.random.randint(jax.random.key(B), (B, P), 0, cfg.vocab_size, jnp.int32)
        start = jnp.zeros((B,), jnp.int32)
        key = jax.random.key(1)
        t_pf, state = timed(lambda: pf(params, prompt, start, key), args.reps)
        t_dec, _ = timed(lambda: dec(params, state), args.reps)
        row = {"config": name, "params_m": num_params(cfg) / 1e6, "batch": B, "prompt_len": P,
               "new_tokens": N, "dtype": dtype.name,
               "prefill_ms": 1e3 * t_pf, "decode_sec": t_dec,
               "decode_tokens_per_sec": B * N / t_dec, "ms_per_step": 1e3 * t_dec / N,
               "baseline_tokens_per_sec": None, "speedup": None, "weights": args.weights,
               "decode_kernels": kernels,
               **bandwidth_bound(cfg, B, P + N / 2, weight_bytes, jnp.dtype(dtype).itemsize,
                                 args.copy_gbps, t_dec / N, args.read_gbps)}
        if args.transformers and not kernels:
            t_hf = time_transformers(cfg, B, P, N, args.reps)
            row["transformers_tokens_per_sec"] = B * N / t_hf
            row["vs_transformers"] = t_hf / (t_pf + t_dec)  # generate includes its prefill
        if B in args.baseline_batches and not kernels:
            nb = args.baseline_tokens or N
            sb = SamplingSettings(max_new_tokens=nb, temperature=1.0, top_k=200)
            row_prompt = jax.device_get(prompt[0]).tolist()
            t_base, _ = timed(lambda: full_recompute_generate(model, row_prompt, key, sb),
                              args.baseline_reps)
            # One row at a time: a batch of B rows takes B times as long.
            row["baseline_tokens_per_sec"] = nb / t_base
            row["baseline_new_tokens"] = nb
            row["speedup"] = row["decode_tokens_per_sec"] / row["baseline_tokens_per_sec"]
        rows.append(row)
        base = (f"{row['baseline_tokens_per_sec']:>10.1f} {row['speedup']:>8.1f}x"
                if row["speedup"] else f"{'-':>10} {'-':>9}")
        label = name + (" kernels" if kernels else "")
        print(f"{label:<17} {B:>5} {row['prefill_ms']:>11.1f} {row['decode_tokens_per_sec']:>12.1f} "
              f"{row['ms_per_step']:>9.2f} {base} {100 * row['bw_util']:>8.0f}% "
              f"{100 * row['read_util']:>8.0f}%"
              + (f" {row['transformers_tokens_per_sec']:>10.1f} {row['vs_transformers']:>7.2f}x"
                 if "vs_transformers" in row else ""), flush=True)
    return rows


def hold_in(params, dtype):
    """The floating parameters cast once to `dtype` (what a decode step then reads per token)."""
    return jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p,
                        params)


def step_weight_bytes(cfg: ModelConfig, params) -> int:
    """The weights a decode step reads: all of them but the learned position table, of which it
    reads one row."""
    total = 0
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        table = any(getattr(k, "key", getattr(k, "name", None)) == "wpe" for k in path)
        total += x.nbytes // cfg.block_size if table else x.nbytes
    return total


def bandwidth_bound(cfg: ModelConfig, B: int, context: float, weight_bytes: int, itemsize: int,
                    copy_gbps: float, step_sec: float, read_gbps: float | None = None) -> dict:
    """Bytes a decode step must read (weights + this context's keys/values, at most block_size
    of them: the cache's window) and the time that takes at the measured copy (and read-only)
    bandwidth, against the measured step time."""
    context = min(context, cfg.block_size)
    kv_bytes = 2 * cfg.n_layer * B * context * cfg.kv_heads * cfg.head_dim * itemsize
    bound_sec = (weight_bytes + kv_bytes) / (copy_gbps * 1e9)
    row = {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "copy_gbps": copy_gbps,
           "bound_ms": 1e3 * bound_sec, "bw_util": bound_sec / step_sec}
    if read_gbps:
        read_sec = (weight_bytes + kv_bytes) / (read_gbps * 1e9)
        row.update(read_gbps=read_gbps, read_bound_ms=1e3 * read_sec, read_util=read_sec / step_sec)
    return row


def time_transformers(cfg: ModelConfig, B: int, P: int, N: int, reps: int) -> float:
    """Median seconds of Hugging Face `generate` (random weights of cfg's GPT-2 shape, CPU torch on
    every core) for B prompts of P tokens and exactly N new ones, temperature 1, top-k 200."""
    try:
        import torch
        import transformers
    except ImportError:
        print("error: --transformers needs torch and transformers (pip install -r requirements-test.txt)",
              file=sys.stderr)
        sys.exit(2)
    if (cfg.norm, cfg.mlp, cfg.pos_embedding) != ("layernorm", "gelu", "learned"):
        print("error: --transformers compares GPT-2's block only; drop it for this preset", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    hf_cfg = transformers.GPT2Config(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                                     n_positions=cfg.block_size, vocab_size=cfg.vocab_size)
    model = transformers.GPT2LMHeadModel(hf_cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (B, P))
    kw = dict(do_sample=True, temperature=1.0, top_k=200, top_p=1.0, max_new_tokens=N,
              min_new_tokens=N, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    with torch.inference_mode():
        ts = []
        for _ in range(reps + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            model.generate(prompt, **kw)
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts[1:])


def enable_compile_cache() -> str:
    """A process-local persistent compilation cache.

    full_recompute_generate builds its jitted forward inside each call, so without this every call
    would compile again; with it, the timed run reuses the warm-up's executables (it still traces
    and lowers, a few ms per context-length bucket).
    """
    import tempfile
    d = tempfile.mkdtemp(prefix="bench-sample-jaxcache-")
    jax.config.update("jax_compilation_cache_dir", d)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return d


# ----------------------------------------------------------------------------- speculative decoding

DRAFT_FLAGS = ["--n_layer=2", "--n_head=2", "--n_embd=128"]
SMALL_BATCH = ["--batch_size=8", "--dropout=0.0", "--eval_iters=20"]
PAIRS = {  # (target, draft) train.py flags; both on the bundled Shakespeare, so one char tokenizer
    "shakespeare": (["--preset=shakespeare-char"], ["--preset=shakespeare-char", *DRAFT_FLAGS]),
    # the same target architecture trained on 8 rows a step (half an hour, not a day, on a 2-core
    # CPU), no dropout, and a 4-layer, 128-wide draft (13x smaller) at the learning rate of the
    # `default` preset, which has its shape: for CPU sessions
    "shakespeare-small-batch": (["--preset=shakespeare-char", *SMALL_BATCH],
                                ["--preset=shakespeare-char", *SMALL_BATCH, "--n_layer=4", "--n_head=4",
                                 "--n_embd=128", "--learning_rate=4e-3", "--min_lr=4e-4"]),
    "tiny": (["--preset=tiny", "--n_embd=64", "--n_head=4", "--block_size=64"],
             ["--preset=tiny", "--block_size=64"]),
}


def train_cached(flags: list[str], iters: int, root: Path) -> Path:
    """The checkpoint dir of train.py run with `flags` for `iters` steps, trained on first use and
    cached by the flags (an interrupted run is resumed)."""
    from gpt.checkpoint import list_steps
    flags = flags + [f"--max_iters={iters}", f"--lr_decay_iters={iters}",
                     f"--eval_interval={iters}", f"--warmup_iters={min(100, iters // 10)}"]
    out = root / hashlib.sha256(json.dumps(flags).encode()).hexdigest()[:16]
    steps = list_steps(out)
    if not steps or steps[-1] < iters:
        resume = ["--init_from=resume"] if steps else []
        print(f"training {' '.join(flags)} into {out}", flush=True)
        subprocess.run([sys.executable, str(REPO / "train.py"), f"--out_dir={out}", "--no_progress",
                        *flags, *resume], check=True, cwd=REPO)
    return out


def train_pair(name: str, iters: int, root: Path, distill_rows: int = 0,
               draft_iters: int = 0) -> tuple[Path, Path]:
    """The pair's checkpoints (target, draft), trained for `iters` steps (the draft for
    `draft_iters` if given). With distill_rows, the draft is distilled from the target: it trains
    on one file, the target's greedy continuations of distill_rows windows of the training text
    followed by the corpus (`distillation_text`), drawing windows from all of it."""
    target_flags, draft_flags = PAIRS[name]
    target = train_cached(target_flags, iters, root)
    if distill_rows:
        draft_flags = draft_flags + [f"--input={distillation_text(target, distill_rows, root)}"]
    return target, train_cached(draft_flags, draft_iters or iters, root)


DISTILL_FORMAT = 1  # raise when `distillation_text` generates differently


def distillation_text(target_dir: Path, rows: int, root: Path, batch: int = 128) -> Path:
    """A text file (cached): the target's greedy continuations of `rows` random windows of the
    bundled corpus's training split, each prompt followed by its continuation, then the corpus
    itself. Sequence-level distillation (Kim & Rush, 2016; DistillSpec, Zhou et al., 2023): a draft
    that trained on what the target says at temperature 0 agrees with it far more often than one
    trained on the corpus alone. The corpus comes last so that the draft's validation split (the
    file's last 10%) lies in the corpus's end, and so that the draft's char vocabulary is the
    target's (`load_draft` checks). That split is longer than the target's, so part of it is text
    the target trained on; `corpus_prompt` (the last 5%) stays unseen by both while the
    continuations are under 9x the corpus. The name carries DISTILL_FORMAT, to be raised whenever
    the generation changes, so that a stale file (and the draft cached by its path) is not reused."""
    from gpt.checkpoint import load_model
    from gpt.corpus import val_cut
    from gpt.sampling import Sampler
    out = root / f"distill-v{DISTILL_FORMAT}-{target_dir.name}-{rows}x{batch}.txt"
    if out.exists():
        return out
    model, _, tok = load_model(target_dir, "float32")
    corpus = (REPO / "data" / "shakespeare.txt").read_bytes()
    train = corpus[:val_cut(len(corpus), 0.1)].decode("utf-8", errors="ignore")
    prompt_len = min(32, model.cfg.block_size // 4)
    new = min(224, model.cfg.block_size - prompt_len)
    sampler = Sampler(model, SamplingSettings(max_new_tokens=new, temperature=0.0), chunk=new)
    rng, pieces = np.random.default_rng(0), []
    print(f"distilling: {rows} greedy continuations of {new} tokens by the target", flush=True)
    for first in range(0, rows, batch):
        starts = rng.integers(0, len(train) - 4 * prompt_len, min(batch, rows - first))
        prompts = [tok.encode(train[s:s + 4 * prompt_len])[:prompt_len] for s in starts]
        pieces += [tok.decode(p + o) for p, o in zip(prompts, sampler.generate(prompts, jax.random.key(first)))]
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    tmp.write_text("\n\n".join(pieces) + "\n\n" + corpus.decode("utf-8"))
    tmp.replace(out)
    return out


def corpus_prompt(tok, n: int) -> list[int]:
    """n tokens from the validation end of the bundled corpus (text neither model trained on)."""
    text = (REPO / "data" / "shakespeare.txt").read_text()
    return tok.encode(text[-len(text) // 20:])[:n]


def plain_loop(model: GPT, params, prompt_BP, n: int):
    """A compiled call of n plain greedy cached decode steps after the prompt (prefill done here,
    not timed); it returns the tokens."""
    gd = nnx.graphdef(model)
    s = SamplingSettings(max_new_tokens=n, temperature=0.0)
    start = jnp.zeros((prompt_BP.shape[0],), jnp.int32)
    state = jax.jit(lambda p, x: prefill(nnx.merge(gd, p), x, start, jax.random.key(0), n))(params, prompt_BP)
    dec = jax.jit(lambda p, st: decode(nnx.merge(gd, p), st, n, s).tokens_BN)
    return lambda: dec(params, state)


def verify_loop(model: GPT, params, B: int, k: int, context: int, n: int, slots: int | None = None):
    """A compiled call of n verifying forwards of the target (k + 1 tokens into a per-row cache
    at `context`) in one loop, as the decode steps run, so call overhead is not counted. `slots`:
    the cache's size (the speculative loop's, which attention reads whole; default: just enough)."""
    from gpt.model import init_cache
    gd = nnx.graphdef(model)
    cache = init_cache(model.cfg, B, slots or min(context + k + 1, model.cfg.block_size), model.rt.dtype)
    cache = cache._replace(index=jnp.full((B,), min(context, cache.slots - k - 1), jnp.int32))

    @jax.jit
    def loop(params, cache):
        m = nnx.merge(gd, params)

        def body(i, carry):  # the same position every time: the cache's index is put back
            c, tokens_BT = carry
            logits_BTV, written = m(tokens_BT, cache=c)
            return written._replace(index=c.index), jnp.argmax(logits_BTV, -1).astype(jnp.int32)
        return jax.lax.fori_loop(0, n, body, (cache, jnp.zeros((B, k + 1), jnp.int32)))[1]
    return lambda: loop(params, cache)


def speculative_loop(target: GPT, draft: GPT, pt, pd, prompt_BP, n: int, k: int):
    """A compiled call of greedy speculative decoding of n tokens (prefill done here); it returns
    the final state."""
    gt, gd = nnx.graphdef(target), nnx.graphdef(draft)
    s = SamplingSettings(max_new_tokens=n, temperature=0.0)
    start = jnp.zeros((prompt_BP.shape[0],), jnp.int32)
    merge = lambda pt, pd: (nnx.merge(gt, pt), nnx.merge(gd, pd))
    st = jax.jit(lambda pt, pd, x: spec.prefill_speculative(*merge(pt, pd), x, start, jax.random.key(0), s, k))(
        pt, pd, prompt_BP)
    dec = jax.jit(lambda pt, pd, st: spec.decode_speculative(*merge(pt, pd), st, s, k, n))
    return lambda: dec(pt, pd, st)


def per_token_acceptance(tokens_per_round: float, k: int) -> float:
    """Leviathan et al.'s alpha, the chance that one drafted token is accepted, from the measured
    tokens per round (1 - a^(k+1)) / (1 - a) (bisection: increasing in a). Not the same as
    accepted / drafted, which also counts the drafts after a round's first rejection."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a ** i for i in range(k + 1)) < tokens_per_round else (lo, a)
    return (lo + hi) / 2


def predicted_speedup(tokens_per_round: float, k: int, t_target: float, t_draft: float,
                      t_verify: float, t_draft_first: float | None = None) -> float:
    """The measured tokens per round (per target forward) over a round's cost in target steps: the
    draft's first call (two tokens: the last kept one and the target's; `t_draft_first`, default
    one step), k - 1 one-token draft steps and one verifying forward."""
    first = t_draft if t_draft_first is None else t_draft_first
    return tokens_per_round * t_target / (first + (k - 1) * t_draft + t_verify)


def bench_speculative(args) -> dict:
    from gpt.checkpoint import load_model
    from gpt.model import num_params
    if args.target_dir and args.draft_dir:
        target_dir, draft_dir = Path(args.target_dir), Path(args.draft_dir)
    else:
        root = Path(os.environ.get("GPT_BENCH_CACHE", Path.home() / ".cache" / "gpt-jax-bench"))
        target_dir, draft_dir = train_pair(args.pair, args.pair_iters, root, args.distill_rows,
                                           args.draft_iters)
    target, _, tok = load_model(target_dir, args.dtype)
    draft = spec.load_draft(str(draft_dir), args.dtype, target, tok, str(target_dir), args.num_draft_tokens)
    target, draft = for_decoding(target), for_decoding(draft)  # as the samplers hold them
    held = lambda m: hold_in(nnx.state(m), m.rt.dtype) if args.weights == "compute" else nnx.state(m)
    pt, pd = held(target), held(draft)
    B, N, K = args.spec_batch, args.spec_tokens, args.num_draft_tokens
    prompt_BP = jnp.array([corpus_prompt(tok, args.prompt_len)] * B, jnp.int32)
    P = prompt_BP.shape[1]
    if P + 1 + N + K > min(target.cfg.block_size, draft.cfg.block_size):
        print(f"note: prompt + new tokens + {K} pass a block_size; rounds past it are target-only steps")
    slots = spec.cache_slots(target.cfg, P + 1 + N, K)  # the loop's cache (one padding column in front)
    t = interleaved({"target": plain_loop(target, pt, prompt_BP, N), "draft": plain_loop(draft, pd, prompt_BP, N),
                     "verify": verify_loop(target, pt, B, K, P + N // 2, N, slots),
                     "draft_first": verify_loop(draft, pd, B, 1, P + N // 2, N,
                                                spec.cache_slots(draft.cfg, P + 1 + N, K)),
                     "speculative": speculative_loop(target, draft, pt, pd, prompt_BP, N, K)}, args.reps)
    (t_spec, st), plain_tokens = t["speculative"], t["target"][1]
    t_target, t_draft, t_verify, t_first = (t[name][0] / N
                                            for name in ("target", "draft", "verify", "draft_first"))
    stats = spec.SpeculativeSampler.stats(st)
    alpha = stats["acceptance_rate"]
    per_round = N / stats["target_forwards"]  # tokens per round (one target forward each)
    weight_bytes = step_weight_bytes(target.cfg, pt)
    row = {"target": str(target_dir), "draft": str(draft_dir), "target_params_m": num_params(target.cfg) / 1e6,
           "draft_params_m": num_params(draft.cfg) / 1e6, "batch": B, "prompt_len": P, "new_tokens": N,
           "num_draft_tokens": K, "plain_tokens_per_sec": B / t_target,
           "speculative_tokens_per_sec": B * N / t_spec, "speedup": t_target * N / t_spec,
           "acceptance_rate": alpha, "tokens_per_target_forward": per_round,
           "target_step_ms": 1e3 * t_target, "draft_step_ms": 1e3 * t_draft, "verify_ms": 1e3 * t_verify,
           "draft_first_ms": 1e3 * t_first,
           "per_token_acceptance": per_token_acceptance(per_round, K),
           "predicted_speedup": predicted_speedup(per_round, K, t_target, t_draft, t_verify, t_first),
           "same_tokens": bool((spec.output_tokens(st, None, K)[:, 1:] == plain_tokens).all()),
           **bandwidth_bound(target.cfg, B, P + N / 2, weight_bytes, jnp.dtype(target.rt.dtype).itemsize,
                             args.copy_gbps, t_target, args.read_gbps)}
    print(f"speculative decoding, K={K}, batch {B}, greedy: plain {row['plain_tokens_per_sec']:.1f} tok/s "
          f"({100 * row['bw_util']:.0f}% of the bandwidth bound), speculative "
          f"{row['speculative_tokens_per_sec']:.1f} tok/s: {row['speedup']:.2f}x (predicted "
          f"{row['predicted_speedup']:.2f}x); acceptance {100 * alpha:.0f}% of drafts, "
          f"{100 * row['per_token_acceptance']:.0f}% per token, "
          f"{row['tokens_per_target_forward']:.2f} tokens per target forward; steps: target "
          f"{row['target_step_ms']:.2f} ms, draft {row['draft_step_ms']:.2f} ms (first of a round "
          f"{row['draft_first_ms']:.2f} ms), verify "
          f"{row['verify_ms']:.2f} ms; same tokens: {row['same_tokens']}", flush=True)
    return row


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, checked: comma lists as lists, presets known, --dtype resolved (which
    starts JAX's backend: run_cpu_programs_inline must come first)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="tiny,shakespeare-char,gpt2")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt_len", type=int, default=16)
    ap.add_argument("--new_tokens", type=int, default=256)
    ap.add_argument("--baseline_tokens", type=int, default=0,
                    help="tokens the no-cache baseline generates (0: --new_tokens)")
    ap.add_argument("--baseline_batches", default="1",
                    help="batch sizes that also run the baseline (comma list; empty: none)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="auto: what sample.py picks (gpt.runtime.decoding_dtype)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--baseline_reps", type=int, default=1, help="timed baseline runs (slow)")
    ap.add_argument("--weights", default="compute", choices=("compute", "float32"),
                    help="parameters as held while decoding: cast to the compute dtype, or float32")
    ap.add_argument("--transformers", action="store_true",
                    help="also time Hugging Face generate on the same shapes (test-only torch)")
    ap.add_argument("--decode_kernels", action="store_true",
                    help="also batch 1 through gpt/ops/decode_kernels.py's Pallas kernels (sample.py's flag)")
    ap.add_argument("--speculative", action="store_true", help="also plain vs speculative decoding")
    ap.add_argument("--pair", default="shakespeare", choices=tuple(PAIRS))
    ap.add_argument("--pair_iters", type=int, default=2000, help="training steps of each model of --pair")
    ap.add_argument("--draft_iters", type=int, default=0, help="the draft's training steps (0: --pair_iters)")
    ap.add_argument("--distill_rows", type=int, default=0,
                    help="N > 0: the pair's draft also trains on N greedy continuations by its target")
    ap.add_argument("--target_dir", default="", help="a trained target (with --draft_dir: no training)")
    ap.add_argument("--draft_dir", default="")
    ap.add_argument("--num_draft_tokens", type=int, default=4)
    ap.add_argument("--spec_tokens", type=int, default=200, help="new tokens of the speculative comparison")
    ap.add_argument("--spec_batch", type=int, default=1)
    args = ap.parse_args(argv)
    args.dtype = decoding_dtype(args.dtype)
    for name in ("batches", "baseline_batches"):
        raw = getattr(args, name)
        if not re.fullmatch(r"[0-9,]*", raw) or any(b and int(b) < 1 for b in raw.split(",")):
            ap.error(f"--{name}={raw}: a comma list of batch sizes, each at least 1")
        setattr(args, name, [int(b) for b in raw.split(",") if b])
    for name in ("prompt_len", "new_tokens", "reps", "baseline_reps", "spec_tokens", "spec_batch", "num_draft_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}={getattr(args, name)} must be at least 1")
    args.configs = [c for c in args.configs.split(",") if c]
    for c in args.configs:
        if c not in PRESETS:
            ap.error(f"unknown config {c!r} (choose from {', '.join(PRESETS)})")
        if args.decode_kernels and (problem := decode_kernels_problem(preset_model(c))):
            ap.error(f"--decode_kernels: config {c} has {problem}")
    if args.distill_rows < 0 or (args.distill_rows and args.target_dir):
        ap.error("--distill_rows must be >= 0, and applies to a --pair trained here, not to --target_dir")
    if args.draft_iters < 0:
        ap.error("--draft_iters must be >= 0 (0: --pair_iters)")
    return args


def main(argv: list[str]) -> int:
    run_cpu_programs_inline()  # as sample.py runs; before parse_args, whose dtype starts JAX's client
    args = parse_args(argv)
    cache_dir = enable_compile_cache()
    device = metrics_lib.device_name()
    args.copy_gbps = metrics_lib.measure_copy_gbps()
    args.read_gbps = metrics_lib.measure_read_gbps()
    print(f"device: {device}; jax {jax.__version__}; prompt {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens; weights {args.weights}; measured bandwidth: copy "
          f"{args.copy_gbps:,.0f} GB/s (read + write), read {args.read_gbps:,.0f} GB/s")
    rows = []
    if args.configs:
        print(f"{'config':<17} {'batch':>5} {'prefill ms':>11} {'cached tok/s':>12} {'ms/step':>9} "
              f"{'nocache t/s':>10} {'speedup':>9} {'bw bound':>9} {'read bnd':>9}"
              + (f" {'HF tok/s':>10} {'vs HF':>8}" if args.transformers else ""))
    for c in args.configs:
        rows += bench_config(c, args)
        if args.decode_kernels:
            rows += bench_config(c, args, kernels=True)
    speculative = bench_speculative(args) if args.speculative else None
    print(json.dumps({"device": device, "jax": jax.__version__, "prompt_len": args.prompt_len,
                      "new_tokens": args.new_tokens, "weights": args.weights,
                      "copy_gbps": args.copy_gbps, "read_gbps": args.read_gbps, "results": rows,
                      "speculative": speculative}))
    shutil.rmtree(cache_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
