"""Kernels per decoded token as XLA compiles the sampler's loop for a GPU, on a machine without one.

    python bench/kernel_count.py [--target=h200|h100|cpu] [--config=gpt2] [--batch=1] [--top_k=200]
                                 [--new_tokens=64] [--decode_kernels] [--list] [--plan] [--json=PATH]
    python bench/kernel_count.py --program=train [--target=...] [--list] [--plan] [train.py's settings]
                                 [--runtime=KEY=VALUE,...]  (bench/train.py's)

Batch-1 decoding on a GPU is a chain of small kernels, each 2-3 us on an H200 whatever little it
does, so the number of kernels per token is what a change to the decoding step has to lower (the
profile and the timings are in BENCHMARKS.md). XLA compiles for a GPU that is described, not
present (`jax.experimental.topologies` with a target config: ahead-of-time compilation): this
needs JAX's CUDA plugin in a virtual environment of its own (`pip install -r requirements.txt
"jax-cuda12-plugin[with-cuda]==<the jax version>"`, about 6 GB in all), and no driver and no device.
--target=cpu compiles for this host instead, with no plugin (what the tests run).

The count is of the compiled decode loop's body (one token): every fusion, library call (cuBLAS,
cuDNN, sort) and copy it launches, with what its calls launch and its inner loops times their trip
counts (XLA:CPU draws random bits in small loops); the loop's condition and the kernels outside the
loop are counted apart. Without a device XLA neither autotunes nor sizes CUB's scratch, so it takes
its fallback sort for top-k and default GEMM configurations (it might pick another GEMM, or split
one): the kernels' speed may differ from a compilation on the GPU, and their number about as much
as seen so far (GPT-2 at batch 1, at the commit before this tool: 173 here, 172 in the H200's
profile of the same code).

--plan also reads the plan XLA's GPU runtime executes (the thunk sequence after its passes, from
an `--xla_dump_to` folder): how many CUDA graphs (command buffers) a run launches, how many kernels
they hold and what runs outside them (cuDNN calls, loops), per iteration of each while loop. A
decode loop of known trip count runs its body without reading the condition back to the host;
GPT-2's body is one graph a token (BENCHMARKS.md), so its kernels' own time is what is left.

--program=train compiles `bench/train.py`'s training step instead and adds up the bytes each
kernel reads and writes (its operands and result, each once; of an operand that a fusion only
slices or gathers from, the entries it takes; an in-place update still counts its whole operand)
by group: the matmuls, attention, and the rest, the fusions (GPT-2 at batch 64, H200, at 5b71d82:
43.3 ms of them in the profile, 145 GB here). Bytes are a lead, not a time: 48 GB fewer by this
count made the H200's step 3.5 ms shorter, not the 14 ms that 3.4 TB/s would give (BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import math
import os
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# A plugin with no driver behind it fails its start-up check; the CPU stays the default backend
# (nothing runs on the described GPU, it is only compiled for).
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bench import plan  # noqa: E402
from gpt.errors import ArgParser, UserError, run_main  # noqa: E402

# The GPUs as XLA describes them (its gpu_specs); only the fusion and layout decisions read these.
GPUS = {
    "h100": dict(core_count=132, memory_bandwidth=3352320000000, l2_cache_size=52428800,
                 device_memory_size=84929347584, clock_rate_ghz=1.98, name="NVIDIA H100 80GB HBM3"),
    "h200": dict(core_count=132, memory_bandwidth=4800000000000, l2_cache_size=52428800,
                 device_memory_size=150754820096, clock_rate_ghz=1.98, name="NVIDIA H200"),
}
NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
               "add-dependency", "opt-barrier", "partition-id", "replica-id", "async-done",
               "copy-done", "get-dimension-size"}


def target_config(gpu: str) -> str:
    """XLA's GpuTargetConfig (text proto) of a Hopper GPU (compute capability 9.0)."""
    g = GPUS[gpu]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: {g['core_count']}
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {g['memory_bandwidth']} l2_cache_size: {g['l2_cache_size']}
  clock_rate_ghz: {g['clock_rate_ghz']} device_memory_size: {g['device_memory_size']}
  shared_memory_per_block_optin: 232448 cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 9 }}
