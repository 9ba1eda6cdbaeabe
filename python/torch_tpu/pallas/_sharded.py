"""jax_op(mesh=..., input_partition_specs=..., output_partition_specs=...) over the process group.

torch_tpu runs one process per chip (python/torch_tpu/distributed), so a sharded kernel runs as
`jax.shard_map` does per device: each rank calls the function on its own shards (the tpu
tensors it passes in) and gets its own output shards back. Mesh position i is group rank i
(row-major over the mesh shape), and `jax.lax.axis_index(axis)` is this rank's coordinate.

The function may be the per-shard body itself, or already a `jax.shard_map` over the mesh (as
written for a single-controller TPU runtime): then its body is taken out. Either way the body's
jaxpr is replayed per rank with `axis_index` replaced by the coordinate. Collectives over mesh
axes (psum, all_gather, ppermute, ...) would need one program spanning the processes, which the
runtime does not build: they raise NotImplementedError naming the primitive.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

# id(mesh) -> (mesh, process group) for meshes made by get_pallas_mesh
_MESH_GROUPS: dict[int, tuple[Any, Any]] = {}
_NO_OP_PRIMITIVES = ("pvary", "pcast")  # type casts between varying / invariant values: identity per rank
_JIT_PRIMITIVES = ("jit", "pjit")


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def _group_initialized() -> bool:
    dist = _dist()
    return dist.is_available() and dist.is_initialized()


def get_pallas_mesh(axis_names: Sequence[str], mesh_shape: Sequence[int] | None = None,
                    process_group: Any = None) -> Any:
    """A JAX mesh (jax.sharding.AbstractMesh) whose position i is rank i of `process_group`
    (default: the world group), for jax_op(mesh=...) and jax.shard_map inside jax_op functions.
    `mesh_shape` defaults to all ranks along the first axis and 1 along the others. Without an
    initialised process group the mesh is this one chip (every axis of size 1)."""
    from torch_tpu.pallas import _foreign

    jax = _foreign.require_jax("get_pallas_mesh")
    names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    if not names or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise ValueError(f"get_pallas_mesh: axis_names must be distinct strings, got {axis_names!r}")
    if process_group is not None or _group_initialized():
        dist = _dist()
        group = process_group if process_group is not None else dist.group.WORLD
        world = dist.get_world_size(group)
    else:
        group, world = None, 1
    shape = (world,) + (1,) * (len(names) - 1) if mesh_shape is None else tuple(int(s) for s in mesh_shape)
    if len(shape) != len(names) or any(s < 1 for s in shape):
        raise ValueError(f"get_pallas_mesh: mesh_shape {tuple(shape)} must give one positive size per axis "
                         f"of {names}")
    if math.prod(shape) != world:
        if group is None:
            raise RuntimeError(f"get_pallas_mesh: a mesh of shape {shape} spans {math.prod(shape)} chips, but no "
                               "process group is initialised (this process has one chip): start one process "
                               "per chip (torchrun / torch_tpu.distributed.spawn) and call "
                               "torch.distributed.init_process_group() first")
        raise ValueError(f"get_pallas_mesh: mesh_shape {shape} has {math.prod(shape)} positions but the process "
                         f"group has {world} ranks")
    mesh = jax.sharding.AbstractMesh(shape, names)
    _MESH_GROUPS[id(mesh)] = (mesh, group)
    return mesh


class Sharding:
    """The mesh and partition specs of one jax_op, checked at registration."""

    def __init__(self, op: str, mesh: Any, in_specs: Any, out_specs: Any, n_tensors: int, n_out: int | None) -> None:
        from torch_tpu.pallas import _foreign

        jax = _foreign.require_jax(f"jax_op {op}")
        self.op = op
        if mesh is None:
            raise ValueError(f"jax_op {op}: input_partition_specs / output_partition_specs need mesh= "
                             "(torch.tpu.pallas.get_pallas_mesh(...))")
        names = getattr(mesh, "axis_names", None)
        sizes = getattr(mesh, "axis_sizes", None)
        if names is None or sizes is None:
            raise TypeError(f"jax_op {op}: mesh must be a JAX mesh (torch.tpu.pallas.get_pallas_mesh(...)), got "
                            f"{type(mesh).__name__}")
        self.mesh = mesh
        self.names: tuple[str, ...] = tuple(names)
        self.sizes: tuple[int, ...] = tuple(int(s) for s in sizes)
        P = jax.sharding.PartitionSpec
        if in_specs is None:
            in_specs = (P(),) * n_tensors
        elif isinstance(in_specs, P):
            in_specs = (in_specs,)
        in_specs = tuple(in_specs)
        if len(in_specs) != n_tensors:
            raise ValueError(f"jax_op {op}: input_partition_specs has {len(in_specs)} entries for {n_tensors} "
                             "jax.Array parameters (one PartitionSpec per tensor, P() when replicated)")
        n = 1 if n_out is None else n_out
        if out_specs is None:
            out_specs = (P(),) * n
        elif isinstance(out_specs, P):
            out_specs = (out_specs,) * n if n_out is None else (out_specs,)
        out_specs = tuple(out_specs)
        if len(out_specs) != n:
            raise ValueError(f"jax_op {op}: output_partition_specs has {len(out_specs)} entries for {n} outputs")
        self.in_specs = tuple(P(*s) if not isinstance(s, P) else s for s in in_specs)
        self.out_specs = tuple(P(*s) if not isinstance(s, P) else s for s in out_specs)
        for s in self.in_specs + self.out_specs:
            for a in self._axes_of_spec(s):
                if a not in self.names:
                    raise ValueError(f"jax_op {op}: partition spec {s} names axis {a!r}, which the mesh "
                                     f"{dict(zip(self.names, self.sizes, strict=True))} does not have")

    @staticmethod
    def _axes_of_spec(spec: Any) -> list[str]:
        out: list[str] = []
        for entry in spec:
            if entry is None:
                continue
            out.extend((entry,) if isinstance(entry, str) else tuple(entry))
        return out

    # ---- where this rank sits
    def coords(self) -> dict[str, int]:
        total = math.prod(self.sizes)
        hit = _MESH_GROUPS.get(id(self.mesh))
        group = hit[1] if hit is not None and hit[0] is self.mesh else None
        if total == 1:
            return {n: 0 for n in self.names}
        if not _group_initialized() and group is None:
            raise RuntimeError(f"jax_op {self.op}: the mesh {dict(zip(self.names, self.sizes, strict=True))} spans "
                               f"{total} chips, but no process group is initialised (this process has one chip): "
                               "start one process per chip (torchrun / torch_tpu.distributed.spawn), call "
                               "torch.distributed.init_process_group(), and build the mesh with "
                               "torch.tpu.pallas.get_pallas_mesh; or drop mesh= to run on this chip")
        dist = _dist()
        g = group if group is not None else dist.group.WORLD
        world, rank = dist.get_world_size(g), dist.get_rank(g)
        if world != total:
            raise RuntimeError(f"jax_op {self.op}: the mesh has {total} positions but the process group has {world} "
                               "ranks; build the mesh with torch.tpu.pallas.get_pallas_mesh")
        out, rest = {}, rank
        for n, s in reversed(list(zip(self.names, self.sizes, strict=True))):
            out[n] = rest % s
            rest //= s
        return out

    def global_shape(self, spec: Any, local: tuple[int, ...], what: str) -> tuple[int, ...]:
        if len(spec) > len(local):
            raise ValueError(f"{self.op}: partition spec {spec} has more entries than {what} has dims "
                             f"({len(local)})")
        shape = list(local)
        for d, entry in enumerate(spec):
            if entry is None:
                continue
            for a in (entry,) if isinstance(entry, str) else tuple(entry):
                shape[d] *= self.sizes[self.names.index(a)]
        return tuple(shape)

    # ---- the per-rank function
    def local_fn(self, jax: Any, g: Callable[..., Any], local_avals: Sequence[Any], single: bool
                 ) -> Callable[..., Any]:
        """`g` (arrays -> one array when `single`, else a tuple) as this rank's computation on its shards."""
        global_avals = [jax.ShapeDtypeStruct(self.global_shape(s, tuple(a.shape), f"argument {i}"), a.dtype)
                        for i, (s, a) in enumerate(zip(self.in_specs, local_avals, strict=True))]
        body = None
        try:
            closed = jax.make_jaxpr(g)(*global_avals)
            body = _shard_map_body(closed, self.mesh)
        except NameError:  # e.g. axis_index outside a shard_map: g is the per-shard body
            pass
        if body is None:
            out_specs: Any = self.out_specs[0] if single else self.out_specs
            smap = jax.shard_map(g, mesh=self.mesh, in_specs=self.in_specs, out_specs=out_specs, check_vma=False)
            body = _shard_map_body(jax.make_jaxpr(smap)(*global_avals), self.mesh)
            if body is None:
                raise RuntimeError(f"{self.op}: could not trace the function as a shard_map body")
        jaxpr, consts = body
        coords = self.coords()
        names = set(self.names)

        def local(*arrays: Any) -> Any:
            outs = _eval(jax, self.op, jaxpr, consts, list(arrays), coords, self.sizes, self.names, names)
            return outs[0] if single else tuple(outs)

        return local


