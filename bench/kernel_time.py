"""Where a step's time goes: device time per XLA op and per kernel, from a jax.profiler trace.

    python bench/kernel_time.py train [--key=value ...] [--runtime=KEY=VALUE,...] [--steps=N]
                                      # a training step (bench/train.py's, --runtime as there)
    python bench/kernel_time.py decode [--config=gpt2] [--batch=1] [--new_tokens=64] [--weights=compute]

It traces a few steps after warm-up and prints the ops and kernels that take the most device time
(per step), grouped into matmuls, attention, fusions (elementwise/reductions), copies and the rest,
with the gaps where the device sat idle. It reads the trace with `jax.profiler.ProfileData`, so
neither TensorBoard nor a GPU profiler is needed; on CPU the "device" is the host's XLA threads.
The last line printed is one JSON object: per timeline, the busy time and span per step, the time
per group and the top names. Training settings are parsed like train.py's, so the gpt2 preset
accumulates 40 micro-batches a step (nanoGPT's setting): `--gradient_accumulation_steps=1` profiles
one batch's step, as bench/gpu.py's part "profile" does.
"""
from __future__ import annotations

import argparse
import collections
import glob
import importlib.util
import json
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import jax  # noqa: E402

from gpt.errors import run_main  # noqa: E402

# Attention first: cuDNN's flash kernels also name wgmma; cuBLAS's Hopper GEMMs are "nvjet_*".
GROUPS = [("attention", re.compile(r"cudnn|fmha|flash|sdpa|attention|dot_product", re.I)),
          ("matmul", re.compile(r"gemm|cublas|nvjet|dot|matmul|triton_gemm|wgmma|sm90_xmma", re.I)),
          ("copy", re.compile(r"copy|transpose|dynamic.update.slice|memcpy|memset", re.I)),
          ("collective", re.compile(r"all.reduce|all.gather|reduce.scatter|nccl", re.I)),
          ("fusion", re.compile(r"fusion|reduce|loop_|input_|kernel", re.I))]


def group(name: str) -> str:
    return next((g for g, rx in GROUPS if rx.search(name)), "other")


def device_events(xspace_path: str) -> dict[str, list[tuple[str, float, float]]]:
    """{line name: [(event name, start ns, duration ns)]} of the first accelerator plane (or the
    host's XLA threads on CPU)."""
    from jax.profiler import ProfileData
    pd = ProfileData.from_file(xspace_path)
    planes = [p for p in pd.planes if p.name.startswith("/device:")] or \
             [p for p in pd.planes if p.name == "/host:CPU"]
    out: dict[str, list] = {}
    for line in planes[0].lines:
        if line.name == "python":
            continue
        evs = [(e.name, e.start_ns, e.duration_ns) for e in line.events if e.duration_ns > 0]
        if evs:
            out[line.name] = evs
    return out


def summarise(line_name: str, evs: list, steps: int, top: int) -> dict:
    """One timeline's device time per step: busy and span, by group, and the `top` names."""
    total = sum(d for _, _, d in evs)
    span = max(s + d for _, s, d in evs) - min(s for _, s, _ in evs)
    by_group, by_name, count = collections.Counter(), collections.Counter(), collections.Counter()
    for name, _, d in evs:
        key = re.sub(r"\.\d+$", "", name) if len(name) > 60 else name
        by_name[key] += d
        count[key] += 1
        by_group[group(name)] += d
    ms = lambda ns: ns / steps / 1e6  # noqa: E731
    return {"line": line_name, "events_per_step": len(evs) / steps, "busy_ms": ms(total),
            "span_ms": ms(span), "groups": {g: ms(v) for g, v in by_group.most_common()},
            "top": [{"name": n, "ms": ms(d), "per_step": count[n] / steps, "group": group(n)}
                    for n, d in by_name.most_common(top)]}


