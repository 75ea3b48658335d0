"""The device mesh every program runs on: named axes (data, fsdp, tensor)
over the devices, in the chips' physical order where JAX knows it.

Below the model: `model.sharding` maps logical axes onto these mesh axes,
and `runtime.distributed` lays the mesh over hosts.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

MESH_AXES = ("data", "fsdp", "tensor")


def make_mesh(shape: Sequence[int] = (-1, 1, 1), devices: Sequence[Any] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh with explicit Auto axis types.

    `shape` may contain one -1, filled with the remaining devices. Raises a
    sentence naming both numbers if the mesh needs more devices than exist or
    does not use them evenly.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = list(shape)
    if len(shape) != 3:
        raise ValueError(f"mesh shape must have 3 entries (data, fsdp, tensor), got {shape}.")
    if shape.count(-1) > 1:
        raise ValueError(f"mesh shape {shape} has more than one -1.")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if len(devices) % known:
            raise ValueError(f"mesh shape {shape}: {len(devices)} devices are not divisible by "
                             f"the fixed axes' product {known}.")
        shape[shape.index(-1)] = len(devices) // known
    if any(s <= 0 for s in shape):
        raise ValueError(f"mesh shape {shape} has a non-positive axis size.")
    need = math.prod(shape)
    if need > len(devices):
        raise ValueError(f"mesh {dict(zip(MESH_AXES, shape))} needs {need} devices but only "
                         f"{len(devices)} are available.")
    if need < len(devices):
        devices = devices[:need]
    try:
        from jax.experimental import mesh_utils
        grid = mesh_utils.create_device_mesh(shape, devices=devices)
    except Exception:  # non-TPU topologies or odd device counts: plain order
        grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


# A Cloud TPU chip's HBM in GiB by JAX's `device_kind` (Cloud TPU docs, per
# generation: v4, v5e, v5p, v6e; `erpo plan`'s chip table reads it from here).
CHIP_HBM_GIB = {"TPU v4": 32, "TPU v5 lite": 16, "TPU v5": 95, "TPU v6 lite": 32}


def chip_memory_bytes(device) -> float | None:
    """The memory one accelerator chip gives a program: what the runtime
    reports (`memory_stats()['bytes_limit']`) for a local device, else, for a
    TPU `erpo plan` compiles for without holding it, the chip's HBM by its
    kind; None where neither is known (the CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:            # not addressable: an ahead-of-time topology's device
        stats = None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    gib = CHIP_HBM_GIB.get(getattr(device, "device_kind", ""))
    return None if gib is None else gib * 2.0**30