def _shard_map_body(closed: Any, mesh: Any) -> tuple[Any, list[Any]] | None:
    """(body jaxpr, its consts) when `closed` is one shard_map over all its inputs."""
    jp = closed.jaxpr
    if len(jp.eqns) != 1 or jp.eqns[0].primitive.name != "shard_map":
        return None
    eqn = jp.eqns[0]
    if list(eqn.invars) != list(jp.invars) or list(eqn.outvars) != list(jp.outvars):
        return None
    m = eqn.params["mesh"]
    if tuple(m.axis_names) != tuple(mesh.axis_names) or tuple(m.axis_sizes) != tuple(mesh.axis_sizes):
        return None
    inner = eqn.params["jaxpr"]
    consts = list(getattr(inner, "consts", []))
    inner = getattr(inner, "jaxpr", inner)
    return inner, consts


def _mentions_axes(value: Any, names: set[str]) -> bool:
    if isinstance(value, str):
        return value in names
    if isinstance(value, (tuple, list, frozenset, set)):
        return any(_mentions_axes(v, names) for v in value)
    return False


def _nested_jaxprs(params: dict[str, Any]) -> list[Any]:
    out = []
    for v in params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            inner = getattr(x, "jaxpr", x)
            if hasattr(inner, "eqns"):
                out.append(inner)
    return out


