"""Run-time choices, made once before anything is traced: how this machine computes the model.

`ComputeConfig` holds what the user asked for (`--dtype=auto`, `--attention=auto`, ...); `Runtime`
holds what that resolves to on the current backend for a given architecture: the compute dtype, the
attention kernel of the training/prefill path and of the cached (masked) path, whether to force the
CPU's fast matmul layouts, the dtype the matmuls write (bf16 on GPU/TPU computing in bf16, as under
PyTorch's autocast; float32 on CPU), how decoding holds and multiplies the dense weights, and the
per-run settings the model needs (dropout, remat, scan). The model receives a `Runtime` when it is
built and passes its fields down as arguments, so no traced code asks which backend it runs on, and
tests pick a kernel by building a `Runtime`.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from gpt.errors import UserError
from gpt.config import ComputeConfig, ModelConfig
from gpt.ops.attention import ATTENTION_BLOCK

_USER_ATTENTION = {"einsum": "reference", "xla": "xla", "cudnn": "cudnn"}
DECODE_WEIGHTS = ("rows", "dot", "")  # Runtime.decode_weights
PALLAS_MODES = ("triton", "interpret", "")  # Runtime.decode_kernels, gelu_kernel, norm_kernel, xent_kernel
TRAINING_KERNELS = ("gelu_kernel", "norm_kernel", "xent_kernel")  # one device each (`on_mesh`)
GPU_DEFAULT_KERNELS = ("gelu_kernel", "norm_kernel")  # each made the H200's step shorter (`resolve`)


@dataclasses.dataclass(frozen=True)
class Runtime:
    dtype: jnp.dtype  # compute dtype of the matmuls (parameters stay float32)
    attention: str  # no cache (training, eval): reference | blocked | xla | cudnn
    cached_attention: str  # with a KV cache: cudnn, else (reference | xla) `cached_attention`'s einsums
    cpu_layouts: bool  # flattened operands and physical transposes for the CPU's fast kernels
    dropout: float = 0.0  # rate of every dropout layer (0: none, and no keys are needed)
    remat: str = "none"  # none | block | dots
    scan_layers: bool = False  # rolled layer loop (else unrolled)
    attention_block: int = ATTENTION_BLOCK  # query rows per block of the blocked kernel
    dense_vjp: bool = True  # dense layers with the hand-written backward (False: plain autodiff)
    # dtype the dense layers' and the LM head's products are written in (gpt/ops/dense.py);
    # float32 accumulation either way
    matmul_out: Any = jnp.dtype("float32")
    # dtype of the residual stream between the blocks (and so of its gradient): float32 as under
    # PyTorch's autocast, or the compute dtype (--residual_dtype=compute)
    residual: Any = jnp.dtype("float32")
    mesh: Any = None  # the training mesh: MoE layers lay their dispatched tokens out on its expert axis
    # How `gpt.model.for_decoding` holds the dense weights: "rows" (CPU) and "dot" (GPU) hold them
    # [out, in], so that a one-row product reads each weight along its contiguous axis ("rows" also
    # runs 2..FEW_ROWS-row products as one multiply-and-reduce that streams the weight:
    # gpt.ops.dense.decode_dense); "" keeps the trained [in, out] layout (TPU: not measured).
    decode_weights: str = ""
    decode_layout: bool = False  # the dense weights are held [out, in] now (for_decoding sets it)
    # The cross-entropy's logsumexp as one reduction over the logits (gpt.ops.cross_entropy): one
    # read of the [B, T, V] logits on a GPU; two passes on CPU, where one was slower (TPU: not measured)
    lse_one_pass: bool = False
    # Without a remat policy, the MLP's activation is recomputed in the backward from fc's product
    # instead of keeping its intermediates (gpt.model.Block.mlp); False keeps them (for A/B timing)
    mlp_recompute: bool = True
    # The training and evaluation loss forms the head's logits this many slices of T at a time
    # (gpt.ops.cross_entropy.linear_cross_entropy), never whole: 1 = whole; 0 = by the shapes
    # (`loss_chunks_for`: the CPU's auto); --loss_chunks
    loss_chunks: int = 1
    # One-row decoding steps run each layer as the Pallas kernels of gpt/ops/decode_kernels.py
    # (sample.py --decode_kernels; `gpt.model.decode_kernels_problem` says which models can):
    # "triton" on a GPU, "interpret" in Pallas's interpreter (tests), "" not at all. for_decoding
    # then keeps w_o and w_proj [in, out], the layout the kernels read by rows
    decode_kernels: str = ""
    # The MLP's bias and tanh-GELU, and their backward, as gpt/ops/gelu_kernel.py's kernels (GPT-2's
    # block with the activation recomputed: `Block.mlp`), "triton" or "interpret" as above; "" XLA's
    # fusions. A GPU's default (`resolve`): GPT-2's step 2.7 ms shorter on an H200 (BENCHMARKS.md)
    gelu_kernel: str = ""
    # The block norms' and the final norm's backward (LayerNorm, RMSNorm) as gpt/ops/norm_kernel.py's
    # kernel, which also adds the residual stream's own gradient (`Block.norm_stream`), "triton" or
    # "interpret" as above; "" XLA's fusions. A GPU's default: GPT-2's step 4 ms shorter on an H200
    norm_kernel: str = ""
    # The training loss's logsumexp, target logit and gradient over the logits in one kernel, in the
    # forward pass, as gpt/ops/xent_kernel.py's kernel (`gpt.ops.cross_entropy.cross_entropy_rows`;
    # the whole logits, not in slices), "triton" or "interpret" as above; "" XLA's passes. Off
    # until a GPU has timed it this way (bench/train.py --runtime=xent_kernel=triton): alone the
    # kernel took 5.6 ms against XLA's 8.1 on an H200, but through the sliced loss's structure the
    # step was slower (BENCHMARKS.md)
    xent_kernel: str = ""
    # XLA:GPU's command buffers (CUDA graphs) in the compiled training step; False compiles the
    # step without them (`compiler_options`, for A/B timing: the H200's step was 1.5 ms longer
    # without); decoding keeps its graph a token. Nothing on other backends
    command_buffers: bool = True

    def __post_init__(self) -> None:
        if self.decode_weights not in DECODE_WEIGHTS:  # a typo would transpose, then multiply wrongly
            raise ValueError(f"decode_weights={self.decode_weights!r}: one of {DECODE_WEIGHTS}")
        for name in ("decode_kernels", *TRAINING_KERNELS):
            if getattr(self, name) not in PALLAS_MODES:
                raise ValueError(f"{name}={getattr(self, name)!r}: one of {PALLAS_MODES}")
        if any(getattr(self, k) for k in TRAINING_KERNELS) and self.mesh is not None and self.mesh.size > 1:
            # a pallas_call has no sharding rule: XLA would gather every row onto every device
            raise ValueError(f"{', '.join(TRAINING_KERNELS)} run on one device; a mesh of several "
                             "would gather their operands")


def compiler_options(rt: Runtime) -> dict[str, str]:
    """XLA options of the training step's compilation (`jax.jit(..., compiler_options=)`): per
    program, so that decoding keeps what the step turns off."""
    return {} if rt.command_buffers else {"xla_gpu_enable_command_buffer": ""}


def on_mesh(rt: Runtime, mesh) -> Runtime:
    """`rt` training over `mesh`. The Pallas training kernels (TRAINING_KERNELS) have no sharding
    rule and run on one device, so over a mesh of several they give way to XLA's path (a GPU
    default would otherwise stop every sharded run). The CPU's layouts (`cpu_layouts`) flatten
    the batch rows and transpose them physically: with the rows split over two mesh axes (data
    and fsdp, say) XLA's partitioner cannot follow that and gathers them whole onto every device
    (its "Involuntary full rematerialization" warning), so such a mesh keeps XLA's layouts."""
    several = mesh is not None and mesh.size > 1
    rows_split = mesh is not None and sum(mesh.shape[a] > 1 for a in ("data", "fsdp", "expert")) > 1
    return dataclasses.replace(rt, mesh=mesh, cpu_layouts=rt.cpu_layouts and not rows_split,
                               **(dict.fromkeys(TRAINING_KERNELS, "") if several else {}))


