"""Device mesh, parameter partitioning and global batches (data parallel, FSDP, expert and tensor
parallel).

Everything goes through `jax.jit` with `NamedSharding`s over one `jax.make_mesh` mesh with the axes
(data, fsdp, expert, tensor); XLA's SPMD partitioner inserts the collectives. Each parameter carries
its logical axes as metadata (`nnx.Param(..., sharding_names=...)` in gpt/model.py; the layer stack
adds "layers"); tensor parallelism maps heads/MLP width/vocabulary to `tensor` (Megatron style),
expert parallelism maps the experts of MoE layers to `expert`, and FSDP shards each matrix's largest
remaining dimension over `fsdp`. Batch rows are split over data x fsdp x expert: outside the MoE
layers the expert axis is one more data-parallel axis (as in MaxText), and the MoE layers send each
token to its expert's device (gpt/moe.py). Optimizer state follows its parameter.
"""
from __future__ import annotations

import functools
import hashlib
import math
import re
import sys
from typing import Any, Callable, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gpt.config import ModelConfig
from gpt.errors import UserError

AXES = ("data", "fsdp", "expert", "tensor")  # tensor last: the innermost (fastest-linked) devices
BATCH_AXES = ("data", "fsdp", "expert")

# Logical axes that tensor parallelism splits (only where the size divides: key/value heads fewer
# than the tensor axis stay replicated).
T = TypeVar("T")
TENSOR_LOGICAL = ("heads", "kv_heads", "mlp", "vocab")


def parse_mesh(spec: str, n_devices: int) -> dict[str, int]:
    """`data:2,fsdp:4` -> {"data": 2, "fsdp": 4, "expert": 1, "tensor": 1}; empty -> all devices on
    data."""
    sizes = {a: 1 for a in AXES}
    if not spec:
        sizes["data"] = n_devices
        return sizes
    seen: set[str] = set()
    for part in spec.split(","):
        name, _, size = part.partition(":")
        name, size = name.strip(), size.strip()
        if name not in AXES:
            raise UserError(f"--mesh: unknown axis {name!r} (use data, fsdp, expert and tensor, e.g. "
                            f"--mesh=data:2,fsdp:4)")
        if name in seen:
            raise UserError(f"--mesh={spec} names axis {name} twice; give each axis once, e.g. --mesh=data:2,fsdp:4")
        seen.add(name)
        if not re.fullmatch(r"-?[0-9]+", size):  # int() would also take "+8", "1_0" and other digits
            raise UserError(f"--mesh: axis {name} needs a size, e.g. {name}:2 (got {part!r})")
        sizes[name] = int(size)
        if sizes[name] < 1:
            raise UserError(f"--mesh: axis {name} must have a positive size (got {sizes[name]})")
    total = math.prod(sizes.values())
    if total != n_devices:
        raise UserError(f"--mesh={spec} uses {total} devices but {n_devices} are available "
                        f"(make the sizes multiply to {n_devices})")
    return sizes


