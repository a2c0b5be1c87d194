"""gpt/runtime.py: what --dtype/--attention=auto resolve to on each backend and CPU class, chosen
by argument (the backend) and by the GPT_CPU_BF16 override, never by patching the module."""
from __future__ import annotations

import math

import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from helpers import REPO, tiny_model_config
from gpt.config import ComputeConfig
from gpt.errors import UserError
from gpt.runtime import (compilation_cache_dir, compute_dtype, cpu_flags, cpu_native_bf16, decoding_dtype,
                         dtype_note, on_mesh, resolve)


@pytest.mark.parametrize("forced,want", [("1", jnp.bfloat16), ("0", jnp.float32)])
def test_auto_dtype_follows_native_bf16_on_cpu(monkeypatch, forced, want):
    monkeypatch.setenv("GPT_CPU_BF16", forced)
    assert cpu_native_bf16() == (forced == "1")
    assert compute_dtype("auto", "cpu") == want
    assert resolve(tiny_model_config(), ComputeConfig(dtype="auto"), "cpu").dtype == want
    assert compute_dtype("auto", "gpu") == jnp.bfloat16 and compute_dtype("auto", "tpu") == jnp.bfloat16
    assert compute_dtype("float32", "gpu") == jnp.float32  # an explicit choice is kept
    warned = dtype_note(jnp.bfloat16, "cpu")
    assert ("emulated" in warned) == (forced == "0") and dtype_note(jnp.float32, "cpu") == ""


@pytest.mark.parametrize("forced", ["1", "0"])
def test_sampling_decodes_in_float32_on_every_cpu(monkeypatch, forced):
    """Decoding's matrix-vector shapes run no faster in bf16 on XLA:CPU, even where bf16 is native."""
    monkeypatch.setenv("GPT_CPU_BF16", forced)
    assert decoding_dtype("auto", "cpu") == "float32"
    assert compute_dtype(decoding_dtype("auto", "gpu"), "gpu") == jnp.bfloat16
    assert decoding_dtype("bfloat16", "cpu") == "bfloat16"  # an explicit choice is kept


@pytest.mark.parametrize("forced", ["false", "yes", "2"])
def test_a_cpu_bf16_override_other_than_0_or_1_is_refused(monkeypatch, forced):
    """GPT_CPU_BF16=false must not silently leave the detection in charge (bf16 on this CPU)."""
    monkeypatch.setenv("GPT_CPU_BF16", forced)
    with pytest.raises(UserError, match=rf"GPT_CPU_BF16='{forced}' must be 0 or 1"):
        compute_dtype("auto", "cpu")


def test_a_keep_host_memory_setting_other_than_0_or_1_is_refused(monkeypatch):
    """GPT_KEEP_HOST_MEMORY=false must not silently tune the allocator it asked to leave alone."""
    from gpt.runtime import keep_host_memory
    monkeypatch.setenv("GPT_KEEP_HOST_MEMORY", "false")
    keep_host_memory.cache_clear()
    try:
        with pytest.raises(UserError, match=r"GPT_KEEP_HOST_MEMORY='false' must be 0 or 1"):
            keep_host_memory()
    finally:
        keep_host_memory.cache_clear()


def test_detection_reads_the_cpu_flags(monkeypatch):
    monkeypatch.delenv("GPT_CPU_BF16", raising=False)
    flags = cpu_flags()
    assert cpu_native_bf16() == bool(flags & {"avx512_bf16", "amx_bf16"})