def decode_kernels_on(backend: str) -> str:
    """`Runtime.decode_kernels` that runs the decoding kernels on `backend`: Triton on a GPU,
    Pallas's interpreter elsewhere (tests, counts compiled for this host)."""
    return "triton" if backend == "gpu" else "interpret"


# The CPU's auto loss chunks (--loss_chunks=0): slices of about this many rows (B x positions),
# once the padded vocabulary has at least this many entries (BENCHMARKS.md: on XLA:CPU the fused
# head-and-loss was 1.3-1.56x faster for GPT-2's vocabulary, about even for small ones)
AUTO_CHUNK_ROWS, AUTO_CHUNK_MIN_VOCAB = 128, 4096


def loss_chunks_for(loss_chunks: int, B: int, T: int, V: int) -> int:
    """The slices of T the loss takes for [B, T] tokens (B: the whole batch, over all devices) and
    a padded vocabulary of V: `Runtime.loss_chunks` itself (at most T) unless it is 0 (auto), then
    about AUTO_CHUNK_ROWS rows a slice for a vocabulary of AUTO_CHUNK_MIN_VOCAB or more, else 1
    (whole)."""
    if loss_chunks > 0:
        return min(loss_chunks, T)
    if V < AUTO_CHUNK_MIN_VOCAB:
        return 1
    positions = max(1, round(AUTO_CHUNK_ROWS / B))
    return -(-T // positions)


CPU_BF16_ENV = "GPT_CPU_BF16"  # 1/0 overrides the detection (the tests pin float32 with 0)
KEEP_MEMORY_ENV = "GPT_KEEP_HOST_MEMORY"  # 0 leaves glibc's allocator as it is (for comparisons)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4  # mallopt parameters (glibc malloc.h)
_HEAP_MAX = 64 << 20  # glibc's largest heap of a thread's arena (64-bit)
_NEVER = -1  # M_TRIM_THRESHOLD: never give the heap's top back (mallopt(3))


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo: x86's "flags", Arm's "Features" (empty where
    there is none, e.g. macOS)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512_BF16 or AMX). Elsewhere XLA emulates bf16
    matmuls through float32 and a bf16 step is slower than a float32 one (BENCHMARKS.md)."""
    forced = os.environ.get(CPU_BF16_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    if forced:  # "false" or "yes" would otherwise leave the detection in charge, unsaid
        raise UserError(f"{CPU_BF16_ENV}={forced!r} must be 0 or 1 (float32 or bf16 compute on this CPU); "
                        f"unset it to detect native bf16 from the CPU flags")
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


@functools.cache
def keep_host_memory() -> bool:
    """Let glibc's malloc keep freed memory for reuse instead of unmapping it; True if applied.

    XLA:CPU allocates an executable's temporary buffer (tens of MB for the default model's train
    step, gigabytes for bigger ones) with malloc on every call. glibc serves blocks over 32 MB with
    a fresh mmap and unmaps them on free, so every step page-faulted its whole working set in again:
    the 4-layer default step took 1.7x as long as with the block reused, and a 3-layer model was
    slower per layer than a 2-layer one (BENCHMARKS.md). With mmap off and trimming off the heap
    keeps the block between calls (a trim threshold of 1 GiB still gave the 3.8 GB of a baby-GPT
    step back every step). XLA's worker threads allocate from arenas of their own, made of heaps of
    at most 64 MB: a block that does not fit the first heap goes to a second one, which glibc
    unmaps as soon as it is empty whatever the trim threshold, unless the top pad is at least a
    heap's size; without that pad, whole 250-step stretches of the default run faulted ~30,000
    pages a second and ran 20% slower. A block over 64 MB never fits a thread's heap and is mapped
    afresh whatever these settings: `run_cpu_programs_inline` keeps the program's own buffer on the
    main thread. The pad reserves address space, not memory: pages are touched only when used; the
    heap does stay at the process's peak. Once per process, before the first step; other C
    libraries (musl, macOS) are left alone.
    """
    kept = os.environ.get(KEEP_MEMORY_ENV)
    if kept == "0":
        return False
    if kept not in (None, "", "1"):  # "false" would otherwise tune the allocator it meant to leave alone
        raise UserError(f"{KEEP_MEMORY_ENV}={kept!r} must be 0 or 1 (0 leaves glibc's allocator alone); "
                        f"unset it to keep freed host memory for reuse, the default")
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only: mallopt's parameters below are its own
    except (OSError, AttributeError):
        return False
    settings = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER), (_M_TOP_PAD, _HEAP_MAX))
    return all(libc.mallopt(p, v) for p, v in settings)


ASYNC_ENV = "JAX_CPU_ENABLE_ASYNC_DISPATCH"  # JAX's own setting of the CPU client's dispatch


def run_cpu_programs_inline() -> None:
    """Have JAX's CPU client run a program on the thread that calls it (JAX's async dispatch
    off). Only takes effect before the client exists: entry points call it first.

    With async dispatch the client runs each program on a worker thread, which allocates the
    program's temporary buffer from its own malloc arena; glibc maps a block over 64 MB afresh
    there and unmaps it on free whatever `keep_host_memory` sets, so a baby-GPT train step (3.8 GB)
    page-faulted a million pages in every step, a quarter of its time (BENCHMARKS.md). On the main
    thread the block comes from the main heap, which keeps it. Dispatching inline costs the
    overlap of Python's work with the step's, which measured nothing at the default run's 16 ms
    steps; programs over several CPU devices (a mesh) stay asynchronous, and GPU/TPU backends
    are untouched. A JAX_CPU_ENABLE_ASYNC_DISPATCH of the user's own wins (for comparisons).
    """
    if ASYNC_ENV not in os.environ:
        jax.config.update("jax_cpu_enable_async_dispatch", False)


def prepare_process() -> Path | None:
    """What train.py, sample.py and gpt.evaluate do first, before anything runs or compiles (or
    joins a multi-host job, which makes the CPU client): `run_cpu_programs_inline`,
    `raise_open_file_limit` and `use_compilation_cache` (whose folder it returns)."""
    run_cpu_programs_inline()
    raise_open_file_limit()
    return use_compilation_cache()


def raise_open_file_limit(want: int = 65536) -> None:
    """Raise this process's soft limit on open files towards `want`, within its hard limit: each
    mapped shard of a data store holds a file descriptor, and a corpus of a thousand shards
    (2^27 tokens each by default) would pass the usual soft limit of 1,024."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = want if hard == resource.RLIM_INFINITY else min(want, hard)
    for target in (top, min(top, 10240), min(top, 4096)):  # macOS: at most kern.maxfilesperproc
        if soft == resource.RLIM_INFINITY or soft >= target:
            return
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return
        except (ValueError, OSError):
            continue