def report(lines: dict[str, list], steps: int, top: int) -> list[dict]:
    """Prints each device timeline's summary (XLA's op and stream lines where there are several)
    and returns them."""
    out = []
    for line_name, evs in lines.items():
        if not re.search(r"XLA Ops|Stream|XLA", line_name) and len(lines) > 1:
            continue
        x = summarise(line_name, evs, steps, top)
        busy = max(x["busy_ms"], 1e-12)
        print(f"\n== {line_name}: {x['events_per_step']:.0f} events/step, busy {x['busy_ms']:.2f} "
              f"ms/step of a {x['span_ms']:.2f} ms/step span ({100 * busy / max(x['span_ms'], 1e-9):.0f}%)")
        print("   " + ", ".join(f"{g} {v:.2f} ms ({100 * v / busy:.0f}%)" for g, v in x["groups"].items()))
        for k in x["top"]:
            print(f"   {k['ms']:8.3f} ms {100 * k['ms'] / busy:5.1f}% x{k['per_step']:5.1f}  "
                  f"[{k['group']}] {k['name'][:110]}")
        out.append(x)
    return out


def trace(fn, steps: int) -> str:
    d = tempfile.mkdtemp(prefix="profile-")
    with jax.profiler.trace(d):
        for _ in range(steps):
            fn()
    return glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0]


def train_step_fn(rest: list[str]):
    spec = importlib.util.spec_from_file_location("bench_train", REPO / "bench" / "train.py")
    bt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bt)
    from gpt.config import build_train
    override, rest = bt.runtime_only(rest)
    override = bt.runs_here(override)
    m, c, t, _ = build_train(rest)
    v = bt.Variant(m, c, t, override)
    return lambda: v.run_steps(1, timed=False)


def decode_fn(args):
    import jax.numpy as jnp
    from flax import nnx

    spec = importlib.util.spec_from_file_location("bench_sample", REPO / "bench" / "sample.py")
    bs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bs)
    from gpt.model import for_decoding
    from gpt.sampling import SamplingSettings, decode, prefill
    cfg, model = bs.build_model(args.config, args.dtype)
    gd, params = nnx.split(for_decoding(model))  # as gpt.sampling.Sampler holds it
    if args.weights == "compute":
        params = bs.hold_in(params, model.rt.dtype)
    s = SamplingSettings(max_new_tokens=args.new_tokens, temperature=1.0, top_k=200)
    prompt = jax.random.randint(jax.random.key(0), (args.batch, 16), 0, cfg.vocab_size, jnp.int32)
    state = jax.jit(lambda p: prefill(nnx.merge(gd, p), prompt, jnp.zeros((args.batch,), jnp.int32),
                                      jax.random.key(1), args.new_tokens))(params)
    def decode_tokens(p, st):  # named: bench/gpu.py finds its compilation by this name
        return decode(nnx.merge(gd, p), st, args.new_tokens, s).tokens_BN

    dec = jax.jit(decode_tokens)
    return lambda: dec(params, state).block_until_ready()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("train", "decode"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--config", default="gpt2")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--dtype", default=None, help="the compute dtype (default: a config's, else auto)")
    ap.add_argument("--weights", default="compute", choices=("compute", "float32"))
    args, rest = ap.parse_known_args(argv)
    from gpt.runtime import run_cpu_programs_inline
    run_cpu_programs_inline()  # as train.py and sample.py run
    if args.what == "train":  # --dtype is train.py's setting too: the step gets it back
        fn = train_step_fn(rest + ([f"--dtype={args.dtype}"] if args.dtype else []))
    else:
        args.dtype = args.dtype or "auto"
        fn = decode_fn(args)
    for _ in range(2):
        fn()  # compile and warm up
    lines = device_events(trace(fn, args.steps))
    per = args.steps * (args.new_tokens if args.what == "decode" else 1)
    print(f"{args.what}: per {'decoded token' if args.what == 'decode' else 'step'} "
          f"(averaged over {per})")
    summary = report(lines, per, args.top)
    print(json.dumps({"what": args.what, "averaged_over": per, "lines": summary}))  # the last line
    return 0


if __name__ == "__main__":
    run_main(main)  # bad settings: one line, exit status 2