def test_attention_choice_per_backend():
    cfg = tiny_model_config()
    assert resolve(cfg, ComputeConfig(dtype="float32"), "cpu").attention == "blocked"
    gpu = resolve(cfg, ComputeConfig(dtype="bfloat16"), "gpu")
    assert gpu.attention == "cudnn" and not gpu.cpu_layouts
    assert resolve(cfg, ComputeConfig(dtype="float32"), "gpu").attention == "xla"  # cuDNN needs 16-bit
    assert resolve(cfg, ComputeConfig(attention="einsum"), "cpu").attention == "reference"
    # how for_decoding holds the dense weights: [out, in] on CPU (few rows streamed) and GPU
    assert [resolve(cfg, None, b).decode_weights for b in ("cpu", "gpu", "tpu")] == ["rows", "dot", ""]
    assert not gpu.decode_layout  # only for_decoding's copy holds them so
    # the cross-entropy's logsumexp: one reduction on GPU (gpt.ops.cross_entropy; TPU not measured)
    assert [resolve(cfg, None, b).lse_one_pass for b in ("cpu", "gpu", "tpu")] == [False, True, False]


def test_matmul_output_dtype_per_backend():
    """bf16 products on GPU/TPU computing in bf16 (autocast's choice); float32 on every CPU and
    whenever the compute dtype is float32. Stored as dtypes, so equal Runtimes hash alike."""
    cfg = tiny_model_config()
    bf16, f32 = jnp.dtype("bfloat16"), jnp.dtype("float32")
    assert resolve(cfg, ComputeConfig(dtype="bfloat16"), "gpu").matmul_out == bf16
    assert resolve(cfg, ComputeConfig(dtype="bfloat16"), "tpu").matmul_out == bf16
    assert resolve(cfg, ComputeConfig(dtype="float32"), "gpu").matmul_out == f32
    assert resolve(cfg, ComputeConfig(dtype="bfloat16"), "cpu").matmul_out == f32
    a, b = resolve(cfg, ComputeConfig(dtype="float32"), "cpu"), resolve(cfg, ComputeConfig(), "cpu")
    assert a == b and hash(a) == hash(b) and isinstance(a.matmul_out, jnp.dtype)


def test_residual_stream_dtype():
    """float32 by default on every backend; --residual_dtype=compute: the compute dtype (float32
    when that is float32), on CPU too."""
    cfg = tiny_model_config()
    bf16, f32 = jnp.dtype("bfloat16"), jnp.dtype("float32")
    for backend in ("cpu", "gpu", "tpu"):
        assert resolve(cfg, ComputeConfig(dtype="bfloat16"), backend).residual == f32
        compute = ComputeConfig(dtype="bfloat16", residual_dtype="compute")
        assert resolve(cfg, compute, backend).residual == bf16
        assert resolve(cfg, ComputeConfig(dtype="float32", residual_dtype="compute"), backend).residual == f32
    assert isinstance(resolve(cfg, None, "gpu").residual, jnp.dtype)



def test_cpu_steps_reuse_their_memory_instead_of_faulting_it_in():
    """The default run's gradient (a 47 MB temporary buffer, over glibc's 32 MB mmap threshold):
    with the allocator tuned as `resolve` does on CPU, warm calls reuse the freed block instead of
    mapping and page-faulting a fresh one each time (about 12,000 faults per call untuned).
    Counted, not timed."""
    import platform
    import resource
    import statistics

    import jax
    from flax import nnx

    from gpt.config import build_train
    from gpt.model import GPT
    from gpt.runtime import keep_host_memory
    from gpt.train import loss_fn
    if platform.system() != "Linux" or not keep_host_memory():
        pytest.skip("the allocator tuning is for glibc on Linux")
    m, c, _, _ = build_train(["--vocab_size=65"])  # `python train.py`: the char-level default
    graphdef, params = nnx.split(GPT(m, rngs=nnx.Rngs(0), runtime=resolve(m, c)))
    x = jnp.zeros((12, m.block_size), jnp.int32)
    grad = jax.jit(jax.grad(lambda p: loss_fn(graphdef, p, x, x))).lower(params).compile()
    temp_pages = grad.memory_analysis().temp_size_in_bytes / resource.getpagesize()
    assert temp_pages * resource.getpagesize() > 32 * 2**20  # else the test shows nothing
    for _ in range(20):  # the heap grows to hold the step's peak once
        jax.block_until_ready(grad(params))
    faults = []  # per call: now and then one faults its block in (the heap grew: a small block
    for _ in range(8):  # had landed in the freed one), untuned every call does
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        jax.block_until_ready(grad(params))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    assert statistics.median(faults) < 0.25 * temp_pages, (faults, temp_pages)


