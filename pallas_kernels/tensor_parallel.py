"""Tensor parallelism as the kernels see it: the mesh axis name, the parallel degree of the mesh
being traced under (`jax.set_mesh`), and `per_device`, which runs an op on each device's slice
under `jax.shard_map`.

XLA's SPMD partitioner splits plain JAX ops by the shardings of their inputs; a Pallas kernel is
opaque to it, so each kernel dispatcher runs its kernel (or its reference, which keeps the CPU on
the same path) per device on the heads or columns that device holds.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

TP = "tp"  # the one mesh axis: tensor-parallel devices


def tp_size() -> int:
    """Devices on the `tp` axis of the mesh being traced under; 1 without one."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get(TP, 1)


def on_axis(ndim: int, axis: int) -> P:
    """The spec of an ndim array split over the tp axis along `axis` (negative counts from the end)."""
    spec = [None] * ndim
    spec[axis] = TP
    return P(*spec)


def per_device(fn, in_specs, out_specs):
    """fn run on each device's slice (`jax.shard_map` over the current mesh) when tracing under a
    tensor-parallel mesh; fn itself otherwise. The specs are `shard_map`'s."""
    if tp_size() == 1:
        return fn
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def constrain(x: jax.Array, spec: P) -> jax.Array:
    """x laid out as `spec` over the current tensor-parallel mesh; x unchanged without one."""
    return x if tp_size() == 1 else jax.lax.with_sharding_constraint(x, spec)