def make_mesh(spec: str = "", devices: Any = None) -> Mesh:
    """The (data, fsdp, expert, tensor) mesh over all devices of the job, or over `devices` (e.g. a subset,
    for tests and tools that want a smaller mesh than the machine has)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = parse_mesh(spec, len(devices))
    return jax.make_mesh(tuple(sizes[a] for a in AXES), AXES,
                         axis_types=(jax.sharding.AxisType.Auto,) * len(AXES), devices=devices)


def batch_degree(mesh: Mesh) -> int:
    """How many ways batch rows are split: data x fsdp x expert."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def check_divisibility(cfg: ModelConfig, mesh: Mesh, global_batch: int, resuming: bool = False) -> None:
    """The mesh splits the batch rows, the experts, the heads and the MLP width evenly. A resumed
    run keeps its --batch_size, so there the fix is another mesh."""
    dp = batch_degree(mesh)
    if global_batch % dp:
        fix = (f"pass a --mesh whose data x fsdp x expert divides {global_batch} (a resumed run keeps its "
               f"--batch_size)" if resuming else f"use a multiple of {dp}")
        raise UserError(f"--batch_size={global_batch} is not divisible by the data-parallel degree "
                        f"{dp} (data x fsdp x expert); {fix}")
    ep = mesh.shape["expert"]
    if cfg.n_expert % ep:
        raise UserError(f"--n_expert={cfg.n_expert} is not divisible by the mesh's expert axis ({ep}); "
                        f"each device of that axis holds n_expert / {ep} experts")
    tp = mesh.shape["tensor"]
    if cfg.n_head % tp:
        raise UserError(f"--n_head={cfg.n_head} is not divisible by the tensor-parallel degree {tp} "
                        f"(each device of that axis holds n_head / {tp} heads); {tensor_fix(cfg, mesh, global_batch)}")
    if cfg.ffn % tp:
        raise UserError(f"the MLP width {cfg.ffn} is not divisible by the tensor-parallel degree {tp}; "
                        f"{tensor_fix(cfg, mesh, global_batch)}")


