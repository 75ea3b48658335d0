"""Multi-host runs: find the other processes, build a mesh over hosts, feed it.

A multi-host run is the same program started once per host (one process per
TPU VM worker). Before anything touches a device, every process calls
`maybe_initialize()`, which reads the environment `tpu_setup/launch.sh`
exports and joins the processes with `jax.distributed.initialize`:

    ERPO_MULTIHOST=1               on a Cloud TPU slice: JAX finds the other
                                   workers itself (metadata server)
    JAX_COORDINATOR_ADDRESS=h:p    explicit mode (any platform, and the CPU
    JAX_NUM_PROCESSES=N            tests): process 0 serves the coordinator at
    JAX_PROCESS_ID=i               h:p and every process says who it is
    ERPO_MULTIHOST=0               force a single process whatever else is set

Without any of these, `TPU_WORKER_HOSTNAMES` naming several hosts (GKE) or
`MEGASCALE_NUM_SLICES` > 1 (multi-slice) also mean "multi-host"; otherwise the
run is a single process and nothing is initialised.

Meshes. `mesh_for` lays out (data, fsdp, tensor) so that tensor parallelism
stays inside a host and the hosts split the batch axes (data first, then
fsdp), each host holding one contiguous block of the global batch. That block
is what the host's data iterator must produce: `feed_slice` says which one, and
`global_batch` assembles the per-host numpy arrays into global jax.Arrays.
`plan_mesh` and `abstract_mesh_shape` do the same arithmetic without devices.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

from erpo_jax.runtime.mesh import MESH_AXES, make_mesh

# The variables tpu_setup/launch.sh exports; the tests check it names each one.
ENV_MULTIHOST = "ERPO_MULTIHOST"
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
LAUNCH_ENV = (ENV_MULTIHOST, ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


# ----------------------------------------------------------------------------- detection


@dataclasses.dataclass(frozen=True)
class MultihostEnv:
    """What the environment says about this process.

    mode: 'single' (nothing to initialise), 'explicit' (coordinator, count and
      id given) or 'auto' (let `jax.distributed.initialize()` find them: Cloud
      TPU, GKE, Slurm).
    reason: which variable decided the mode, for logs and error messages.
    """

    mode: str
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    num_slices: int = 1
    reason: str = ""


def _int_var(env: Mapping[str, str], name: str) -> int:
    text = env.get(name, "").strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer.") from None


def detect(environ: Mapping[str, str] | None = None) -> MultihostEnv:
    """Read the multi-host settings from `environ` (default: os.environ).

    Raises ValueError naming every missing variable when explicit mode is only
    partly configured, and when the values contradict each other.
    """
    env = os.environ if environ is None else environ
    flag = env.get(ENV_MULTIHOST, "").strip().lower()
    if flag and flag not in _TRUE + _FALSE:
        raise ValueError(f"{ENV_MULTIHOST}={env[ENV_MULTIHOST]!r}: use 1 (multi-host) or 0 "
                         "(single process).")
    slices = _int_var(env, "MEGASCALE_NUM_SLICES") if env.get("MEGASCALE_NUM_SLICES") else 1
    if flag in _FALSE:
        return MultihostEnv("single", reason=f"{ENV_MULTIHOST}=0")
    if env.get(ENV_COORDINATOR):
        missing = [n for n in (ENV_NUM_PROCESSES, ENV_PROCESS_ID) if not env.get(n)]
        if missing:
            raise ValueError(f"{ENV_COORDINATOR} is set but {' and '.join(missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} not; explicit multi-host "
                             "mode needs all three.")
        n, i = _int_var(env, ENV_NUM_PROCESSES), _int_var(env, ENV_PROCESS_ID)
        if n < 1 or not 0 <= i < n:
            raise ValueError(f"{ENV_PROCESS_ID}={i} is not in [0, {ENV_NUM_PROCESSES}={n}).")
        return MultihostEnv("explicit", env[ENV_COORDINATOR], n, i, slices,
                            reason=ENV_COORDINATOR)
    if flag in _TRUE:
        return MultihostEnv("auto", num_slices=slices, reason=f"{ENV_MULTIHOST}=1")
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(hosts) > 1:
        return MultihostEnv("auto", num_processes=len(hosts), num_slices=slices,
                            reason="TPU_WORKER_HOSTNAMES")
    if slices > 1:
        return MultihostEnv("auto", num_slices=slices, reason="MEGASCALE_NUM_SLICES")
    return MultihostEnv("single", reason="no multi-host variables")


def maybe_initialize(environ: Mapping[str, str] | None = None, *,
                     timeout_s: int = 300) -> MultihostEnv:
    """Join the other processes of a multi-host run; a no-op for one process.

    Call it first, before anything asks JAX for devices. Idempotent: a second
    call (or a call after someone else initialised) does nothing. Explicit mode
    passes coordinator, count and id to `jax.distributed.initialize`; auto mode
    passes nothing, so Cloud TPU's own detection runs. `timeout_s` bounds the
    wait for the other processes to connect.
    """
    env = detect(environ)
    if env.mode == "single" or jax.distributed.is_initialized():
        return env
    if env.mode == "explicit" and env.num_processes == 1:
        return env
    kwargs: dict[str, Any] = {"initialization_timeout": int(timeout_s)}
    if env.mode == "explicit":
        kwargs.update(coordinator_address=env.coordinator_address,
                      num_processes=env.num_processes, process_id=env.process_id)
    try:
        jax.distributed.initialize(**kwargs)
    except RuntimeError as e:
        if "before" in str(e).lower():
            raise RuntimeError(
                "jax.distributed could not start because JAX was already used in this "
                "process; call erpo_jax.runtime.distributed.maybe_initialize() before anything "
                f"asks for devices ({env.reason} asked for a multi-host run).") from e
        raise
    return env


def is_primary() -> bool:
    """True on process 0, the one that writes single files (configs, reports,
    caches); checkpoints are written by every process through orbax."""
    return jax.process_index() == 0


def clean_shutdown() -> None:
    """Leave the multi-host run (`jax.distributed.shutdown`) if this process
    joined one, so the coordinator does not wait for a heartbeat timeout."""
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


# ----------------------------------------------------------------------------- topologies


@dataclasses.dataclass(frozen=True)
class _Generation:
    counts: str          # what the number in the name counts: 'cores' or 'chips'
    cores_per_chip: int
    devices_per_chip: int  # JAX devices per chip (1 with megacore)
    chips_per_host: int
    single_host_max: int   # largest chip count that is still one host


_GENERATIONS = {
    "v2": _Generation("cores", 2, 2, 4, 4),
    "v3": _Generation("cores", 2, 2, 4, 4),
    "v4": _Generation("cores", 2, 1, 4, 4),
    "v5p": _Generation("cores", 2, 1, 4, 4),
    "v5litepod": _Generation("chips", 1, 1, 4, 8),
    "v6e": _Generation("chips", 1, 1, 4, 8),
}
_ALIASES = {"v5e": "v5litepod", "v5lite": "v5litepod"}


@dataclasses.dataclass(frozen=True)
class SliceShape:
    """One TPU slice as the scripts and the mesh builder see it."""

    accelerator_type: str
    generation: str
    chips: int
    hosts: int
    devices_per_host: int  # JAX devices (= processes' local devices) per host

    @property
    def devices(self) -> int:
        return self.hosts * self.devices_per_host


def abstract_mesh_shape(accelerator_type: str) -> SliceShape:
    """Chips, hosts and JAX devices of a Cloud TPU accelerator type, no TPU needed.

    'v4-8' -> 4 chips on 1 host; 'v5litepod-16' -> 16 chips on 4 hosts;
    'v5p-8' -> 4 chips, 1 host; 'v6e-8' -> 8 chips, 1 host. For v2-v5p the
    number counts TensorCores (2 per chip), for v5e/v6e it counts chips.
    """
    m = re.fullmatch(r"\s*(v\d+[a-z]*)-(\d+)\s*", accelerator_type.lower())
    name = _ALIASES.get(m.group(1), m.group(1)) if m else None
    if not m or name not in _GENERATIONS:
        raise ValueError(f"accelerator type {accelerator_type!r} is not one of "
                         f"{sorted(_GENERATIONS)} followed by '-<size>' (e.g. v4-8, "
                         "v5litepod-16, v5p-8, v6e-8).")
    gen, count = _GENERATIONS[name], int(m.group(2))
    chips = count // gen.cores_per_chip if gen.counts == "cores" else count
    bad = (count < 1 or (gen.counts == "cores" and count % 8)
           or (chips > gen.single_host_max and chips % gen.chips_per_host))
    if bad:
        raise ValueError(f"accelerator type {accelerator_type!r}: {count} is not a size "
                         f"{name} slices come in.")
    hosts = 1 if chips <= gen.single_host_max else chips // gen.chips_per_host
    return SliceShape(accelerator_type.strip(), name, chips, hosts,
                      chips // hosts * gen.devices_per_chip)


# ----------------------------------------------------------------------------- meshes


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """A (data, fsdp, tensor) shape and how it splits into hosts x per-host.

    `shape[i] == hosts[i] * per_host[i]`; tensor is never split over hosts.
    """

    shape: tuple[int, int, int]
    hosts: tuple[int, int, int]
    per_host: tuple[int, int, int]


def plan_mesh(num_devices: int, devices_per_host: int, data: int | None = None,
              fsdp: int | None = None, tensor: int | None = None, *,
              num_slices: int = 1) -> MeshPlan:
    """Choose the mesh shape for `num_devices` devices in hosts of `devices_per_host`.

    None (or -1) means "choose": tensor defaults to 1, data to 1 when fsdp is
    also open, and the one open axis takes the remaining devices. So with no
    arguments every device is an fsdp shard (parameters and optimizer state
    spread over the whole slice, the batch too). Raises a sentence naming the
    numbers when the shape does not use the devices, when tensor parallelism
    would cross hosts, when the hosts cannot each get a contiguous block of
    the batch, or when `num_slices` > 1 slices (joined by the slow data-center
    network) would be crossed by anything but data parallelism.
    """
    if num_devices < 1 or devices_per_host < 1 or num_devices % devices_per_host:
        raise ValueError(f"{num_devices} devices do not split into hosts of "
                         f"{devices_per_host} devices.")
    n_hosts = num_devices // devices_per_host
    axes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    axes = {k: (None if v is None or v == -1 else int(v)) for k, v in axes.items()}
    for k, v in axes.items():
        if v is not None and v < 1:
            raise ValueError(f"mesh axis {k}={v} must be a positive size (or -1 to fill).")
    if sum(v is None for v in axes.values()) >= 2 and axes["tensor"] is None:
        axes["tensor"] = 1
    if axes["data"] is None and axes["fsdp"] is None:
        axes["data"] = 1
    open_axes = [k for k, v in axes.items() if v is None]
    known = math.prod(v for v in axes.values() if v is not None)
    if open_axes:
        if num_devices % known:
            raise ValueError(f"mesh {axes}: {num_devices} devices are not divisible by the "
                             f"fixed axes' product {known}.")
        axes[open_axes[0]] = num_devices // known
    shape = (axes["data"], axes["fsdp"], axes["tensor"])
    if math.prod(shape) != num_devices:
        raise ValueError(f"mesh (data={shape[0]}, fsdp={shape[1]}, tensor={shape[2]}) has "
                         f"{math.prod(shape)} devices but the slice has {num_devices}.")
    d, f, t = shape
    if devices_per_host % t:
        raise ValueError(f"tensor={t} does not fit inside one host's {devices_per_host} "
                         "devices; tensor parallelism communicates at every layer, so keep "
                         f"it within a host (a divisor of {devices_per_host}).")
    hd = math.gcd(d, n_hosts)
    hf = n_hosts // hd
    if f % hf or (hf > 1 and hd != d):
        raise ValueError(f"mesh (data={d}, fsdp={f}, tensor={t}) cannot give each of the "
                         f"{n_hosts} hosts one contiguous block of the batch; make data a "
                         f"multiple of {n_hosts}, or a divisor of {n_hosts} with fsdp a "
                         f"multiple of {n_hosts} // data.")
    if num_slices > 1 and (n_hosts % num_slices or hd % num_slices):
        raise ValueError(f"data={d} is not a multiple of the {num_slices} slices; across "
                         "slices only data parallelism is cheap, so make data a multiple of "
                         f"{num_slices}.")
    return MeshPlan(shape, (hd, hf, 1), (d // hd, f // hf, t))


def _default_host_of(device: Any) -> tuple[int, int]:
    return (getattr(device, "slice_index", 0) or 0, device.process_index)


def mesh_over_hosts(plan: MeshPlan, devices: Sequence[Any],
                    host_of: Callable[[Any], Any] = _default_host_of) -> Mesh:
    """The Mesh of `plan` over `devices`, grouped into hosts by `host_of`.

    Each host's devices form one `plan.per_host` block (laid out by
    `make_mesh`, which knows the chips' physical order on TPU); the blocks are
    tiled `plan.hosts` ways, hosts in sorted `host_of` order (slices outermost).
    """
    groups: dict[Any, list] = {}
    for dev in devices:
        groups.setdefault(host_of(dev), []).append(dev)
    blocks = [sorted(groups[k], key=lambda d: d.id) for k in sorted(groups)]
    n_hosts = math.prod(plan.hosts)
    if len(blocks) != n_hosts or any(len(b) != math.prod(plan.per_host) for b in blocks):
        raise ValueError(f"mesh plan {plan} expects {n_hosts} hosts of "
                         f"{math.prod(plan.per_host)} devices, got hosts of "
                         f"{[len(b) for b in blocks]} devices.")
    if n_hosts == 1:
        return make_mesh(plan.shape, blocks[0])
    per_host = [make_mesh(plan.per_host, b).devices for b in blocks]
    tiles = np.empty(plan.hosts, dtype=object)
    for i, idx in enumerate(np.ndindex(*plan.hosts)):
        tiles[idx] = per_host[i]
    grid = np.block(tiles.tolist())
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def mesh_for(kind: str | None = None, num_devices: int | None = None, data: int | None = None,
             fsdp: int | None = None, tensor: int | None = None, *,
             devices: Sequence[Any] | None = None) -> Mesh:
    """A (data, fsdp, tensor) Mesh over every process's devices.

    kind: the accelerator type ('v4-8', 'v5litepod-16', ...) to check the
      visible devices against (a run started on only some workers fails here
      with the numbers), or None to take the devices as they are.
    num_devices: how many devices to use (default all; fewer only on one host).
    data, fsdp, tensor: sizes, None/-1 to choose (see `plan_mesh`).
    """
    devices = list(jax.devices() if devices is None else devices)
    n_hosts = len({_default_host_of(d) for d in devices})
    if kind is not None:
        want = abstract_mesh_shape(kind).devices * max(1, detect().num_slices)
        if want != len(devices):
            raise ValueError(f"{kind} has {want} devices but this run sees {len(devices)}; "
                             "launch the same command on every worker (--worker=all).")
    if num_devices is not None and num_devices != len(devices):
        if n_hosts > 1 or num_devices > len(devices):
            raise ValueError(f"num_devices={num_devices} but {len(devices)} devices on "
                             f"{n_hosts} hosts are visible; a multi-host mesh uses them all.")
        devices = sorted(devices, key=lambda d: d.id)[:num_devices]
    n_slices = len({_default_host_of(d)[0] for d in devices})
    plan = plan_mesh(len(devices), len(devices) // n_hosts, data, fsdp, tensor,
                     num_slices=n_slices)
    return mesh_over_hosts(plan, devices)


# ----------------------------------------------------------------------------- feeding data


@dataclasses.dataclass(frozen=True)
class FeedSlice:
    """The rows [start, stop) of every global batch this process provides.

    `index`/`count` are what the data iterator takes as process_index /
    process_count: `count` distinct blocks, this process feeds block `index`.
    Processes holding the same rows (replicas) share an index.
    """

    start: int
    stop: int
    index: int
    count: int


def feed_slice(sharding: NamedSharding, global_shape: int | Sequence[int]) -> FeedSlice:
    """Which contiguous rows of an array of `global_shape` (an int: a batch of
    that many rows), laid out by `sharding`, this process's devices hold.

    Raises ValueError when they are not one contiguous, evenly sized block
    (a mesh not built by `mesh_for` can interleave hosts).
    """
    if isinstance(global_shape, int):
        global_shape = (global_shape,) + (1,) * (len(sharding.spec) - 1)
    global_batch_size = int(global_shape[0])
    index_map = sharding.addressable_devices_indices_map(tuple(global_shape))
    rows = set()
    for idx in index_map.values():
        rows.update(range(global_batch_size)[idx[0]] if idx else range(global_batch_size))
    if not rows:
        raise ValueError("this process holds no device of the mesh, so it feeds no rows.")
    start, stop = min(rows), max(rows) + 1
    size = stop - start
    if len(rows) != size or global_batch_size % size or start % size:
        raise ValueError(f"process {jax.process_index()} holds rows {sorted(rows)} of a "
                         f"batch of {global_batch_size}, not one aligned contiguous block; "
                         "build the mesh with erpo_jax.runtime.distributed.mesh_for.")
    return FeedSlice(start, stop, start // size, global_batch_size // size)


def global_batch(local: Any, sharding: NamedSharding | Any, global_batch_size: int) -> Any:
    """Global jax.Arrays from this process's numpy rows.

    local: pytree of arrays [rows, ...], the `feed_slice` rows of the global
      batch (in order). sharding: one NamedSharding for every leaf, or a
      matching pytree of them. Returns arrays of shape [global_batch_size, ...].
    """
    leaves, treedef = jax.tree_util.tree_flatten(local)
    if isinstance(sharding, jax.sharding.Sharding):
        shardings = [sharding] * len(leaves)
    else:
        shardings = treedef.flatten_up_to(sharding)
    out = []
    for x, s in zip(leaves, shardings):
        x = np.asarray(x)
        shape = (global_batch_size,) + x.shape[1:]
        feed = feed_slice(s, shape)
        if x.shape[0] != feed.stop - feed.start:
            raise ValueError(f"this process's batch has {x.shape[0]} rows but it feeds rows "
                             f"[{feed.start}, {feed.stop}) of the global batch of "
                             f"{global_batch_size}.")
        out.append(jax.make_array_from_process_local_data(s, x, shape))
    return jax.tree_util.tree_unflatten(treedef, out)


# ----------------------------------------------------------------------------- reading back


def to_host(tree: Any) -> Any:
    """numpy copies of every array leaf. Arrays spread over several processes
    are gathered, so every process gets the whole global value."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    local = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and x.is_fully_addressable]
    # The local arrays in one device_get: their copies start together.
    for i, v in zip(local, jax.device_get([leaves[i] for i in local])):
        leaves[i] = np.asarray(v)
    for i, x in enumerate(leaves):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if x.is_fully_replicated:
                leaves[i] = np.asarray(x)
            else:
                from jax.experimental import multihost_utils
                leaves[i] = np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def broadcast_from_primary(tree: Any) -> Any:
    """Process 0's numpy values on every process (identity on one process)."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils
    return jax.tree_util.tree_map(np.asarray, multihost_utils.broadcast_one_to_all(tree))