device_description_str: "{g['name']}"
"""


def device_sharding(target: str):
    """Where the program's arguments live: the described GPU, or this host's first CPU."""
    import jax
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec
    if target == "cpu":
        return jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    try:
        topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                            target_config=target_config(target))
    except (NotImplementedError, RuntimeError) as e:
        raise UserError(f"no compiler for a GPU here ({str(e).splitlines()[0]}); install JAX's CUDA "
                        f"plugin in this environment (this file's docstring says how), or use --target=cpu")
    return NamedSharding(topologies.make_mesh(topo, (1,), ("d",)), PartitionSpec())


def _backend(target: str) -> str:
    return "cpu" if target == "cpu" else "gpu"


def _placed(tree, sharding):
    """Shapes and dtypes of `tree`'s arrays, placed on `sharding` (what `lower` compiles for)."""
    import jax
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def decode_program(args, sharding) -> tuple[str, str]:
    """The optimised HLO of `bench/sample.py`'s decode loop (the sampler's `for_decoding` model,
    the weights in the compute dtype, top-k sampling) compiled for `sharding`'s device, from shapes
    alone: no weights are made. Returns it and the compute dtype's name."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bench.sample import hold_in, preset_model
    from gpt.config import ComputeConfig, validate_compute
    from gpt.model import GPT, for_decoding
    from gpt.runtime import decode_kernels_on, decoding_dtype, resolve
    from gpt.sampling import SamplingSettings, decode, prefill
    cfg = preset_model(args.config)
    backend = _backend(args.target)
    dtype = decoding_dtype(args.dtype or "auto", backend)
    kernels = decode_kernels_on(backend) if args.decode_kernels else ""
    rt = resolve(cfg, validate_compute(ComputeConfig(dtype=dtype)), backend, decode_kernels=kernels)
    gd, params = nnx.split(nnx.eval_shape(lambda: for_decoding(GPT(cfg, rngs=nnx.Rngs(0), runtime=rt))))
    params = jax.eval_shape(lambda p: hold_in(p, rt.dtype), params)
    N, B = args.new_tokens, args.batch
    s = SamplingSettings(max_new_tokens=N, temperature=1.0, top_k=args.top_k)
    prompt, start = jax.ShapeDtypeStruct((B, 16), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32)
    state = jax.eval_shape(lambda p, x, st, k: prefill(nnx.merge(gd, p), x, st, k, N),
                           params, prompt, start, jax.random.key(0))
    step = jax.jit(lambda p, st: decode(nnx.merge(gd, p), st, N, s).tokens_BN)
    return step.lower(*_placed((params, state), sharding)).compile().as_text(), rt.dtype.name


def train_program(args, rest: list[str], sharding) -> tuple[str, str]:
    """The optimised HLO of `bench/train.py`'s training step (train.py's settings in `rest`),
    compiled for `sharding`'s device from shapes alone. Returns it and the compute dtype's name."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bench.sample import CHAR_VOCAB
    from bench.train import runtime_only
    from gpt.config import build_train
    from gpt.model import abstract_model
    from gpt.runtime import compiler_options, resolve
    from gpt.train import make_optimizer, make_train_step, moe_training
    override, rest = runtime_only(rest)  # --runtime as bench/train.py's
    m, c, t, explicit = build_train(rest + ([f"--dtype={args.dtype}"] if args.dtype else []))
    if "vocab_size" not in explicit and t.tokenizer == "char":  # as bench/train.py
        m = dataclasses.replace(m, vocab_size=CHAR_VOCAB)
    rt = resolve(m, c, _backend(args.target), **override)
    model = abstract_model(m, t.seed, rt)  # shapes only
    graphdef, params = nnx.graphdef(model), nnx.to_pure_dict(nnx.state(model))
    tx = make_optimizer(t)
    x = jax.ShapeDtypeStruct((t.gradient_accumulation_steps, t.batch_size, m.block_size), jnp.int32)
    step = jax.jit(make_train_step(graphdef, tx, t.seed, train_mode=rt.dropout > 0, moe=moe_training(t)),
                   donate_argnums=(0, 1), compiler_options=compiler_options(rt))
    args_ = (params, jax.eval_shape(tx.init, params), jax.ShapeDtypeStruct((), jnp.int32), x, x)
    return step.lower(*_placed(args_, sharding)).compile().as_text(), rt.dtype.name


def computations(hlo: str) -> dict[str, list[str]]:
    """{computation name: its instruction lines} of an HLO module's text ("ENTRY": the entry)."""
    comps, body = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            body = comps.setdefault("ENTRY" if head.group(1) else head.group(2), [])
        elif line.startswith("}"):
            body = None
        elif body is not None and " = " in line:
            body.append(line.strip())
    return comps