CACHE_ENV = "GPT_COMPILATION_CACHE"  # a folder for compiled programs, or 0 to compile every run afresh
CACHE_MAX_BYTES = 2 << 30  # least recently used entries go beyond this
CACHE_MIN_COMPILE_SEC = 0.3  # programs that compile faster than this are not worth a file
CACHE_OFF = ("0", "off", "false", "no", "none")


def _private_folder(path: Path) -> str | None:
    """Make `path` (mode 0700) and check it is this user's alone: JAX loads compiled code from the
    cache and runs it, so a folder others can write to would let them run code in this process.
    Returns what is wrong, or None."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not hasattr(os, "getuid"):
        return None
    for p in (path, path.parent):
        st = p.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            return f"{p} is not private to this user (owner or group/other write permission)"
    return None


def compilation_cache_dir() -> Path | None:
    """Where `use_compilation_cache` keeps compiled programs: $GPT_COMPILATION_CACHE, else
    $XDG_CACHE_HOME/gpt-jax/xla (default ~/.cache/gpt-jax/xla), in a subfolder per CPU feature
    set: JAX's cache key names the device kind ("cpu") but not the instruction set, so a home
    folder shared by an AVX-512 and an AVX2 machine must not hand one's code to the other."""
    env = (os.environ.get(CACHE_ENV) or "").strip()
    if env.lower() in CACHE_OFF:
        return None
    if env:
        base = Path(env).expanduser().absolute()
    else:
        try:
            base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpt-jax" / "xla"
        except RuntimeError:  # no home directory to expand
            return None
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    return base / f"cpu-{flags}"