def _axis_use(eqn: Any, names: set[str]) -> bool:
    """Whether `eqn` (or a jaxpr inside it) works across mesh axes."""
    for key in ("axis_name", "axes", "axis_names"):
        if key in eqn.params and _mentions_axes(eqn.params[key], names):
            return True
    return any(_axis_use(e, names) for j in _nested_jaxprs(eqn.params) for e in j.eqns)


def _eval(jax: Any, op: str, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], coords: dict[str, int],
          sizes: tuple[int, ...], axis_names: tuple[str, ...], names: set[str]) -> list[Any]:
    from jax.extend import core as jcore

    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        prim = eqn.primitive.name
        if prim == "axis_index":
            axes = eqn.params["axis_name"]
            axes = (axes,) if isinstance(axes, str) else tuple(axes)
            idx = 0
            for a in axes:
                idx = idx * sizes[axis_names.index(a)] + coords[a]
            outs = [jax.numpy.asarray(idx, dtype=eqn.outvars[0].aval.dtype)]
        elif prim in _NO_OP_PRIMITIVES:
            outs = invals
        elif prim in _JIT_PRIMITIVES and _axis_use(eqn, names):
            inner = eqn.params["jaxpr"]
            outs = _eval(jax, op, inner.jaxpr, inner.consts, invals, coords, sizes, axis_names, names)
        elif _axis_use(eqn, names):
            raise NotImplementedError(
                f"{op}: the JAX function uses '{prim}' across mesh axes {sorted(names)}; jax_op runs it per process "
                "(one chip each, shard_map semantics) and cannot run JAX collectives between processes. Do the "
                "collective with torch.distributed on the op's inputs or outputs (tpu tensors), or pass what the "
                "kernel needs as inputs (axis_index is supported)")
        else:
            with eqn.ctx.manager:
                ans = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            outs = list(ans) if eqn.primitive.multiple_results else [ans]
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]
