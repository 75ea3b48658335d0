"""The one table that maps logical axes to mesh axes.

Parameters and activations are annotated with *logical* axis names (`embed`,
`heads`, `vocab`, ...). `RULES` is the only place that says which mesh axis
(`data`, `fsdp`, `tensor`) each one lands on; nothing else names a mesh axis.

    data   - pure data parallelism (parameters replicated)
    fsdp   - data parallelism with parameters and optimizer state sharded
    tensor - Megatron-style tensor parallelism over heads / mlp / vocab
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from erpo_jax.runtime.mesh import MESH_AXES, make_mesh  # noqa: F401 (the mesh, from below)

MeshAxes = str | tuple[str, ...] | None

# Logical axis -> mesh axis (or axes). `act_*` names are activations.
RULES: Mapping[str, MeshAxes] = {
    # parameters
    "layers": None,
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    # activations
    "batch": ("data", "fsdp"),
    # the sampler's rows and KV-cache rows (= batch, except in a weight-stationary decode step)
    "rows": ("data", "fsdp"),
    "length": None,
    "cache_length": None,
    "act_embed": None,
    "act_heads": "tensor",
    "act_kv_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
    # the LM head of the log-prob pass: vocabulary over every chip (see logprobs.py)
    "head_vocab": ("data", "fsdp", "tensor"),
}


@dataclasses.dataclass(frozen=True)
class Sharding:
    """A mesh plus the logical-axis table. Hashable, so it can be a static
    argument of a jitted function or a Flax module attribute."""

    mesh: Mesh
    rules: tuple[tuple[str, MeshAxes], ...] = tuple(RULES.items())

    def spec(self, logical: Sequence[str | None], name: str = "array") -> P:
        return logical_to_spec(logical, dict(self.rules), name)

    def named(self, logical: Sequence[str | None], name: str = "array") -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical, name))

    def constrain(self, x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
        """`with_sharding_constraint` by logical names (a no-op on a 1-device mesh)."""
        if self.mesh.size == 1:
            return x
        return jax.lax.with_sharding_constraint(x, self.named(logical))

    @property
    def platform(self) -> str:
        """The platform of the mesh's devices ('cpu', 'tpu', 'gpu'): the one the
        programs are built for. It may differ from this process's backend:
        `erpo plan` meshes abstract TPU devices on a CPU host."""
        return self.mesh.devices.flat[0].platform

    @property
    def data_size(self) -> int:
        """How many ways the batch axis is split."""
        return axis_size(self.mesh, dict(self.rules)["batch"])

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def weight_stationary(self, mlp_axes: MeshAxes = None) -> "Sharding":
        """The rules of one decode step: the dense layers' activations ("batch")
        are split only over the mesh axes that split no weight, so every chip
        multiplies its own shard of each weight by all rows' (few) hidden
        states and the chips exchange activations instead of weights; the
        sampler's rows and the KV cache ("rows") stay where they are.
        Under the default rules a decode step all-gathers every FSDP-sharded
        weight, the whole model per generated token. mlp_axes: where the
        step's MLP kernels split their hidden axis (`decode_mlp_axes`), which
        its hidden activations then follow."""
        rules = dict(self.rules)
        weight_axes = self.weight_axes()
        batch = tuple(m for m in _as_tuple(rules["rows"]) if m not in weight_axes)
        rules["batch"] = batch or None
        if mlp_axes is not None:
            rules["act_mlp"] = mlp_axes
        return Sharding(self.mesh, tuple(rules.items()))

    def weight_axes(self) -> tuple[str, ...]:
        """The mesh axes that split some weight, in mesh order."""
        rules = dict(self.rules)
        used = {m for ax in ("embed", "heads", "kv_heads", "mlp", "vocab")
                for m in _as_tuple(rules[ax])}
        return tuple(m for m in self.mesh.axis_names if m in used)

    def decode_mlp_axes(self, mlp_size: int) -> tuple[str, ...] | None:
        """The mesh axes over which a decode step's MLP kernels split their
        hidden axis (of mlp_size units): every axis that splits a weight
        (`weight_axes`), so each chip holds whole columns of gate and up and
        whole rows of down. Under the training layout (input axis over fsdp)
        a weight-stationary step instead reduces the [rows, mlp_size] hidden
        activations across chips twice per layer; split on the hidden axis,
        gate and up need no exchange and down's output, [rows, hidden size],
        is summed once. None where no axis of size > 1 splits a weight or
        mlp_size does not divide."""
        axes = tuple(m for m in self.weight_axes() if self.mesh.shape[m] > 1)
        if not axes or mlp_size % axis_size(self.mesh, axes):
            return None
        return axes


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def platform(sharding: Sharding | None) -> str:
    """The platform programs over `sharding` are compiled for: its mesh's,
    else (no mesh) JAX's default backend. Platform-specific code paths (the
    CPU backend's dot workarounds) choose by this, never by the process's
    default backend, so a TPU program compiled on a CPU host is the TPU one."""
    return jax.default_backend() if sharding is None else sharding.platform


def axis_size(mesh: Mesh, axes: MeshAxes) -> int:
    return math.prod(mesh.shape[a] for a in _as_tuple(axes))


def logical_to_spec(logical: Sequence[str | None], rules: Mapping[str, MeshAxes],
                    name: str = "array") -> P:
    """Map logical axis names to a PartitionSpec.

    Raises ValueError when a name is unknown or when two logical axes of one
    array land on the same mesh axis (which GSPMD cannot express).
    """
    out, used = [], {}
    for ax in logical:
        if ax is None:
            out.append(None)
            continue
        if ax not in rules:
            raise ValueError(f"{name}: logical axis {ax!r} is not in the sharding rules "
                             f"({sorted(rules)}).")
        mesh_axes = rules[ax]
        for m in _as_tuple(mesh_axes):
            if m in used:
                raise ValueError(f"{name}: logical axes {used[m]!r} and {ax!r} both map to mesh "
                                 f"axis {m!r}; change one of them in the sharding rules.")
            used[m] = ax
        out.append(mesh_axes)
    return P(*out)


def check_divisible(name: str, shape: Sequence[int], spec: P, mesh: Mesh) -> None:
    """Raise a sentence naming the array, the dimension and both numbers when a
    sharded dimension does not divide evenly."""
    for dim, (size, axes) in enumerate(zip(shape, tuple(spec) + (None,) * len(shape))):
        n = axis_size(mesh, axes)
        if size % n:
            raise ValueError(
                f"{name}: dimension {dim} has size {size}, which is not divisible by the "
                f"{n} devices of mesh axes {axes!r}; change the mesh shape or the model size.")


def tree_shardings(logical_tree: Any, shapes_tree: Any, sharding: Sharding) -> Any:
    """NamedShardings for a pytree of logical-axis tuples, checking divisibility.

    logical_tree: pytree whose leaves are tuples of logical names (or None).
    shapes_tree: matching pytree of arrays / ShapeDtypeStructs.
    """
    is_leaf = lambda x: isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)
    paths_shapes = dict(jax.tree_util.tree_flatten_with_path(shapes_tree)[0])

    def one(path, logical):
        name = jax.tree_util.keystr(path)
        spec = sharding.spec(logical, name)
        check_divisible(name, paths_shapes[path].shape, spec, sharding.mesh)
        return NamedSharding(sharding.mesh, spec)

    return jax.tree_util.tree_map_with_path(one, logical_tree, is_leaf=is_leaf)