def tensor_fix(cfg: ModelConfig, mesh: Mesh, global_batch: int) -> str:
    """The largest tensor size below the mesh's that divides n_head and the MLP width, with the
    devices it frees moved onto data, as a whole --mesh the batch also fits."""
    sizes, tp = dict(mesh.shape), mesh.shape["tensor"]
    for d in range(tp - 1, 0, -1):
        new = {**sizes, "tensor": d, "data": sizes["data"] * tp // d}
        if tp % d == 0 and cfg.n_head % d == 0 and cfg.ffn % d == 0 and \
                global_batch % math.prod(new[a] for a in BATCH_AXES) == 0:
            return "e.g. --mesh=" + ",".join(f"{a}:{new[a]}" for a in AXES if new[a] > 1)
    return (f"use a tensor size that divides n_head ({cfg.n_head}) and the MLP width ({cfg.ffn}), "
            f"with a --batch_size the other axes divide")


def param_spec(logical: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
    """PartitionSpec of one parameter from its logical axes and the mesh sizes."""
    spec: list[Any] = [None] * len(shape)
    tp, fsdp, ep = mesh.shape["tensor"], mesh.shape["fsdp"], mesh.shape["expert"]
    for i, ax in enumerate(logical):
        if ax in TENSOR_LOGICAL and tp > 1 and shape[i] % tp == 0:
            spec[i] = "tensor"
        elif ax == "expert" and ep > 1 and shape[i] % ep == 0:
            spec[i] = "expert"
    matrix_dims = [i for i, ax in enumerate(logical) if ax != "layers"]
    if fsdp > 1 and len(matrix_dims) >= 2:
        free = [i for i in matrix_dims if spec[i] is None and shape[i] % fsdp == 0]
        if free:
            spec[max(free, key=lambda i: shape[i])] = "fsdp"
    return P(*spec)


def _key_name(k) -> str:
    return str(getattr(k, "key", getattr(k, "name", k)))


def _leaf_name(path) -> str:
    return _key_name(path[-1])


def param_shardings(model_state: Any, mesh: Mesh) -> Any:
    """NamedShardings (a pure dict like the parameters) from a model's `nnx.State`, abstract or not:
    each parameter's logical axes come from its metadata."""
    from flax import nnx
    logical = nnx.to_pure_dict(nnx.get_partition_spec(model_state))
    shapes = nnx.to_pure_dict(model_state)
    return jax.tree.map(lambda names, x: NamedSharding(mesh, param_spec(tuple(names), x.shape, mesh)),
                        logical, shapes, is_leaf=lambda x: isinstance(x, P))


def fsdp_left_whole(model_state: Any, mesh: Mesh) -> str | None:
    """A warning naming the weights (of two or more dimensions) the mesh's fsdp axis divides no
    dimension of (a shape needs one that divides exactly), which every device then holds whole
    with their optimizer state, and their share of the parameters; None when under 1% of them."""
    from flax import nnx
    fsdp = mesh.shape["fsdp"]
    if fsdp == 1:
        return None
    logical = nnx.to_pure_dict(nnx.get_partition_spec(model_state))
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(model_state))[0]
    names = dict(jax.tree_util.tree_flatten_with_path(logical, is_leaf=lambda x: isinstance(x, P))[0])
    whole, total = {}, 0
    for path, x in flat:
        axes = tuple(names[path])
        total += math.prod(x.shape)
        if sum(ax != "layers" for ax in axes) >= 2 and "fsdp" not in param_spec(axes, x.shape, mesh):
            whole["/".join(_key_name(k) for k in path)] = math.prod(x.shape)
    share = 100 * sum(whole.values()) / total
    if share < 1:  # a bias such as b_qkv [3, heads, head size]: not worth a warning
        return None
    return (f"warning: fsdp:{fsdp} divides no dimension of {', '.join(whole)} ({share:.1f}% of the parameters), "
            f"so every device holds them whole with their optimizer state; an fsdp size that divides "
            f"their dimensions (n_embd, the head size) shards them")


def like_params(tree: Any, params_shardings: Any, mesh: Mesh) -> Any:
    """Shardings for a pytree (optimizer state) whose leaves mirror parameters, or are scalars: a
    leaf whose path ends with a parameter's path (Adam's mu/.../blocks/w_fc) takes its sharding."""
    by_path: dict[tuple[str, ...], NamedSharding] = {}
    for path, s in jax.tree_util.tree_flatten_with_path(params_shardings)[0]:
        by_path[tuple(_key_name(k) for k in path)] = s

    def pick(path, x):
        names = tuple(_key_name(k) for k in path)
        for i in range(len(names)):
            s = by_path.get(names[i:])
            if s is not None and getattr(x, "ndim", 0) == len(s.spec):
                return s
        return NamedSharding(mesh, P())
    return jax.tree_util.tree_map_with_path(pick, tree)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Rows over data x fsdp x expert; with gradient accumulation the leading micro-batch axis is
    unsharded."""
    lead = [None] * (ndim - 2)
    return NamedSharding(mesh, P(*lead, BATCH_AXES, None))


def batch_process_layout(mesh: Mesh) -> tuple[int, int]:
    """(index, count) of this process's block of batch rows, for `data.Batches`.

    Rows are sharded over data x fsdp x expert; a process needs the rows of its own devices. Usually that is
    block `process_index` of `process_count`, but when a mesh puts whole data-parallel groups on
    several hosts (e.g. tensor parallelism across hosts) processes share blocks, so the block index
    and count come from the mesh, not from the process numbers.
    """
    dp = batch_degree(mesh)
    index_map = batch_sharding(mesh, 2).devices_indices_map((dp, 1))
    rows: dict[int, set[int]] = {}
    for device, idx in index_map.items():
        r = idx[0]
        rows.setdefault(device.process_index, set()).update(range(*r.indices(dp)))
    blocks = sorted({(min(v), max(v) + 1) for v in rows.values()})
    size = blocks[0][1] - blocks[0][0]
    if any(hi - lo != size for lo, hi in blocks) or \
            [lo for lo, _ in blocks] != list(range(0, dp, size)) or \
            any(len(v) != size for v in rows.values()):
        raise UserError(f"the mesh {dict(mesh.shape)} gives processes overlapping or scattered batch "
                        f"rows; order the axes so that each host holds whole data-parallel groups")
    mine = min(rows[jax.process_index()])
    return mine // size, len(blocks)


def global_batch(local: np.ndarray, sharding: NamedSharding, global_shape: tuple[int, ...]) -> jax.Array:
    """Assemble a global array from this process's rows (the whole batch on a single process)."""
    return jax.make_array_from_process_local_data(sharding, local, global_shape)


def state_bytes(tree: Any) -> tuple[int, int]:
    """(total bytes, bytes on the most loaded device) of a pytree of arrays."""
    total, per_device = 0, {}
    for x in jax.tree.leaves(tree):
        total += x.size * x.dtype.itemsize
        for shard in x.addressable_shards:
            d = shard.device
            per_device[d] = per_device.get(d, 0) + shard.data.size * shard.data.dtype.itemsize
    return total, max(per_device.values(), default=0)


def main_process_first(fn: Callable[[], T], others: Callable[[], T]) -> T:
    """`fn()` on process 0 (it makes something, e.g. prepares the data into the shared cache),
    then `others()` on the rest (they only find it). The outcome of each is shared, so a failure
    anywhere stops every process with one line instead of leaving the others waiting."""
    if jax.process_count() == 1:
        return fn()
    made = all_or_none(fn if is_main_process() else lambda: None)
    return all_or_none((lambda: made) if is_main_process() else others)


def all_or_none(fn: Callable[[], T]) -> T:
    """`fn()` on every process, then all learn whether all succeeded (an all-gather): a process
    that failed raises its own error, the others a line naming it. Use it around per-process
    work (checks, reading files) that precedes a collective, which would wait forever for a
    process that already stopped."""
    if jax.process_count() == 1:
        return fn()
    from jax.experimental import multihost_utils
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except BaseException as e:  # noqa: BLE001 - shared with the others first, then raised
        error = e
    failed = np.asarray(multihost_utils.process_allgather(np.int32(error is not None))).reshape(-1)
    if error is not None:
        raise error
    if failed.any():
        who = ", ".join(str(int(i)) for i in np.nonzero(failed)[0])
        raise UserError(f"process(es) {who} stopped at start-up (their own error says why); fix that and "
                        f"start every process again")
    return result


@functools.cache
def _max_over_devices() -> tuple[NamedSharding, Callable[[jax.Array], jax.Array]]:
    """The sharding of one entry per device over every device of the job, and a compiled max of
    such an array that every device keeps (for `max_over_processes`)."""
    mesh = Mesh(np.asarray(jax.devices()), ("all",))
    return NamedSharding(mesh, P("all")), jax.jit(lambda a: a.max(), out_shardings=NamedSharding(mesh, P()))


def max_over_processes(value: int) -> jax.Array:
    """The largest of every process's `value`, reduced on the devices and returned without
    waiting for it: a replicated int32 scalar (read it with `.addressable_data(0)`), ready once
    the work queued before it is done. `multihost_utils.process_allgather` returns a NumPy array,
    so it waits for everything queued before it."""
    sharding, reduce_max = _max_over_devices()
    shards = [jax.device_put(np.full((1,), value, np.int32), d) for d in jax.local_devices()]
    return reduce_max(jax.make_array_from_single_device_arrays((jax.device_count(),), sharding, shards))


def check_agreement(parts: dict[str, str], hint: str) -> None:
    """Every process compares the hash of each named part with process 0's, then all learn who
    differs (an all-gather), so a mismatch is the same one-line UserError on every process
    instead of a hang at the first collective that depends on it."""
    from jax.experimental import multihost_utils
    mine = np.stack([np.frombuffer(hashlib.sha256(v.encode()).digest(), np.uint8) for v in parts.values()])
    ref = np.asarray(multihost_utils.broadcast_one_to_all(mine))
    differs = np.asarray(multihost_utils.process_allgather((mine != ref).any(axis=1).astype(np.int32)))
    differs = differs.reshape(jax.process_count(), len(parts))
    if differs.any():
        names = [n for n, bad in zip(parts, differs.any(axis=0)) if bad]
        who = [int(i) for i in np.nonzero(differs.any(axis=1))[0]]
        raise UserError(f"process(es) {', '.join(map(str, who))} disagree with process 0 on "
                        f"{', '.join(names)}; {hint}")


def is_main_process() -> bool:
    return jax.process_index() == 0


def log(msg: str) -> None:
    if is_main_process():
        print(msg, file=sys.stderr, flush=True)