@dataclasses.dataclass
class Kernels:
    """What one run of a computation launches: its own kernels (name, kind) in order, those of
    the computations it calls inlined; its while loops (body, condition, trip count or None); its
    conditionals' branches."""
    launched: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    loops: list[tuple["Kernels", "Kernels", int | None]] = dataclasses.field(default_factory=list)
    branches: list[list["Kernels"]] = dataclasses.field(default_factory=list)
    moved: list[int] = dataclasses.field(default_factory=list)  # bytes of each launched kernel

    def flat(self) -> list[tuple[str, str, int]]:
        """Every kernel one run launches, (name, kind, bytes): loops unrolled by their known trip
        counts (the condition once more; loops of unknown length left out), a conditional's
        largest branch."""
        out = [(name, kind, size) for (name, kind), size in zip(self.launched, self.moved)]
        for body, cond, n in self.loops:
            out += (body.flat() * n + cond.flat() * (n + 1)) if n is not None else []
        for branches in self.branches:
            out += max((b.flat() for b in branches), key=len)
        return out

    def count(self) -> tuple[int, int, int]:
        """(fewest, most) kernels one run launches, its loops run their known trip counts (the
        condition once more) and one branch of each conditional; and the loops of unknown trip
        count, left out of both."""
        lo = hi = len(self.launched)
        unknown = 0
        for body, cond, n in self.loops:
            (b_lo, b_hi, b_unk), (c_lo, c_hi, c_unk) = body.count(), cond.count()
            if n is None:
                unknown += 1
                continue
            lo, hi = lo + n * b_lo + (n + 1) * c_lo, hi + n * b_hi + (n + 1) * c_hi
            unknown += b_unk + c_unk
        for branches in self.branches:
            counts = [b.count() for b in branches]
            lo, hi = lo + min(c[0] for c in counts), hi + max(c[1] for c in counts)
            unknown += max(c[2] for c in counts)
        return lo, hi, unknown


def _called(line: str, key: str) -> str:
    return re.search(rf"{key}=%?([\w.\-]+)", line).group(1)


def _branches(line: str) -> list[str]:
    """A conditional's branch computations, as printed for an index or for a predicate."""
    listed = re.search(r"branch_computations=\{([^}]*)\}", line)
    if listed:
        return [n.strip().lstrip("%") for n in listed.group(1).split(",")]
    return [_called(line, "true_computation"), _called(line, "false_computation")]


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
             "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def shape_bytes(shape: str) -> int:
    """Bytes of the arrays an HLO shape names (a tuple's elements summed)."""
    arrays = re.findall(r"\b(pred|[su](?:8|16|32|64)|bf16|f16|f32|f64)\[([\d,]*)\]", shape)
    return sum(_ITEMSIZE[dtype] * math.prod(int(d) for d in dims.split(",") if d) for dtype, dims in arrays)


# Ops a fusion computes element by element (an entry of the result from the same entry of each
# operand, or a relabelling of entries): what they read of an operand is what their users read.
# The few-entry reads: slices and gathers read only the entries they return.
_PASS_THROUGH = {"bitcast", "convert", "reshape", "copy", "transpose", "select", "compare", "add",
                 "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs", "exponential",
                 "log", "tanh", "and", "or", "not", "clamp"}
_FEW_ENTRIES = {"slice", "dynamic-slice", "gather"}


def _users(body: list[str]) -> dict[str, list[tuple[str, str, list[str], str]]]:
    """{instruction: its users in a computation, each (name, op, operand names, result shape)}."""
    users: dict[str, list[tuple[str, str, list[str], str]]] = collections.defaultdict(list)
    for line in body:
        head, rest = line.split(" = ", 1)
        op = re.search(r"\b([a-z][\w\-]*)\(", rest).group(1)
        result, args = rest.split(op + "(", 1)
        operands = [a.lstrip("%") for a in re.findall(r"%[\w.\-]+", args.split(")", 1)[0])]
        for o in set(operands):
            users[o].append((_name(head), op, operands, result))
    return users


def _entries_read(users: dict, name: str) -> int | None:
    """How many entries of instruction `name` a fused computation reads, if it reads it only
    through slices and gathers, directly or through element-by-element ops (a converted row's
    first entries are all it converts): the entries of the distinct slices and gathers reached.
    None if it reads all of it (another use, or it is the fusion's result)."""
    taken, seen, todo = {}, {name}, [name]
    while todo:
        at = todo.pop()
        if not users.get(at):
            return None  # the fusion's result: every entry is computed
        for user, op, operands, result in users[at]:
            if op in _FEW_ENTRIES and operands[0] == at and operands.count(at) == 1:
                taken[user] = shape_bytes(result) // max(_itemsize(result), 1)
            elif op in _PASS_THROUGH:
                if user not in seen:
                    seen.add(user)
                    todo.append(user)
            else:
                return None
    return sum(taken.values())