def use_compilation_cache() -> Path | None:
    """Keep compiled programs on disk between runs (JAX's persistent compilation cache).

    A first `python train.py` spends seconds compiling its init, train and eval steps, as long as
    hundreds of steps of the default model; a second run with the same shapes loads them back
    (BENCHMARKS.md). Called once by train.py and sample.py before anything compiles; a
    JAX_COMPILATION_CACHE_DIR of the user's own wins. A folder that cannot be written is a warning
    and the run compiles as before. Returns the folder in use, or None.
    """
    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir:
        return Path(os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir)
    path = compilation_cache_dir()
    if path is None:
        return None
    unwritable = False
    try:
        problem = _private_folder(path)
        if problem is None:
            probe = path / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
    except OSError as e:
        problem, unwritable = f"{path}: {e.strerror or e}", True
    if problem:
        # A default folder under a read-only home (containers) is no news at every run; a folder
        # the user named, or one that others can write to, is.
        if os.environ.get(CACHE_ENV) or not unwritable:
            print(f"warning: no compilation cache ({problem}); every run compiles afresh. "
                  f"Set {CACHE_ENV}=DIR to a private writable folder, or {CACHE_ENV}=0", file=sys.stderr)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:  # else the user's (tests: 0)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_SEC)
    if importlib.util.find_spec("filelock"):  # JAX needs it to bound the cache (and to lock it)
        jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_BYTES)
    return path


