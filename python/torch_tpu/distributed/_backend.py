"""The `tpu_dist` c10d backend: host-staged collectives over gloo (the CPU-plugin transport).

How it plugs into c10d without C++: every collective of a `ProcessGroup` goes through a
dispatcher op (`c10d::allreduce_`, `c10d::_allgather_base_`, ...) with one kernel per device
key. The backend object we register for device "tpu" is a plain `ProcessGroupGloo`; our
PrivateUse1 kernels for those ops (installed once, below) copy the tpu tensors to the host,
run the same collective on that gloo backend, and copy the results back when it completes.
`dist.all_reduce`, DDP's reducer, FSDP2, DTensor's `_c10d_functional` ops and compiled
graphs all reach these kernels, so there is one transport path for all of them.

Async: the device->host copy is the only work done on the calling thread; the collective runs
on gloo's worker threads and the host->device copy of the results runs when it completes
(future callback). The returned `Work` wraps that future (`wait`, `is_completed`,
`get_future`).

Agreement check: gloo does not notice when ranks pass tensors of different shapes or dtypes
(it would hang or read garbage), so before each collective the ranks all-gather a small
signature (op, dtype, shape, root, reduce op, split sizes) through the same gloo backend and every
rank raises the same clear error on a mismatch. TORCH_TPU_DIST_CHECK=0 turns it off.
"""

from __future__ import annotations

import datetime
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

BACKEND_NAMES = ("tpu_dist", "tpu")

_lock = threading.Lock()
_kernels: torch.library.Library | None = None


# ------------------------------------------------------------------ per-group state
class _GroupState:
    """The gloo backend registered for 'tpu' on one process group, and the backend its agreement checks use."""

    def __init__(self, gloo: Any, check: Any | None, rank: int, size: int) -> None:
        self.gloo = gloo
        self.check = check
        self.rank = rank
        self.size = size
        self.default_fixed = False
        # Agreement-check buffers, reused by every call (the check is synchronous): one row is
        # the signature plus room for a small inline payload, `rows` receives every rank's row.
        self.row: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None


# id(gloo backend python object) -> state. The dict keeps the wrapper alive, so pybind hands
# back this same object for `pg._get_backend(tpu)`.
_states: dict[int, _GroupState] = {}


def _check_enabled() -> bool:
    return os.environ.get("TORCH_TPU_DIST_CHECK", "1") != "0"


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    """c10d creator for 'tpu_dist' / 'tpu': the gloo backend that moves the staged tensors."""
    install_kernels()
    gloo = c10d.ProcessGroupGloo(store, rank, size, timeout)
    # The agreement check runs on the same gloo backend: every rank enqueues check and
    # collective in the same program order from its calling thread, so tags line up.
    _states[id(gloo)] = _GroupState(gloo, gloo if _check_enabled() and size > 1 else None, rank, size)
    return gloo


_mode = threading.local()  # per call: complete on the calling thread (the caller waits at once)


def _state(pg_obj: Any, async_op: bool = True) -> _GroupState:
    # async_op=False: the caller (dist.all_reduce(...) without async_op) waits right away, so the
    # results are finished on this thread instead of in a callback on gloo's thread.
    _mode.inline = not async_op
    pg = dist.ProcessGroup.unbox(pg_obj)
    backend = pg._get_backend(torch.device("tpu"))
    st = _states.get(id(backend))
    if st is None:
        raise RuntimeError(
            "tpu_dist: this process group's tpu backend was not created by torch_tpu; create the "
            "group with backend='tpu_dist' (or 'cpu:gloo,tpu:tpu_dist')"
        )
    if not st.default_fixed:
        # init_process_group() with no backend (or "cpu:gloo,tpu:tpu_dist") leaves the group's
        # default backend type at GLOO/UNDEFINED while ours is registered as CUSTOM; DDP's logger
        # and hooks look the default up and fail. Every collective passes here first.
        pg._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
        st.default_fixed = True
    return st


# ------------------------------------------------------------------ dtypes on the wire
# Gloo reduces these directly; others are widened (reductions) or sent as bytes (data movement).
_GLOO_DTYPES = {
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
}
_WIDEN = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}
_DTYPE_CODES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
    torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
]

_RED = c10d.ReduceOp.RedOpType
_OP_NAMES = {int(v): k for k, v in _RED.__members__.items()}


def _host(t: torch.Tensor) -> torch.Tensor:
    """Device->host copy of one tpu tensor (the only blocking step of a collective)."""
    if t.device.type != "tpu":
        raise TypeError(
            f"tpu_dist: got a tensor on {t.device}; the tpu_dist backend runs collectives on tpu "
            "tensors. Move it with .to('tpu'), or create the group with "
            "init_process_group('cpu:gloo,tpu:tpu_dist') so CPU tensors use gloo"
        )
    return t.detach().to("cpu").contiguous()


def _zero_copy() -> bool:
    return os.environ.get("TORCH_TPU_DIST_ZERO_COPY", "1") != "0"