def _itemsize(shape: str) -> int:
    """Bytes per entry of an array shape's type; 0 for a type `shape_bytes` does not know either."""
    found = re.search(r"\b(pred|[su](?:8|16|32|64)|bf16|f16|f32|f64)\[", shape)
    return _ITEMSIZE[found.group(1)] if found else 0


def _result_type(rest: str) -> str:
    """An instruction's result type: the text before its op's "(" (the rest of a line can name
    other shapes, such as a custom call's operand_layout_constraints, that are not its result)."""
    return rest[:re.search(r"\b[a-z][\w\-]*\(", rest).start()]


def _kernel_bytes(rest: str, op: str, shapes: dict[str, str], comps: dict[str, list[str]]) -> int:
    """A kernel's result and operands in bytes: what it moves if it reads each of its operands
    once, or, of an operand a fusion only slices or gathers from, the entries it takes (at most
    the whole operand). In-place updates still count their whole operand and result; overlapping
    slices count each."""
    operands = re.findall(r"%([\w.\-]+)", rest.split(op + "(", 1)[1].split(")", 1)[0])
    body = comps.get(_called(rest, "calls"), []) if op == "fusion" else []
    params = {int(m.group(2)): m.group(1) for m in
              (re.match(r"%?([\w.\-]+) = .* parameter\((\d+)\)", line) for line in body) if m}
    users = _users(body) if body else {}
    read = 0
    for i, o in enumerate(operands):
        entries = _entries_read(users, params[i]) if i in params else None
        full = shape_bytes(shapes.get(o, ""))
        read += full if entries is None or not full else min(full, entries * _itemsize(shapes[o]))
    return shape_bytes(_result_type(rest)) + read


def _name(head: str) -> str:
    """The instruction's name from the text before its " = "."""
    return head.replace("ROOT ", "").strip().lstrip("%")


def kernels(comps: dict[str, list[str]], name: str) -> Kernels:
    """What computation `name` launches (see Kernels). A fusion, a library call or a sort is one
    kernel (the computation it names is not followed); a `call` (XLA:CPU's small calls, XLA:GPU's
    command buffers) or an async start launches what its computation does."""
    out = Kernels()
    shapes = {_name(head): _result_type(rest) for head, rest in (line.split(" = ", 1) for line in comps[name])}
    for line in comps[name]:
        head, rest = line.split(" = ", 1)
        op = re.search(r"\b([a-z][\w\-]*)\(", rest).group(1)
        if op == "while":
            trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            body, cond = (kernels(comps, _called(line, key)) for key in ("body", "condition"))
            out.loops.append((body, cond, int(trip.group(1)) if trip else None))
        elif op == "conditional":
            out.branches.append([kernels(comps, n) for n in _branches(line)])
        elif op in ("call", "async-start"):
            inner = kernels(comps, _called(line, "to_apply" if op == "call" else "calls"))
            out.launched += inner.launched
            out.moved += inner.moved
            out.loops += inner.loops
            out.branches += inner.branches
        elif op not in NOT_KERNELS:
            kind = re.search(r'custom_call_target="([^"]+)"|kind=(\w+)', line)
            out.launched.append((_name(head), next(g for g in kind.groups() if g) if kind else op))
            out.moved.append(_kernel_bytes(rest, op, shapes, comps))
    return out


def summary(k: Kernels) -> dict:
    """Counts of a computation's own kernels by kind (a fusion's kind, a custom call's target,
    else the op)."""
    return dict(collections.Counter(kind for _, kind in k.launched).most_common())


def report(hlo: str, dtype: str, args) -> dict:
    """Print and return the decode loop's counts: kernels per token (the loop body's, its inner
    loops and branches counted in), the loop's condition and what runs before the loop."""
    entry = kernels(computations(hlo), "ENTRY")
    if not entry.loops:
        raise UserError("the compiled program has no decode loop (--new_tokens must be at least 2)")
    decode = max(entry.loops, key=lambda loop: len(loop[0].launched))
    body, cond, _ = decode
    lo, hi, unknown = body.count()
    outside = Kernels(entry.launched, [loop for loop in entry.loops if loop is not decode], entry.branches)
    row = {"target": args.target, "config": args.config, "batch": args.batch, "top_k": args.top_k,
           "dtype": dtype, "kernels_per_token": lo, "kernels_per_token_max": hi,
           "inner_loops_of_unknown_length": unknown, "by_kind": summary(body),
           "loop_condition": cond.count()[1], "outside_loop": outside.count()[1]}
    per_token = f"{lo}" if lo == hi else f"{lo}-{hi} (conditionals)"
    print(f"{args.config} decode, batch {args.batch}, top-k {args.top_k}, {dtype}, for {args.target}: "
          f"{per_token} kernels per token (its own, by kind: {row['by_kind']})"
          + (f", plus {unknown} inner loops of unknown length" if unknown else "")
          + f"; the loop's condition {row['loop_condition']}, outside the loop {row['outside_loop']}")
    if args.list:
        for name, kind in body.launched:
            print(f"   {kind:<12} {name}")
    return row