def compute_dtype(choice: str, backend: str | None = None) -> jnp.dtype:
    """--dtype: for auto, bfloat16 on GPU/TPU and on CPUs with native bf16, float32 on other CPUs;
    else as given."""
    if choice == "auto":
        backend = backend or jax.default_backend()
        native = backend != "cpu" or cpu_native_bf16()
        return jnp.dtype(jnp.bfloat16 if native else jnp.float32)
    return jnp.dtype(choice)


def decoding_dtype(choice: str, backend: str | None = None) -> str:
    """--dtype of sampling: auto becomes float32 on every CPU; any other choice, or auto on GPU/TPU,
    is passed on unchanged for `compute_dtype` to resolve.

    A decode step multiplies a few rows by each weight matrix and attends with one query per head:
    matrix-vector shapes, bound by reading the weights and the cache. XLA:CPU's bf16 kernels at
    those shapes read bf16 no faster than float32 (so half the bytes buy nothing), and its
    one-row bf16 product is an emulated loop, so even on a CPU with native bf16 (AVX512_BF16) a
    bf16 GPT-2 decode step took 1.2-1.35x as long as a float32 one at batch 1, 16 and 64
    (BENCHMARKS.md).
    Training and evaluation, whose matmuls have thousands of rows, keep `compute_dtype`.
    """
    backend = backend or jax.default_backend()
    return "float32" if choice == "auto" and backend == "cpu" else choice