def _view(t: torch.Tensor, writable: bool) -> torch.Tensor | None:
    """A CPU tensor aliasing `t`'s device buffer (CPU plugin: device memory is host memory), or None.

    csrc/distributed/host_view.cc decides when aliasing is safe; `writable` views are for
    in-place collectives and need a buffer no other storage or in-flight program shares.
    """
    if t.device.type != "tpu" or t.dtype not in _GLOO_DTYPES or not _zero_copy():
        return None
    v = torch.ops.tpu_dist.host_view(t.detach(), writable)
    return v if isinstance(v, torch.Tensor) else None


def _host_in(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host for reading: an alias of its buffer when possible, else a copy."""
    v = _view(t, False)
    return v if v is not None else _host(t)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A host tensor as gloo can move it: itself, or its raw bytes for dtypes gloo lacks."""
    if t.dtype in _GLOO_DTYPES:
        return t
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _unbytes(raw: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if raw.dtype == like.dtype:
        return raw
    return raw.view(like.dtype).reshape(like.shape)


def _reduce_wire(t: torch.Tensor, op: int) -> torch.Tensor:
    """A host tensor in a dtype gloo can reduce with `op` (bool follows NCCL: SUM->OR)."""
    if t.dtype in _WIDEN:
        return t.to(_WIDEN[t.dtype])
    if t.is_complex():
        if op not in (int(_RED.SUM), int(_RED.AVG), int(_RED.PREMUL_SUM)):
            raise RuntimeError(f"tpu_dist: {_OP_NAMES[op]} is not defined for complex tensors")
        return torch.view_as_real(t)
    if t.dtype.is_floating_point and t.dtype not in _GLOO_DTYPES:
        return t.to(torch.float32)
    if op in (int(_RED.BAND), int(_RED.BOR), int(_RED.BXOR)) and t.is_floating_point():
        raise RuntimeError(f"tpu_dist: {_OP_NAMES[op]} needs integer or bool tensors, got {t.dtype}")
    return t


def _wire_op(t: torch.Tensor, op: int) -> Any:
    """ReduceOp handed to gloo for `op` on wire tensor `t` (AVG/PREMUL_SUM become SUM)."""
    if t.dtype == torch.bool:
        table = {int(_RED.SUM): _RED.MAX, int(_RED.PRODUCT): _RED.MIN, int(_RED.AVG): None}
        if op in table:
            if table[op] is None:
                raise RuntimeError("tpu_dist: AVG is not defined for bool tensors")
            return table[op]
    if op in (int(_RED.AVG), int(_RED.PREMUL_SUM)):
        return _RED.SUM
    return _RED(op)


def _premul_factor(op_obj: Any) -> torch.Tensor:
    # csrc/distributed/premul.cc: the factor is only reachable from C++.
    return torch.ops.tpu_dist.premul_factor(op_obj).to("cpu")


def _pre_reduce(wire: torch.Tensor, op: int, op_obj: Any) -> torch.Tensor:
    if op == int(_RED.PREMUL_SUM):
        f = _premul_factor(op_obj)
        return wire.mul_(f.to(wire.dtype))
    return wire


def _post_reduce(wire: torch.Tensor, op: int, n: int) -> torch.Tensor:
    if op == int(_RED.AVG):
        if wire.is_floating_point():
            return wire.div_(n)
        return wire.div_(n, rounding_mode="floor")
    return wire


def _from_wire(wire: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if like.is_complex():
        return torch.view_as_complex(wire) if not wire.is_complex() else wire
    return wire.to(like.dtype)


# ------------------------------------------------------------------ options / timeouts
def _timeout(ms: int) -> datetime.timedelta | None:
    return datetime.timedelta(milliseconds=ms) if ms is not None and ms >= 0 else None


def _opts(cls: Any, timeout_ms: int = -1, **fields: Any) -> Any:
    o = cls()
    for k, v in fields.items():
        setattr(o, k, v)
    t = _timeout(timeout_ms)
    if t is not None:
        o.timeout = t
    return o


# ------------------------------------------------------------------ agreement check
_SIG_HEAD = 24  # fixed part of a signature; split sizes follow (2 * world size)


def _describe(row: list[int]) -> str:
    _op, dt, ndim = row[0], row[1], row[2]
    name = str(_DTYPE_CODES[dt]).replace("torch.", "") if 0 <= dt < len(_DTYPE_CODES) else "?"
    shape = row[3 : 3 + min(ndim, 8)]
    extra = f", root {row[12]}" if row[12] >= 0 else ""
    extra += f", op {_OP_NAMES.get(row[13], row[13])}" if row[13] >= 0 else ""
    extra += f", {row[14]} tensors" if row[14] > 1 else ""
    return f"{name}{list(shape)}{extra}"


def _signature(
    st: _GroupState,
    code: int,
    t: torch.Tensor | None,
    *,
    root: int = -1,
    op: int = -1,
    count: int = 1,
    total: int = 0,
    splits: tuple[Sequence[int], Sequence[int]] | None = None,
    shape: Sequence[int] | None = None,
) -> list[int]:
    row = [0] * (_SIG_HEAD + 2 * st.size)
    row[0] = code
    if t is not None:
        dims = list(shape if shape is not None else t.shape)
        row[1] = _DTYPE_CODES.index(t.dtype) if t.dtype in _DTYPE_CODES else 99
        row[2] = len(dims)
        row[3 : 3 + min(len(dims), 8)] = dims[:8]
        row[11] = 1
        for d in dims:
            row[11] *= d
    else:
        row[1] = -1
    row[12], row[13], row[14], row[15] = root, op, count, total
    if splits is not None:
        ins, outs = splits
        row[_SIG_HEAD : _SIG_HEAD + st.size] = list(ins)
        row[_SIG_HEAD + st.size :] = list(outs)
    return row


_INLINE_BYTES = 4 * 1024  # payloads up to this size ride in the agreement check (same on every rank)
_INLINE_FLAG = 16  # signature slot: 1 when the caller put its payload in the check row


def _agree(st: _GroupState, name: str, row: list[int], timeout_ms: int = -1,
           payload: torch.Tensor | None = None) -> torch.Tensor | None:
    """All ranks compare signatures; all raise the same error when they differ.

    Every rank always sends a row of the same size (signature + `_INLINE_BYTES`), so a rank whose
    tensor is small can put its data in the row while another's is large, and the check still
    completes on every rank and reports the mismatch. When every rank inlined its `payload`
    (decided from signature fields only, so ranks that agree also agree on this), the gathered
    payloads are returned as a [world, nbytes] uint8 view of a reused buffer (read it before the
    next collective): the caller finishes the collective locally, one round trip in all.
    """
    if st.check is None:
        return None
    head = len(row)
    width = head + _INLINE_BYTES // 8
    if st.row is None or st.row.numel() != width:
        st.row = torch.zeros(width, dtype=torch.int64)
        st.rows = torch.empty(st.size * width, dtype=torch.int64)
    assert st.rows is not None
    nbytes = 0
    if payload is not None:
        raw = payload.reshape(-1).view(torch.uint8)
        nbytes = raw.numel()
        st.row[head:].view(torch.uint8)[:nbytes].copy_(raw)
        row[_INLINE_FLAG] = 1
    st.row[:head].copy_(torch.tensor(row, dtype=torch.int64))
    try:
        st.check._allgather_base(st.rows, st.row, _opts(c10d.AllgatherOptions, timeout_ms)).wait()
    except RuntimeError as e:
        raise RuntimeError(f"tpu_dist: {name} failed while ranks compared arguments "
                           f"(a rank may have died or called a different collective): {e}") from e
    gathered = st.rows.view(st.size, width)
    table = gathered[:, :head].tolist()
    ref = table[0]
    bad = [r for r in range(st.size) if table[r][:_SIG_HEAD] != ref[:_SIG_HEAD]]
    if ref[0] == _A2A_CODE and not bad:
        n = st.size
        for i in range(n):
            for j in range(n):
                sent = table[i][_SIG_HEAD + j]  # rank i sends to j
                recv = table[j][_SIG_HEAD + n + i]  # rank j expects from i
                if sent != recv:
                    raise RuntimeError(
                        f"tpu_dist: {name}: rank {i} sends {sent} rows to rank {j}, which expects "
                        f"{recv} (input_split_sizes / output_split_sizes disagree across ranks)"
                    )
    if bad:
        desc = "; ".join(f"rank {r}: {_describe(table[r])}" for r in range(st.size))
        raise RuntimeError(
            f"tpu_dist: {name} was called with different arguments across ranks ({desc}). "
            "Every rank must pass tensors of the same shape and dtype (and the same root/op)."
        )
    if payload is None:
        return None
    return gathered[:, head:].view(torch.uint8)[:, :nbytes]


_A2A_CODE = 13


# ------------------------------------------------------------------ completion
_Copies = list[tuple[torch.Tensor | None, Callable[[], torch.Tensor]]]


def _finish(work: Any, copies: _Copies, result: Any) -> Any:
    """A Work that completes after gloo's `work` and the host->device copies of the results."""
    return _chain([work], copies, result)


_waiter: Any = None


def _future_of(work: Any) -> torch.futures.Future:
    """gloo's future for `work`; for the few gloo works without one, a waiter thread's."""
    global _waiter
    try:
        return work.get_future()
    except RuntimeError:
        pass
    if _waiter is None:
        from concurrent.futures import ThreadPoolExecutor

        _waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tpu_dist_wait")
    fut: torch.futures.Future = torch.futures.Future()

    def wait() -> None:
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - handed to whoever waits on the future
            fut.set_exception(e)
            return
        fut.set_result(None)

    _waiter.submit(wait)
    return fut


def _chain(works: list[Any], copies: _Copies, result: Any) -> Any:
    if getattr(_mode, "inline", False):
        _mode.inline = False
        for w in works:
            w.wait()  # releases the GIL; raises gloo's error (peer died, timeout)
        with torch.no_grad():
            for dst, make in copies:
                v = make()
                if dst is not None:
                    dst.copy_(v)
        return _done_work(result)
    futs = [_future_of(w) for w in works]
    fut = futs[0] if len(futs) == 1 else torch.futures.collect_all(futs)

    def done(f: torch.futures.Future) -> Any:
        f.value()  # re-raises gloo's error (peer died, timeout)
        if len(futs) > 1:
            for x in f.value():
                x.value()
        with torch.no_grad():
            for dst, make in copies:
                v = make()
                if dst is not None:  # None: `make` finished the result in place (aliased buffer)
                    dst.copy_(v)
        return result

    return _record(c10d._create_work_from_future(fut.then(done))).boxed()


def _done_work(result: Any) -> Any:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(result)
    return _record(c10d._create_work_from_future(fut)).boxed()


def _record(work: Any) -> Any:
    """Remember `work` while a `_coalescing_manager(device=tpu)` block is open on this thread."""
    pending = getattr(_mode, "coalesced", None)
    if pending is not None:
        pending.append(work)
    return work


# ------------------------------------------------------------------ kernels
def _allreduce(tensors: list[torch.Tensor], pg: Any, reduce_op: Any, sparse: Any, async_op: bool = True,
               timeout: int = -1) -> tuple[list[torch.Tensor], Any]:
    st = _state(pg, async_op)
    op = int(reduce_op.op())
    if sparse is not None:
        raise RuntimeError("tpu_dist: sparse all_reduce is not supported")
    row = _signature(st, 1, tensors[0], op=op, count=len(tensors))
    if st.check is not None and len(tensors) == 1 and _inline_ok(tensors[0], op):
        return tensors, _allreduce_inline(st, tensors[0], op, reduce_op, row, timeout)
    _agree(st, "all_reduce", row, timeout)
    return tensors, _reduce_many(st, tensors, op, reduce_op, timeout, lambda g, ws, o: g.allreduce(ws, o))


_BITWISE = (int(_RED.BAND), int(_RED.BOR), int(_RED.BXOR))
_LOCAL_REDUCE: dict[int, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    int(_RED.SUM): torch.add, int(_RED.PRODUCT): torch.mul, int(_RED.MIN): torch.minimum,
    int(_RED.MAX): torch.maximum, int(_RED.BAND): torch.bitwise_and, int(_RED.BOR): torch.bitwise_or,
    int(_RED.BXOR): torch.bitwise_xor,
}


def _inline_ok(t: torch.Tensor, op: int) -> bool:
    """Small all_reduce done inside the agreement check. Depends only on signature fields."""
    if t.dtype not in _GLOO_DTYPES or t.numel() * t.element_size() > _INLINE_BYTES:
        return False
    if t.dtype == torch.bool:
        return op in (int(_RED.SUM), int(_RED.PRODUCT), int(_RED.MIN), int(_RED.MAX), *_BITWISE)
    if t.is_floating_point():
        return op not in _BITWISE
    return op != int(_RED.PREMUL_SUM)


def _inline_gather_ok(t: torch.Tensor) -> bool:
    """all_gather input small enough to travel in the agreement check (signature fields only)."""
    return t.dtype in _GLOO_DTYPES and t.numel() * t.element_size() <= _INLINE_BYTES


def _allreduce_inline(st: _GroupState, t: torch.Tensor, op: int, op_obj: Any, row: list[int],
                      timeout: int) -> Any:
    # The payloads travel with the signatures (one gloo round trip instead of two); every rank
    # reduces the gathered rows in rank order, so all ranks get bitwise-identical results.
    _mode.inline = False
    h = _host_in(t)
    if op == int(_RED.PREMUL_SUM):
        h = h * _premul_factor(op_obj).to(h.dtype)
    rows = _agree(st, "all_reduce", row, timeout, payload=h)
    assert rows is not None
    dtype = h.dtype
    fn = _LOCAL_REDUCE[int(_wire_op(h, op))]
    del h  # drop the read alias of t's buffer before writing t
    parts = rows.view(dtype)
    acc = fn(parts[0], parts[1])
    for r in range(2, st.size):
        acc = fn(acc, parts[r])
    acc = _post_reduce(acc, op, st.size)
    with torch.no_grad():
        t.copy_(acc.view(t.shape))
    return _done_work([t])


def _reduce_many(st: _GroupState, tensors: list[torch.Tensor], op: int, op_obj: Any, timeout: int,
                 launch: Callable[[Any, list[torch.Tensor], Any], Any], root: int | None = None) -> Any:
    # all_reduce in place on the aliased buffers (no copies); reduce may use its input as scratch.
    views = [_view(t, True) if root is None and not t.is_complex() else None for t in tensors]
    wires = [_pre_reduce(v if v is not None else _reduce_wire(_host(t), op), op, op_obj)
             for t, v in zip(tensors, views, strict=True)]
    gop = _wire_op(wires[0], op)
    if root is None:
        o = _opts(c10d.AllreduceOptions, timeout, reduceOp=gop)
    else:
        o = _opts(c10d.ReduceOptions, timeout, reduceOp=gop, rootRank=root, rootTensor=0)
    works = [launch(st.gloo, [w], o) for w in wires]
    if root is not None and root != st.rank:
        return _chain(works, [], tensors)
    copies: _Copies = []
    for t, w, v in zip(tensors, wires, views, strict=True):
        if v is not None:
            copies.append((None, lambda w=w: _post_reduce(w, op, st.size)))
        else:
            copies.append((t, lambda w=w, t=t: _from_wire(_post_reduce(w, op, st.size), t)))
    return _chain(works, copies, tensors)


def _allreduce_coalesced(tensors: list[torch.Tensor], pg: Any, reduce_op: Any, async_op: bool = True,
                         timeout: int = -1) -> Any:
    st = _state(pg, async_op)
    op = int(reduce_op.op())
    total = sum(t.numel() for t in tensors)
    _agree(st, "all_reduce_coalesced",
           _signature(st, 2, tensors[0] if tensors else None, op=op, count=len(tensors), total=total), timeout)
    if not tensors:
        return _done_work(tensors)
    return _reduce_many(st, tensors, op, reduce_op, timeout, lambda g, ws, o: g.allreduce(ws, o))


def _reduce(tensors: list[torch.Tensor], pg: Any, reduce_op: Any, root_rank: int, root_tensor: int,
            async_op: bool = True, timeout: int = -1) -> Any:
    st = _state(pg, async_op)
    op = int(reduce_op.op())
    _agree(st, "reduce", _signature(st, 3, tensors[0], op=op, root=root_rank), timeout)
    return _reduce_many(st, tensors, op, reduce_op, timeout, lambda g, ws, o: g.reduce(ws, o), root=root_rank)


def _broadcast(tensors: list[torch.Tensor], pg: Any, root_rank: int, root_tensor: int, async_op: bool = True,
               timeout: int = -1) -> tuple[list[torch.Tensor], Any]:
    st = _state(pg, async_op)
    _agree(st, "broadcast", _signature(st, 4, tensors[0], root=root_rank, count=len(tensors)), timeout)
    views = [_view(t, root_rank != st.rank) for t in tensors]  # receivers write in place
    hosts = [v if v is not None else _host(t) for t, v in zip(tensors, views, strict=True)]
    wires = [_bytes(h) for h in hosts]
    o = _opts(c10d.BroadcastOptions, timeout, rootRank=root_rank, rootTensor=root_tensor)
    work = st.gloo.broadcast(wires, o)
    copies: _Copies = [] if root_rank == st.rank else [
        (t, (lambda w=w, h=h: _unbytes(w, h))) for t, w, h, v in zip(tensors, wires, hosts, views, strict=True)
        if v is None]
    return tensors, _finish(work, copies, tensors)


def _allgather(outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], pg: Any, async_op: bool = True,
               timeout: int = -1) -> tuple[list[list[torch.Tensor]], Any]:
    st = _state(pg, async_op)
    inp = inputs[0]
    _agree(st, "all_gather", _signature(st, 5, inp), timeout)
    for o in outputs[0]:
        if o.shape != inp.shape or o.dtype != inp.dtype:
            raise RuntimeError(f"tpu_dist: all_gather output tensors must match the input "
                               f"({inp.dtype}{list(inp.shape)}), got {o.dtype}{list(o.shape)}")
    h = _bytes(_host_in(inp))
    outs = [torch.empty_like(h) for _ in outputs[0]]
    work = st.gloo.allgather([outs], [h], _opts(c10d.AllgatherOptions, timeout))
    copies = [(t, (lambda w=w, t=t: _unbytes(w, t))) for t, w in zip(outputs[0], outs, strict=True)]
    return outputs, _finish(work, copies, outputs)


def _allgather_base(output: torch.Tensor, inp: torch.Tensor, pg: Any, async_op: bool = True,
                    timeout: int = -1) -> tuple[torch.Tensor, Any]:
    st = _state(pg, async_op)
    row = _signature(st, 6, inp)
    small = st.check is not None and _inline_gather_ok(inp)
    rows = _agree(st, "all_gather_into_tensor", row, timeout, payload=_host_in(inp) if small else None)
    if output.numel() != inp.numel() * st.size or output.dtype != inp.dtype:
        raise RuntimeError(
            f"tpu_dist: all_gather_into_tensor needs an output of {inp.numel() * st.size} "
            f"{inp.dtype} elements (world size x input), got {output.dtype}{list(output.shape)}")
    if rows is not None:  # the inputs came with the signatures
        _mode.inline = False
        with torch.no_grad():
            output.copy_(rows.reshape(-1).view(inp.dtype).view(output.shape))
        return output, _done_work(output)
    h = _bytes(_host_in(inp))
    out = h.new_empty((h.numel() * st.size,))
    work = st.gloo._allgather_base(out, h.reshape(-1), _opts(c10d.AllgatherOptions, timeout))
    return output, _finish(work, [(output, lambda: _unbytes(out, output).reshape(output.shape))], output)


def _allgather_coalesced(output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], pg: Any,
                         async_op: bool = True) -> Any:
    st = _state(pg, async_op)
    _agree(st, "all_gather_coalesced", _signature(st, 7, inputs[0] if inputs else None, count=len(inputs),
                                                  total=sum(t.numel() for t in inputs)))
    works, copies = [], []
    for i, inp in enumerate(inputs):
        h = _bytes(_host(inp))
        outs = [torch.empty_like(h) for _ in range(st.size)]
        works.append(st.gloo.allgather([outs], [h], c10d.AllgatherOptions()))
        copies += [(output_lists[r][i], (lambda w=outs[r], t=inp: _unbytes(w, t))) for r in range(st.size)]
    return _chain(works, copies, output_lists) if works else _done_work(output_lists)


def _allgather_into_tensor_coalesced(outputs: list[torch.Tensor], inputs: list[torch.Tensor], pg: Any,
                                     async_op: bool = True) -> Any:
    st = _state(pg, async_op)
    _agree(st, "all_gather_into_tensor_coalesced",
           _signature(st, 8, inputs[0] if inputs else None, count=len(inputs),
                      total=sum(t.numel() for t in inputs)))
    works, copies = [], []
    for out_t, inp in zip(outputs, inputs, strict=True):
        h = _bytes(_host(inp))
        out = h.new_empty((h.numel() * st.size,))
        works.append(st.gloo._allgather_base(out, h.reshape(-1), c10d.AllgatherOptions()))
        copies.append((out_t, (lambda out=out, t=out_t: _unbytes(out, t).reshape(t.shape))))
    return _chain(works, copies, outputs) if works else _done_work(outputs)


def _reduce_scatter_base(output: torch.Tensor, inp: torch.Tensor, pg: Any, reduce_op: Any,
                         async_op: bool = True, timeout: int = -1) -> tuple[torch.Tensor, Any]:
    st = _state(pg, async_op)
    op = int(reduce_op.op())
    _agree(st, "reduce_scatter_tensor", _signature(st, 9, inp, op=op), timeout)
    if inp.numel() != output.numel() * st.size or output.dtype != inp.dtype:
        raise RuntimeError(
            f"tpu_dist: reduce_scatter_tensor needs an input of {output.numel() * st.size} "
            f"{output.dtype} elements (world size x output), got {inp.dtype}{list(inp.shape)}")
    return output, _rs_flat(st, [output], [inp], op, reduce_op, timeout)


def _rs_flat(st: _GroupState, outputs: list[torch.Tensor], inputs: list[torch.Tensor], op: int, op_obj: Any,
             timeout: int) -> Any:
    works, copies = [], []
    for out_t, inp in zip(outputs, inputs, strict=True):
        w_in = _pre_reduce(_reduce_wire(_host(inp).reshape(-1), op), op, op_obj)
        w_out = w_in.new_empty((w_in.shape[0] // st.size, *w_in.shape[1:]))
        o = _opts(c10d.ReduceScatterOptions, timeout, reduceOp=_wire_op(w_in, op))
        works.append(st.gloo._reduce_scatter_base(w_out, w_in, o))
        copies.append((out_t, (lambda w=w_out, t=out_t: _from_wire(_post_reduce(w, op, st.size), t).reshape(t.shape))))
    return _chain(works, copies, outputs) if works else _done_work(outputs)


def _reduce_scatter_tensor_coalesced(outputs: list[torch.Tensor], inputs: list[torch.Tensor], pg: Any,
                                     reduce_op: Any, async_op: bool = True, timeout: int = -1) -> Any:
    st = _state(pg, async_op)
    op = int(reduce_op.op())
    _agree(st, "reduce_scatter_tensor_coalesced",
           _signature(st, 10, inputs[0] if inputs else None, op=op, count=len(inputs),
                      total=sum(t.numel() for t in inputs)), timeout)
    return _rs_flat(st, outputs, inputs, op, reduce_op, timeout)


def _reduce_scatter(outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], pg: Any, reduce_op: Any,
                    async_op: bool = True, timeout: int = -1) -> tuple[list[torch.Tensor], Any]:
    st = _state(pg, async_op)
    op = int(reduce_op.op())
    out = outputs[0]
    _agree(st, "reduce_scatter", _signature(st, 11, out, op=op), timeout)
    flat = torch.cat([_host(t).reshape(-1) for t in input_lists[0]])
    w_in = _pre_reduce(_reduce_wire(flat, op), op, reduce_op)
    w_out = w_in.new_empty((out.numel(), *w_in.shape[1:]))
    o = _opts(c10d.ReduceScatterOptions, timeout, reduceOp=_wire_op(w_in, op))
    work = st.gloo._reduce_scatter_base(w_out, w_in, o)
    copies = [(out, lambda: _from_wire(_post_reduce(w_out, op, st.size), out).reshape(out.shape))]
    return outputs, _finish(work, copies, outputs)


def _a2a_base(output: torch.Tensor, inp: torch.Tensor, pg: Any, out_splits: list[int], in_splits: list[int],
              async_op: bool = True, timeout: int = -1) -> Any:
    st = _state(pg, async_op)
    n = st.size
    rows_in = list(in_splits) if in_splits else [inp.shape[0] // n] * n
    rows_out = list(out_splits) if out_splits else [output.shape[0] // n] * n
    _agree(st, "all_to_all_single",
           _signature(st, _A2A_CODE, inp, shape=list(inp.shape[1:]), splits=(rows_in, rows_out)), timeout)
    if sum(rows_in) != inp.shape[0] or sum(rows_out) != output.shape[0]:
        raise RuntimeError(f"tpu_dist: all_to_all_single split sizes {rows_in} / {rows_out} do not add up to "
                           f"the input/output first dimensions {inp.shape[0]} / {output.shape[0]}")
    row_in = inp[0].numel() if inp.dim() else 1
    h = _bytes(_host_in(inp))
    per = h.numel() // max(inp.numel(), 1) if inp.numel() else 1  # wire elements per tensor element
    out = h.new_empty((output.numel() * per,))
    work = st.gloo.alltoall_base(out, h.reshape(-1), [r * row_in * per for r in rows_out],
                                 [r * row_in * per for r in rows_in], _opts(c10d.AllToAllOptions, timeout))
    return _finish(work, [(output, lambda: _unbytes(out, output).reshape(output.shape))], output)


def _alltoall(outputs: list[torch.Tensor], inputs: list[torch.Tensor], pg: Any, async_op: bool = True,
              timeout: int = -1) -> tuple[list[torch.Tensor], Any]:
    st = _state(pg, async_op)
    dt = inputs[0].dtype
    _agree(st, "all_to_all", _signature(st, _A2A_CODE, inputs[0], shape=[],
                                        splits=([t.numel() for t in inputs], [t.numel() for t in outputs])), timeout)
    flat = torch.cat([_host(t).reshape(-1) for t in inputs]) if inputs else torch.empty(0, dtype=dt)
    h = _bytes(flat)
    per = h.numel() // max(flat.numel(), 1) if flat.numel() else 1
    out = h.new_empty((sum(t.numel() for t in outputs) * per,))
    work = st.gloo.alltoall_base(out, h, [t.numel() * per for t in outputs], [t.numel() * per for t in inputs],
                                 _opts(c10d.AllToAllOptions, timeout))
    copies = []
    off = 0
    for t in outputs:
        k = t.numel() * per
        copies.append((t, (lambda a=off, k=k, t=t: _unbytes(out[a:a + k], t).reshape(t.shape))))
        off += k
    return outputs, _finish(work, copies, outputs)


def _gather(output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], pg: Any, root_rank: int,
            async_op: bool = True, timeout: int = -1) -> Any:
    st = _state(pg, async_op)
    inp = inputs[0]
    _agree(st, "gather", _signature(st, 14, inp, root=root_rank), timeout)
    h = _bytes(_host(inp))
    outs = [torch.empty_like(h) for _ in range(st.size)] if st.rank == root_rank else []
    work = st.gloo.gather([outs] if outs else [], [h], _opts(c10d.GatherOptions, timeout, rootRank=root_rank))
    copies = [(t, (lambda w=w, t=t: _unbytes(w, t))) for t, w in zip(output_lists[0], outs, strict=True)] if outs else []
    return _finish(work, copies, output_lists)


def _scatter(outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], pg: Any, root_rank: int,
             async_op: bool = True, timeout: int = -1) -> tuple[list[torch.Tensor], Any]:
    st = _state(pg, async_op)
    out = outputs[0]
    _agree(st, "scatter", _signature(st, 15, out, root=root_rank), timeout)
    ins = [_bytes(_host(t)) for t in input_lists[0]] if st.rank == root_rank else []
    w_out = _bytes(torch.empty(out.shape, dtype=out.dtype))
    work = st.gloo.scatter([w_out], [ins] if ins else [], _opts(c10d.ScatterOptions, timeout, rootRank=root_rank))
    return outputs, _finish(work, [(out, lambda: _unbytes(w_out, out))], outputs)


def _send(tensors: list[torch.Tensor], pg: Any, dst: int, tag: int) -> Any:
    st = _state(pg)
    hosts = [_bytes(_host_in(t)) for t in tensors]
    work = st.gloo.send(hosts, dst, tag)
    return _finish(work, [], tensors)


def _recv(tensors: list[torch.Tensor], pg: Any, src: int, tag: int) -> Any:
    st = _state(pg)
    bufs = [_bytes(torch.empty(t.shape, dtype=t.dtype)) for t in tensors]
    work = st.gloo.recv(bufs, src, tag)
    return _finish(work, [(t, (lambda b=b, t=t: _unbytes(b, t).reshape(t.shape))) for t, b in zip(tensors, bufs, strict=True)],
                   tensors)


def _recv_any(tensors: list[torch.Tensor], pg: Any, tag: int) -> Any:
    st = _state(pg)
    bufs = [_bytes(torch.empty(t.shape, dtype=t.dtype)) for t in tensors]
    work = st.gloo.recv_anysource(bufs, tag)
    return _finish(work, [(t, (lambda b=b, t=t: _unbytes(b, t).reshape(t.shape))) for t, b in zip(tensors, bufs, strict=True)],
                   tensors)


def _barrier(tensor: torch.Tensor, pg: Any, device_ids: list[int], async_op: bool = True,
             timeout: int = -1) -> Any:
    st = _state(pg, async_op)
    return st.gloo.barrier(_opts(c10d.BarrierOptions, timeout)).boxed()


_KERNELS: dict[str, Callable[..., Any]] = {
    "allreduce_": _allreduce,
    "allreduce_coalesced_": _allreduce_coalesced,
    "reduce_": _reduce,
    "broadcast_": _broadcast,
    "allgather_": _allgather,
    "_allgather_base_": _allgather_base,
    "allgather_coalesced_": _allgather_coalesced,
    "allgather_into_tensor_coalesced_": _allgather_into_tensor_coalesced,
    "reduce_scatter_": _reduce_scatter,
    "_reduce_scatter_base_": _reduce_scatter_base,
    "reduce_scatter_tensor_coalesced_": _reduce_scatter_tensor_coalesced,
    "alltoall_": _alltoall,
    "alltoall_base_": _a2a_base,
    "gather_": _gather,
    "scatter_": _scatter,
    "send": _send,
    "recv_": _recv,
    "recv_any_source_": _recv_any,
    "barrier": _barrier,
}


def install_kernels() -> None:
    """Route the c10d collective ops for tpu tensors to the kernels above (once per process)."""
    global _kernels
    with _lock:
        if _kernels is not None:
            return
        lib = torch.library.Library("c10d", "IMPL")
        with warnings.catch_warnings():
            # c10d registers PrivateUse1 kernels that hand tpu tensors to the backend as-is.
            warnings.simplefilter("ignore")
            for name, fn in _KERNELS.items():
                lib.impl(name, fn, "PrivateUse1")
        _kernels = lib


_NO_CPU = "No backend type associated with device type cpu"
_CPU_HINT = (
    "tpu_dist: this process group has no backend for CPU tensors: 'tpu_dist' (and 'tpu') run "
    "collectives on tpu tensors only. Move the tensor with .to('tpu'), or create the group with "
    "init_process_group('cpu:gloo,tpu:tpu_dist') so CPU tensors use gloo"
)


def _install_cpu_hint() -> None:
    """Say which backend to use when a CPU tensor reaches a group that only has tpu_dist.

    c10d raises that error in C++ (ProcessGroup::getBackend, before any backend code runs), so
    it is rewritten on its way out: every public collective of torch.distributed is wrapped by
    c10d's `_exception_logger`, which calls `c10d_logger._get_msg_dict` only while handling an
    exception. We wrap that helper; the success path of every collective is untouched.
    """
    import sys

    from torch.distributed import c10d_logger

    orig = c10d_logger._get_msg_dict
    if getattr(orig, "_tpu_dist", False):
        return

    def get_msg_dict(func_name: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        err = sys.exc_info()[1]
        if isinstance(err, RuntimeError) and _NO_CPU in str(err) and _states:
            raise RuntimeError(f"{_CPU_HINT} ({func_name}: {err})") from err
        return orig(func_name, *args, **kwargs)

    get_msg_dict._tpu_dist = True  # type: ignore[attr-defined]
    c10d_logger._get_msg_dict = get_msg_dict


def _ours(pg: Any, device: Any) -> bool:
    if torch.device(device).type != "tpu":
        return False
    try:
        return id(pg._get_backend(torch.device("tpu"))) in _states
    except RuntimeError:
        return False


def _install_coalescing() -> None:
    """`dist._coalescing_manager(group, device=tpu)`: gloo has no start/endCoalescing.

    The collectives inside the block run as they are called (all_reduce / all_gather_into_tensor /
    reduce_scatter_tensor are captured by the manager and sent as one coalesced call); the Work
    returned at the end completes when every collective issued in the block has.
    """
    pg_cls = dist.ProcessGroup
    start, end = pg_cls._start_coalescing, pg_cls._end_coalescing
    if getattr(start, "_tpu_dist", False):
        return

    def start_coalescing(self: Any, device: Any) -> None:
        if not _ours(self, device):
            return start(self, device)
        if getattr(_mode, "coalesced", None) is not None:
            raise RuntimeError("tpu_dist: a coalescing block is already open on this thread")
        _mode.coalesced = []
        return None

    def end_coalescing(self: Any, device: Any) -> Any:
        if not _ours(self, device):
            return end(self, device)
        works = getattr(_mode, "coalesced", None) or []
        _mode.coalesced = None
        if not works:
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(None)
            return c10d._create_work_from_future(fut)
        return c10d._create_work_from_future(torch.futures.collect_all([w.get_future() for w in works]))

    start_coalescing._tpu_dist = True  # type: ignore[attr-defined]
    pg_cls._start_coalescing = start_coalescing
    pg_cls._end_coalescing = end_coalescing


def register() -> None:
    """Register 'tpu_dist' and 'tpu' as c10d backends for device 'tpu' (idempotent)."""
    for name in BACKEND_NAMES:
        if name.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(name, _create, devices=["tpu"])
    _install_cpu_hint()
    _install_coalescing()