def _group(name: str, kind: str) -> str:
    """matmul (cuBLAS, a Triton GEMM, XLA:CPU's dot), attention (cuDNN) or other."""
    if "cudnn" in kind.lower():
        return "attention"
    matmul = kind.startswith("__cublas") or name.startswith("gemm_fusion") or kind == "dot"
    return "matmul" if matmul else "other"


def report_train(hlo: str, dtype: str, args) -> dict:
    """Print and return a training step's kernels and the bytes they move (`_kernel_bytes`), by
    group: matmuls (cuBLAS, Triton GEMMs), attention (cuDNN) and the rest (fusions, copies), which
    on a GPU are bound by memory bandwidth."""
    launched = kernels(computations(hlo), "ENTRY").flat()
    groups = {g: [size for name, kind, size in launched if _group(name, kind) == g]
              for g in ("matmul", "attention", "other")}
    row = {"target": args.target, "program": "train", "dtype": dtype, "kernels_per_step": len(launched),
           "kernels": {g: len(v) for g, v in groups.items()},
           "gb": {g: sum(v) / 1e9 for g, v in groups.items()}}
    print(f"training step, {dtype}, for {args.target}: {len(launched)} kernels; "
          + ", ".join(f"{g} {len(v)} moving {sum(v) / 1e9:.3g} GB" for g, v in groups.items()))
    if args.list:
        for name, kind, size in sorted(launched, key=lambda k: -k[2]):
            print(f"   {size / 1e6:10.1f} MB  {kind:<12} {name}")
    return row


def _check_decode_args(args, rest: list[str]) -> None:
    from bench.sample import PRESETS
    if rest:
        raise UserError(f"unknown arguments {' '.join(rest)} (train.py's settings go with --program=train)")
    if args.config not in PRESETS:
        raise UserError(f"--config={args.config}: one of {', '.join(PRESETS)}")
    if args.batch < 1 or args.top_k < 0:
        raise UserError("--batch must be at least 1 and --top_k at least 0")


def main(argv: list[str]) -> int:
    ap = ArgParser(description=__doc__.splitlines()[0])
    ap.add_argument("--program", default="decode", choices=("decode", "train"),
                    help="train: bench/train.py's step; train.py's settings follow (--preset=gpt2 ...)")
    ap.add_argument("--target", default="h200", choices=(*GPUS, "cpu"))
    ap.add_argument("--config", default="gpt2")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--top_k", type=int, default=200)
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--dtype", default=None, choices=("auto", "float32", "bfloat16"),
                    help="auto (default: decoding; training takes a config's): bfloat16 on a GPU, "
                         "float32 on a CPU (as sample.py decodes)")
    ap.add_argument("--decode_kernels", action="store_true",
                    help="the layers as gpt/ops/decode_kernels.py's Pallas kernels "
                         "(sample.py --decode_kernels)")
    ap.add_argument("--list", action="store_true", help="every kernel of the loop's body, in order")
    ap.add_argument("--json", default="", help="also write the counts to this file")
    ap.add_argument("--plan", action="store_true",
                    help="also read the thunk plan XLA's GPU runtime executes: which kernels run in "
                         "CUDA graphs (command buffers) and what runs outside them, per loop")
    args, rest = ap.parse_known_args(argv)
    if args.plan and args.target == "cpu":
        raise UserError("--plan reads XLA:GPU's thunk plan: use a GPU --target")
    with tempfile.TemporaryDirectory() if args.plan else contextlib.nullcontext() as dump:
        if args.plan:
            os.environ.update(plan.dump_env(os.environ, dump))
        if args.program == "train":
            row = report_train(*train_program(args, rest, device_sharding(args.target)), args)
        else:
            _check_decode_args(args, rest)
            row = report(*decode_program(args, device_sharding(args.target)), args)
        if args.plan:
            row["plan"] = plan.read_plan(dump)
            plan.print_plan(row["plan"])
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    run_main(main)