def dtype_note(dtype: jnp.dtype, backend: str | None = None) -> str:
    """A note for the start-up line when the compute dtype is bf16 on a CPU that emulates it."""
    backend = backend or jax.default_backend()
    if backend == "cpu" and jnp.dtype(dtype) == jnp.bfloat16 and not cpu_native_bf16():
        return (" (warning: this CPU has no native bf16 (no AVX512_BF16/AMX), so bfloat16 is emulated "
                "and slower than float32; --dtype=auto picks float32 here)")
    return ""


def training_attention(choice: str, dtype: jnp.dtype, head_dim: int, backend: str) -> str:
    """The kernel of the uncached (causal) path for --attention=auto|xla|cudnn|einsum.

    On CPU the blocked kernel beat `jax.nn.dot_product_attention` in both dtypes. On a GPU, JAX left
    to itself (`implementation=None`) picks XLA, which materialises the [B, H, T, T] scores: 40% of
    a GPT-2 step on an H100; so auto takes cuDNN's flash attention where it applies (16-bit, head
    dim a multiple of 8 up to 128) and XLA elsewhere (figures: BENCHMARKS.md).
    """
    if choice == "cudnn" and backend != "gpu":
        raise UserError(f"--attention=cudnn needs an NVIDIA GPU with cuDNN, and this run is on {backend}; "
                        f"use --attention=auto (or xla)")
    if choice == "cudnn" and dtype not in (jnp.bfloat16, jnp.float16):
        raise UserError(f"--attention=cudnn runs in 16 bits only, and the compute dtype is {jnp.dtype(dtype).name}; "
                        f"add --dtype=bfloat16, or use --attention=auto")
    if choice != "auto":
        return _USER_ATTENTION[choice]
    if backend == "cpu":
        return "blocked"
    cudnn_ok = (backend == "gpu" and dtype in (jnp.bfloat16, jnp.float16)
                and head_dim % 8 == 0 and head_dim <= 128)
    return "cudnn" if cudnn_ok else "xla"


def resolve(cfg: ModelConfig, compute: ComputeConfig | None = None, backend: str | None = None,
            **override) -> Runtime:
    """The Runtime of model `cfg` run as `compute` (default: ComputeConfig()) on `backend` (default:
    JAX's default backend); `override` replaces resolved fields (tests: another kernel, a smaller
    attention block, the GPU's layouts on CPU). On CPU it also tunes the host allocator once
    (`keep_host_memory`), since every compiled step there runs out of malloc'ed memory. On a GPU the
    training kernels of GPU_DEFAULT_KERNELS are on: each made the H200's GPT-2 step shorter, and
    the model applies them where they fit (`gpt.model.uses_norm_kernel`, `gelu_kernel_fits`); a
    mesh of several devices turns them off (`on_mesh`)."""
    c = compute or ComputeConfig()
    backend = backend or jax.default_backend()
    if backend == "cpu":
        keep_host_memory()
    dtype = compute_dtype(c.dtype, backend)
    rt = Runtime(dtype=dtype,
                 attention=training_attention(c.attention, dtype, cfg.head_dim, backend),
                 cached_attention=_USER_ATTENTION.get(c.attention, "xla"),
                 cpu_layouts=backend == "cpu", dropout=c.dropout, remat=c.remat,
                 scan_layers=c.scan_layers,
                 decode_weights={"cpu": "rows", "gpu": "dot"}.get(backend, ""),
                 lse_one_pass=backend == "gpu",
                 matmul_out=jnp.dtype("float32") if backend == "cpu" else jnp.dtype(dtype),
                 residual=jnp.dtype({"float32": jnp.float32, "compute": dtype}[c.residual_dtype]),
                 loss_chunks=c.loss_chunks or (0 if backend == "cpu" else 1),
                 **dict.fromkeys(GPU_DEFAULT_KERNELS, "triton" if backend == "gpu" else ""))
    return dataclasses.replace(rt, **override)