_BIG_TEMP = """
import resource, statistics, sys
import jax, jax.numpy as jnp
from gpt.runtime import keep_host_memory, prepare_process
if sys.argv[1] == "prepared":
    prepare_process()
if not keep_host_memory():
    sys.exit(3)
# An 81 MB temporary: the barrier keeps XLA from fusing it away
f = jax.jit(lambda x: jax.lax.optimization_barrier(jnp.sin(jnp.outer(x, x))).sum(0))
x = jnp.linspace(0.0, 1.0, 4608)
c = f.lower(x).compile()
faults = []  # per call: the heap now and then grows by a block (a small one landed in the last)
for _ in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    out = c(x)
    ready = out.is_ready()
    jax.block_until_ready(out)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
faults = statistics.median(faults[4:])
print(c.memory_analysis().temp_size_in_bytes, resource.getpagesize(), faults, ready)
"""


def _big_temp_run(mode: str) -> tuple[int, float, float, bool]:
    """(temporary bytes, pages, median faults of a warm call, whether a call returned after
    running)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", _BIG_TEMP, mode], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    if r.returncode == 3:
        pytest.skip("the allocator tuning is for glibc on Linux")
    assert r.returncode == 0, r.stderr
    temp, page, faults, ready = r.stdout.split()
    return int(temp), int(temp) / int(page), float(faults), ready == "True"


def test_cpu_programs_run_inline_so_a_temporary_over_a_thread_heap_is_kept():
    """A temporary buffer over 64 MB (a baby-GPT step's is 3.8 GB): allocated on JAX's dispatch
    thread, glibc maps it afresh and page-faults it in on every call whatever mallopt says; run
    inline (`prepare_process`, as train.py and sample.py start), the main heap keeps it. In fresh
    processes, since the dispatch mode is fixed when JAX's CPU client is made. Counted, not timed."""
    temp, pages, faults, ready = _big_temp_run("prepared")
    assert temp > 64 * 2**20
    assert ready, "the program returned before it ran: dispatch is still asynchronous"
    assert faults < 0.1 * pages, (faults, pages)  # asynchronous: every call (below)
    *_, faults_async, _ = _big_temp_run("default")
    if faults_async < 0.9 * pages:  # this C library keeps the block anyway: nothing to show
        pytest.skip(f"the asynchronous run faulted only {faults_async:.0f} of {pages:.0f} pages")


@pytest.mark.parametrize("env, want", [(None, "False"), ("1", "True")])
def test_inline_dispatch_leaves_a_users_own_setting(env, want):
    """`prepare_process` turns JAX's CPU async dispatch off, unless the user set
    JAX_CPU_ENABLE_ASYNC_DISPATCH (to compare the two)."""
    environ = {k: v for k, v in os.environ.items() if k != "JAX_CPU_ENABLE_ASYNC_DISPATCH"}
    if env is not None:
        environ["JAX_CPU_ENABLE_ASYNC_DISPATCH"] = env
    r = subprocess.run([sys.executable, "-c", "from gpt.runtime import run_cpu_programs_inline as r; "
                        "import jax; r(); print(jax.config.read(\"jax_cpu_enable_async_dispatch\"))"],
                       cwd=REPO, env=dict(environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == [want], r.stderr


def test_compilation_cache_folder(monkeypatch, tmp_path):
    """$GPT_COMPILATION_CACHE (0: none), else $XDG_CACHE_HOME/gpt-jax/xla; always in a folder of
    its own per CPU feature set, since JAX's cache key does not name the instruction set."""
    for off in ("0", "OFF", " false", "No"):
        monkeypatch.setenv("GPT_COMPILATION_CACHE", off)
        assert compilation_cache_dir() is None
    monkeypatch.setenv("GPT_COMPILATION_CACHE", str(tmp_path / "mine"))
    mine = compilation_cache_dir()
    assert mine.parent == tmp_path / "mine" and mine.name.startswith("cpu-")
    monkeypatch.delenv("GPT_COMPILATION_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compilation_cache_dir() == tmp_path / "gpt-jax" / "xla" / mine.name


def test_cache_folder_others_can_write_is_refused(tmp_path):
    """JAX runs what it loads from the cache: a folder (or its parent) that group or others can
    write to is not used; a new folder is created private (0700)."""
    from gpt.runtime import _private_folder
    fresh = tmp_path / "a" / "b"
    assert _private_folder(fresh) is None and fresh.stat().st_mode & 0o777 == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert "not private" in _private_folder(shared / "cpu-x")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(GPT_COMPILATION_CACHE=str(shared), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", "from gpt.runtime import use_compilation_cache as u; "
                        "import jax; print(u(), jax.config.jax_compilation_cache_dir)"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["None", "None"], r.stderr
    assert "not private to this user" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_unwritable_compilation_cache_is_one_warning(tmp_path):
    """A cache folder that cannot be written costs a warning line, not the run."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(GPT_COMPILATION_CACHE=str(blocker / "cache"), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", "from gpt.runtime import use_compilation_cache as u; "
                        "import jax; print(u(), jax.config.jax_compilation_cache_dir)"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["None", "None"], r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: no compilation cache") and "GPT_COMPILATION_CACHE" in lines[0]


def test_loss_chunks_auto_on_cpu_only():
    """--loss_chunks=0 (auto): on CPU about AUTO_CHUNK_ROWS rows a slice of T once the padded
    vocabulary reaches AUTO_CHUNK_MIN_VOCAB (where the fused head-and-loss was faster), else
    whole; on a GPU whole; an explicit count is taken as it is."""
    from helpers import tiny_model_config, tiny_runtime
    from gpt.runtime import AUTO_CHUNK_MIN_VOCAB, loss_chunks_for
    cfg = tiny_model_config()
    assert tiny_runtime(cfg, "cpu").loss_chunks == 0 and tiny_runtime(cfg, "gpu").loss_chunks == 1
    assert tiny_runtime(cfg, "gpu", loss_chunks=4).loss_chunks == 4
    big = AUTO_CHUNK_MIN_VOCAB
    assert loss_chunks_for(0, 12, 64, big - 1) == 1  # a small vocabulary: whole
    assert loss_chunks_for(0, 12, 64, big) == 6  # 11 positions x 12 rows a slice
    assert loss_chunks_for(0, 32, 128, 50304) == 32 and loss_chunks_for(0, 1, 64, 50304) == 1
    assert loss_chunks_for(1, 12, 64, 50304) == 1 and loss_chunks_for(5, 12, 64, 65) == 5
    assert loss_chunks_for(8, 1, 3, 65) == 3  # at most one slice per position (a short tail)


def test_pallas_kernel_choices_are_checked():
    """Runtime.decode_kernels, gelu_kernel, norm_kernel and xent_kernel take triton, interpret or
    nothing; the GELU and norm kernels are a GPU's default (the H200's step was shorter with each),
    nowhere else, the loss's nowhere yet; the training kernels refuse a mesh of several devices
    (a pallas_call has no sharding rule: XLA would gather every row of their operands onto every
    device)."""
    import dataclasses
    from types import SimpleNamespace
    rt = resolve(tiny_model_config(), backend="gpu")
    assert rt.gelu_kernel == rt.norm_kernel == "triton" and rt.decode_kernels == rt.xent_kernel == ""
    for backend in ("cpu", "tpu"):
        other = resolve(tiny_model_config(), backend=backend)
        assert other.gelu_kernel == other.norm_kernel == other.decode_kernels == other.xent_kernel == ""
    for field in ("decode_kernels", "gelu_kernel", "norm_kernel", "xent_kernel"):
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(rt, **{field: "cuda"})
    assert dataclasses.replace(rt, mesh=SimpleNamespace(size=1)).norm_kernel == "triton"
    for field in ("gelu_kernel", "norm_kernel", "xent_kernel"):
        with pytest.raises(ValueError, match="one device"):
            dataclasses.replace(rt, **{field: "triton"}, mesh=SimpleNamespace(size=2))
    # training over a mesh (gpt.train): XLA's path over several devices, the kernels on one
    rt = dataclasses.replace(rt, xent_kernel="triton")
    assert on_mesh(rt, fake_mesh(data=1)).norm_kernel == on_mesh(rt, fake_mesh(data=1)).xent_kernel == "triton"
    several = on_mesh(rt, fake_mesh(data=8))
    assert several.gelu_kernel == several.norm_kernel == several.xent_kernel == "" and several.mesh.size == 8


def fake_mesh(**sizes):
    from types import SimpleNamespace
    shape = {a: sizes.get(a, 1) for a in ("data", "fsdp", "expert", "tensor")}
    return SimpleNamespace(shape=shape, size=math.prod(shape.values()))


def test_cpu_layouts_only_where_the_rows_split_one_way():
    """The CPU's flattened layouts stay over one batch axis (and tensor parallelism); with the rows
    split over two (data and fsdp), XLA's partitioner would gather them, so XLA's layouts."""
    rt = resolve(tiny_model_config(), backend="cpu")
    assert rt.cpu_layouts
    for sizes, want in [({"data": 8}, True), ({"fsdp": 8}, True), ({"data": 4, "tensor": 2}, True),
                        ({"data": 2, "fsdp": 4}, False), ({"fsdp": 2, "expert": 4}, False)]:
        assert on_mesh(rt, fake_mesh(**sizes)).cpu_layouts is want, sizes
    assert not on_mesh(resolve(tiny_model_config(), backend="gpu"), fake_mesh(data=8)).cpu_layouts


def test_command_buffers_off_is_one_program_option():
    """Runtime.command_buffers=False compiles the training step without XLA:GPU's CUDA graphs as
    an option of that program alone (decoding keeps its graph a token); on by default, as XLA
    has it. Any backend compiles a program with the option (XLA:CPU ignores it)."""
    import jax
    from gpt.runtime import compiler_options, resolve
    rt = resolve(tiny_model_config(), ComputeConfig(dtype="float32"), "gpu")
    assert rt.command_buffers and compiler_options(rt) == {}
    off = resolve(tiny_model_config(), ComputeConfig(dtype="float32"), "gpu", command_buffers=False)
    assert compiler_options(off) == {"xla_gpu_enable_command_buffer": ""}
    assert float(jax.jit(lambda x: 2 * x, compiler_options=compiler_options(off))(jnp.float32(3))) == 6.0


def test_the_open_file_limit_is_raised_within_the_hard_limit():
    """A store's shards are mapped one descriptor each: the soft limit goes up, never past the hard."""
    import resource
    from gpt.runtime import raise_open_file_limit
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        low = 256 if hard == resource.RLIM_INFINITY else min(256, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
        raise_open_file_limit(4096)
        got = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert got[1] == hard and got[0] == (4096 if hard == resource.RLIM_INFINITY else min(4096, hard))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_open_file_limit_falls_back_where_the_system_caps_it(monkeypatch):
    """macOS: an unlimited hard limit, but a soft one above kern.maxfilesperproc is refused."""
    import resource
    from gpt.runtime import raise_open_file_limit
    calls = []

    def capped(which, limits):
        calls.append(limits[0])
        if limits[0] > 10240:
            raise ValueError("not allowed")
    monkeypatch.setattr(resource, "getrlimit", lambda which: (256, resource.RLIM_INFINITY))
    monkeypatch.setattr(resource, "setrlimit", capped)
    raise_open_file_limit()
    assert calls == [65536, 10240]
