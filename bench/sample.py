"""Sampling benchmark: KV-cached prefill + decode against the no-cache baseline.

    python bench/sample.py [--configs=tiny,shakespeare-char,gpt2] [--batches=1,16]
                           [--prompt_len=16] [--new_tokens=256] [--baseline_tokens=N]
                           [--baseline_batches=1] [--dtype=auto] [--reps=3] [--baseline_reps=1]
                           [--weights=compute|float32]

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
it reached (`bw_util`): batch-1 decoding is bound by reading the weights, not by FLOPs.
The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from gpt import metrics as metrics_lib  # noqa: E402
from gpt.config import (PRESETS, ComputeConfig, ModelConfig, validate_compute,  # noqa: E402
                        validate_model)
from gpt.model import GPT, num_params  # noqa: E402
from gpt.runtime import resolve  # noqa: E402
from bench.nocache import full_recompute_generate  # noqa: E402
from gpt.sampling import SamplingSettings, decode, prefill  # noqa: E402

ARCH = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size")
CHAR_VOCAB = 65


def build_model(name: str, dtype: str) -> tuple[ModelConfig, GPT]:
    """Preset `name`'s architecture with random weights, computed in `dtype`."""
    p = PRESETS[name]
    kw = {k: p[k] for k in ARCH if k in p}
    kw.setdefault("vocab_size", CHAR_VOCAB)  # the char presets take their vocabulary from the data
    cfg = validate_model(ModelConfig(**kw))
    rt = resolve(cfg, validate_compute(ComputeConfig(dtype=dtype)))
    return cfg, GPT(cfg, rngs=nnx.Rngs(0), runtime=rt)


def timed(fn, reps: int):
    out = fn()  # warm-up (compiles)
    jax.block_until_ready(out)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), out


def bench_config(name: str, args) -> list[dict]:
    cfg, model = build_model(name, args.dtype)
    gd, params = nnx.split(model)
    dtype = model.rt.dtype
    if args.weights == "compute":
        params = hold_in(params, dtype)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    s = SamplingSettings(max_new_tokens=args.new_tokens, temperature=1.0, top_k=200)
    P, N = args.prompt_len, args.new_tokens
    pf = jax.jit(lambda params, prompt, start, key: prefill(nnx.merge(gd, params), prompt, start,
                                                            key, N))
    dec = jax.jit(lambda params, state: decode(nnx.merge(gd, params), state, N, s))
    rows = []
    for B in args.batches:
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
               **bandwidth_bound(cfg, B, P + N / 2, weight_bytes, jnp.dtype(dtype).itemsize,
                                 args.copy_gbps, t_dec / N)}
        if B in args.baseline_batches:
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
        print(f"{name:<17} {B:>5} {row['prefill_ms']:>11.1f} {row['decode_tokens_per_sec']:>12.1f} "
              f"{row['ms_per_step']:>9.2f} {base} {100 * row['bw_util']:>8.0f}%", flush=True)
    return rows


def hold_in(params, dtype):
    """The floating parameters cast once to `dtype` (what a decode step then reads per token)."""
    return jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p,
                        params)


def bandwidth_bound(cfg: ModelConfig, B: int, context: float, weight_bytes: int, itemsize: int,
                    copy_gbps: float, step_sec: float) -> dict:
    """Bytes a decode step must read (weights + this context's keys/values) and the time that
    takes at the measured bandwidth, against the measured step time."""
    kv_bytes = 2 * cfg.n_layer * B * context * cfg.n_embd * itemsize
    bound_sec = (weight_bytes + kv_bytes) / (copy_gbps * 1e9)
    return {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "copy_gbps": copy_gbps,
            "bound_ms": 1e3 * bound_sec, "bw_util": bound_sec / step_sec}


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


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="tiny,shakespeare-char,gpt2")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt_len", type=int, default=16)
    ap.add_argument("--new_tokens", type=int, default=256)
    ap.add_argument("--baseline_tokens", type=int, default=0,
                    help="tokens the no-cache baseline generates (0: --new_tokens)")
    ap.add_argument("--baseline_batches", default="1",
                    help="batch sizes that also run the baseline (comma list; empty: none)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--baseline_reps", type=int, default=1, help="timed baseline runs (slow)")
    ap.add_argument("--weights", default="compute", choices=("compute", "float32"),
                    help="parameters as held while decoding: cast to the compute dtype, or float32")
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.baseline_batches = [int(b) for b in args.baseline_batches.split(",") if b]
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in PRESETS:
            ap.error(f"unknown config {c!r} (choose from {', '.join(PRESETS)})")
    cache_dir = enable_compile_cache()
    device = metrics_lib.device_name()
    args.copy_gbps = metrics_lib.measure_copy_gbps()
    print(f"device: {device}; jax {jax.__version__}; prompt {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens; weights {args.weights}; measured copy bandwidth "
          f"{args.copy_gbps:,.0f} GB/s")
    print(f"{'config':<17} {'batch':>5} {'prefill ms':>11} {'cached tok/s':>12} {'ms/step':>9} "
          f"{'nocache t/s':>10} {'speedup':>9} {'bw bound':>9}")
    rows = []
    for c in configs:
        rows += bench_config(c, args)
    print(json.dumps({"device": device, "jax": jax.__version__, "prompt_len": args.prompt_len,
                      "new_tokens": args.new_tokens, "weights": args.weights,
                      "copy_gbps": args.copy_gbps, "results": rows}))
    import shutil
    shutil.rmtree(cache_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
