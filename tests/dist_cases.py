"""Cases run by every rank of a tests/dist_pool.Pool (see dist_worker.py).

Each case computes on tpu with the `tpu_dist` backend and checks the result against PyTorch
on the CPU; inputs are deterministic functions of the rank, so each rank can build every
rank's input for the reference.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

CASES: dict[str, Callable[[], Any]] = {}
TPU = torch.device("tpu")


def case(fn: Callable[[], Any]) -> Callable[[], Any]:
    CASES[fn.__name__] = fn
    return fn


def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


def same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.device.type == "tpu", f"{what}: result left the device ({actual.device})"
    got = actual.cpu()
    tol = 0.0  # integers and bools: exact
    if expected.is_floating_point():
        tol = 1e-2 if expected.dtype in (torch.float16, torch.bfloat16) else 1e-5
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------ collectives x dtypes
DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}


def data(r: int, dt: torch.dtype, n: int = 12) -> torch.Tensor:
    """Rank r's input (CPU): small values so sums/products stay exact in every dtype."""
    base = torch.arange(n) % 5 + r
    if dt == torch.bool:
        return (torch.arange(n) % (r + 2)) == 0
    if dt.is_floating_point:
        return (base.to(torch.float32) / 2).to(dt)
    return base.to(dt)


def _ops(dt: torch.dtype) -> list[str]:
    if dt == torch.bool:
        return ["SUM", "MAX", "MIN", "PRODUCT"]
    if dt.is_floating_point:
        return ["SUM", "AVG", "MAX", "MIN", "PRODUCT", "PREMUL_SUM"]
    return ["SUM", "MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR"]


def _reduce_ref(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    dt = xs[0].dtype
    if dt == torch.bool:
        stack = torch.stack(xs)
        return stack.any(0) if op in ("SUM", "MAX") else stack.all(0)
    acc = xs[0].clone()
    for x in xs[1:]:
        if op in ("SUM", "AVG"):
            acc = acc + x
        elif op == "PREMUL_SUM":
            acc = acc + x
        elif op == "MAX":
            acc = torch.maximum(acc, x)
        elif op == "MIN":
            acc = torch.minimum(acc, x)
        elif op == "PRODUCT":
            acc = acc * x
        elif op == "BAND":
            acc = acc & x
        elif op == "BOR":
            acc = acc | x
        elif op == "BXOR":
            acc = acc ^ x
    if op == "AVG":
        acc = acc / len(xs)
    if op == "PREMUL_SUM":
        acc = sum(x * 2 for x in xs)
    return acc.to(dt)


def _red(op: str) -> Any:
    return dist._make_nccl_premul_sum(2.0) if op == "PREMUL_SUM" else getattr(dist.ReduceOp, op)


def _collectives(dt: torch.dtype) -> dict[str, Callable[[], None]]:
    r, n = rank(), world()
    xs = [data(i, dt) for i in range(n)]
    x = xs[r].to(TPU)
    checks: dict[str, Callable[[], None]] = {}

    def all_reduce() -> None:
        for op in _ops(dt):
            y = x.clone()
            dist.all_reduce(y, op=_red(op))
            same(y, _reduce_ref(xs, op), f"all_reduce {op}")

    def broadcast() -> None:
        y = x.clone()
        dist.broadcast(y, src=n - 1)
        same(y, xs[n - 1], "broadcast")

    def reduce() -> None:
        y = x.clone()
        dist.reduce(y, dst=0, op=dist.ReduceOp.MAX)
        same(y, _reduce_ref(xs, "MAX") if r == 0 else xs[r], "reduce")

    def all_gather() -> None:
        outs = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(outs, x)
        for i in range(n):
            same(outs[i], xs[i], "all_gather")
        out = torch.empty((n * x.numel(),), dtype=dt, device=TPU)
        dist.all_gather_into_tensor(out, x)
        same(out, torch.cat(xs), "all_gather_into_tensor")

    def reduce_scatter() -> None:
        op = "MAX" if dt == torch.bool else "SUM"
        out = torch.empty((x.numel() // n,), dtype=dt, device=TPU)
        dist.reduce_scatter_tensor(out, x, op=_red(op))
        same(out, _reduce_ref(xs, op).chunk(n)[r], "reduce_scatter_tensor")
        out2 = torch.empty_like(out)
        dist.reduce_scatter(out2, list(x.chunk(n)), op=_red(op))
        same(out2, _reduce_ref(xs, op).chunk(n)[r], "reduce_scatter")

    def all_to_all() -> None:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        same(out, torch.cat([xs[i].chunk(n)[r] for i in range(n)]), "all_to_all_single")
        # uneven: rank i sends (j + 1) * (i + 1) elements to rank j
        ins = [(j + 1) * (r + 1) for j in range(n)]
        outs = [(r + 1) * (i + 1) for i in range(n)]
        src = [data(i, dt, sum((j + 1) * (i + 1) for j in range(n))) for i in range(n)]
        y = torch.empty((sum(outs),), dtype=dt, device=TPU)
        dist.all_to_all_single(y, src[r].to(TPU), output_split_sizes=outs, input_split_sizes=ins)
        expect = torch.cat([src[i].split([(j + 1) * (i + 1) for j in range(n)])[r] for i in range(n)])
        same(y, expect, "all_to_all_single uneven")
        lst = [torch.empty(2, 3, dtype=dt, device=TPU) for _ in range(n)]
        dist.all_to_all(lst, [data(r * n + j, dt, 6).reshape(2, 3).to(TPU) for j in range(n)])
        for i in range(n):
            same(lst[i], data(i * n + r, dt, 6).reshape(2, 3), "all_to_all")

    def gather_scatter() -> None:
        outs = [torch.empty_like(x) for _ in range(n)] if r == 0 else None
        dist.gather(x, outs, dst=0)
        if r == 0:
            for i in range(n):
                same(outs[i], xs[i], "gather")
        y = torch.empty_like(x)
        dist.scatter(y, [xs[i].to(TPU) for i in range(n)] if r == 1 else None, src=1)
        same(y, xs[r], "scatter")

    def send_recv() -> None:
        nxt, prv = (r + 1) % n, (r - 1) % n
        y = torch.empty_like(x)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, y, prv)])
        for q in reqs:
            q.wait()
        same(y, xs[prv], "batch_isend_irecv")
        if r == 0:
            dist.send(x, dst=1)
        elif r == 1:
            z = torch.empty_like(x)
            dist.recv(z, src=0)
            same(z, xs[0], "send/recv")

    def coalesced() -> None:
        ys = [x.clone(), (x[:5]).clone()]
        op = "MAX" if dt == torch.bool else "SUM"
        dist.all_reduce_coalesced(ys, op=_red(op))
        ref = _reduce_ref(xs, op)
        same(ys[0], ref, "all_reduce_coalesced[0]")
        same(ys[1], ref[:5], "all_reduce_coalesced[1]")
        outs = [torch.empty((n * x.numel(),), dtype=dt, device=TPU) for _ in range(2)]
        with dist._coalescing_manager():
            for o in outs:
                dist.all_gather_into_tensor(o, x)
        for o in outs:
            same(o, torch.cat(xs), "all_gather_into_tensor (coalesced)")
        ys = [x.clone(), x.clone()]
        with dist._coalescing_manager(device=torch.device(TPU), async_ops=True) as cm:
            for y in ys:
                dist.all_reduce(y, op=_red(op))
        cm.wait()
        for y in ys:
            same(y, ref, "all_reduce in _coalescing_manager(device=tpu)")

    def async_work() -> None:
        y = x.clone()
        w = dist.all_reduce(y, op=_red("MAX"), async_op=True)
        fut = w.get_future()
        w.wait()
        assert w.is_completed()
        assert fut.done() and fut.value()[0].device.type == "tpu"
        same(y, _reduce_ref(xs, "MAX"), "async all_reduce")

    for f in (all_reduce, broadcast, reduce, all_gather, reduce_scatter, all_to_all, gather_scatter, send_recv,
              coalesced, async_work):
        checks[f.__name__] = f
    return checks


@case
def collective_matrix() -> dict[str, dict[str, str]]:
    """collective x dtype: 'ok' or the error, every cell checked against the CPU."""
    table: dict[str, dict[str, str]] = {}
    for name, dt in DTYPES.items():
        for coll, fn in _collectives(dt).items():
            try:
                fn()
                table.setdefault(coll, {})[name] = "ok"
            except Exception as e:  # noqa: BLE001 - the table reports it; the test fails on it
                table.setdefault(coll, {})[name] = f"{type(e).__name__}: {str(e)[:300]}"
            dist.barrier()
    return table


@case
def functional_collectives() -> str:
    import torch.distributed._functional_collectives as fc

    r, n = rank(), world()
    xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    x = xs[r].to(TPU)
    g = dist.group.WORLD
    same(fc.all_reduce(x, "sum", g), sum(xs), "fc.all_reduce")
    same(fc.all_gather_tensor(x, 0, g), torch.cat(xs), "fc.all_gather_tensor")
    same(fc.reduce_scatter_tensor(x, "sum", 0, g), sum(xs).chunk(n)[r], "fc.reduce_scatter_tensor")
    same(fc.all_to_all_single(x, None, None, g), torch.cat([xi.chunk(n)[r] for xi in xs]), "fc.all_to_all_single")
    same(fc.broadcast(x, 0, g), xs[0], "fc.broadcast")
    outs = fc.all_reduce_coalesced([x, x * 2], "max", g)
    same(outs[1], torch.stack(xs).amax(0) * 2, "fc.all_reduce_coalesced")
    # autograd variants (what DTensor's backward uses)
    xg = x.clone().requires_grad_()
    y = torch.ops._c10d_functional_autograd.all_gather_into_tensor(xg, n, g.group_name)
    y = torch.ops._c10d_functional.wait_tensor(y)
    (y * torch.arange(y.shape[0], device=TPU).unsqueeze(1)).sum().backward()
    w = torch.arange(n * 4, dtype=torch.float32).unsqueeze(1)
    same(xg.grad, (w.expand(-1, 6) * n).chunk(n)[r], "all_gather autograd backward")
    return "ok"


@case
def new_group_subgroups() -> list[int]:
    r, n = rank(), world()
    groups = [dist.new_group([i]) for i in range(n)]  # every rank joins every new_group call
    pair = dist.new_group(list(range(n)))
    x = torch.full((3,), float(r + 1), device=TPU)
    dist.all_reduce(x, group=groups[r])
    same(x, torch.full((3,), float(r + 1)), "single-rank subgroup")
    y = torch.full((3,), float(r + 1), device=TPU)
    dist.all_reduce(y, group=pair)
    same(y, torch.full((3,), float(sum(range(1, n + 1)))), "new_group all_reduce")
    return [dist.get_rank(pair), dist.get_world_size(pair)]


@case
def object_collectives() -> list[Any]:
    r, n = rank(), world()
    objs: list[Any] = [None] * n
    dist.all_gather_object(objs, {"rank": r})
    assert objs == [{"rank": i} for i in range(n)], objs
    lst = [f"from {r}"] if r == 0 else [None]
    dist.broadcast_object_list(lst, src=0)
    assert lst == ["from 0"], lst
    dist.barrier()
    return objs


@case
def mismatched_shapes() -> str:
    x = torch.ones(3 + rank(), device=TPU)
    try:
        dist.all_reduce(x)
    except RuntimeError as e:
        assert "different arguments across ranks" in str(e), e
        assert "rank 0: float32[3]" in str(e) and "rank 1: float32[4]" in str(e), e
        y = torch.ones(3, device=TPU)
        dist.all_reduce(y)  # the group still works after the error
        same(y, torch.full((3,), float(world())), "all_reduce after a mismatch")
        # Rank 0 small enough to ride in the agreement check, rank 1 not: still an error on both.
        z = torch.ones(4 if rank() == 0 else 1 << 16, device=TPU)
        try:
            dist.all_reduce(z)
        except RuntimeError as e2:
            assert "rank 0: float32[4]" in str(e2) and "rank 1: float32[65536]" in str(e2), e2
        else:
            raise AssertionError("small vs large all_reduce did not raise")
        dist.all_reduce(y)
        same(y, torch.full((3,), float(world() ** 2)), "all_reduce after a small/large mismatch")
        return str(e)
    raise AssertionError("mismatched shapes did not raise")


@case
def mismatched_dtypes() -> str:
    x = torch.ones(4, dtype=torch.float32 if rank() == 0 else torch.int32, device=TPU)
    out = torch.empty(4 * world(), dtype=x.dtype, device=TPU)
    try:
        dist.all_gather_into_tensor(out, x)
    except RuntimeError as e:
        assert "different arguments across ranks" in str(e) and "int32" in str(e), e
        return str(e)
    raise AssertionError("mismatched dtypes did not raise")


@case
def cpu_tensor_on_tpu_group() -> str:
    try:
        dist.all_reduce(torch.ones(3))
    except RuntimeError as e:
        assert "cpu:gloo,tpu:tpu_dist" in str(e) and ".to('tpu')" in str(e), e
        try:
            dist.broadcast(torch.ones(3), src=0)
        except RuntimeError as e2:
            assert "cpu:gloo,tpu:tpu_dist" in str(e2), e2
        else:
            raise AssertionError("a CPU broadcast on a tpu_dist group did not raise") from None
        x = torch.ones(3, device=TPU)
        dist.all_reduce(x)  # the group still works
        same(x, torch.full((3,), float(world())), "all_reduce after the CPU-tensor error")
        return str(e)
    raise AssertionError("a CPU tensor on a tpu_dist group did not raise")


@case
def process_model() -> dict[str, Any]:
    return {
        "device_count": torch.accelerator.device_count(),
        "current": torch.accelerator.current_device_index(),
        "backend": dist.get_backend(),
        "tpu_backend": dist.get_backend_config(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
    }


# ------------------------------------------------------------------ DTensor, TP, DDP, FSDP2, DCP
def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("tpu", (world(),))


@case
def dtensor_ops() -> str:
    from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor

    mesh = DeviceMesh("tpu", list(range(world())))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 6, generator=g), torch.randn(6, 4, generator=g)
    da = distribute_tensor(a.to(TPU), mesh, [Shard(0)])
    db = distribute_tensor(b.to(TPU), mesh, [Replicate()])
    assert da.to_local().shape == (8 // world(), 6)
    same(da.full_tensor(), a, "full_tensor")
    same((da @ db).full_tensor(), a @ b, "DTensor matmul")
    same(da.redistribute(mesh, [Shard(1)]).to_local(), a.chunk(world(), 1)[rank()], "redistribute S0->S1")
    same(da.redistribute(mesh, [Replicate()]).to_local(), a, "redistribute S0->R")
    same(da.sum().full_tensor(), a.sum(), "DTensor sum")
    ds = distribute_tensor(a.to(TPU), mesh, [Shard(1)])
    same((ds.relu() * 2 + 1).full_tensor(), a.relu() * 2 + 1, "DTensor pointwise")
    return "ok"


class _MLP(torch.nn.Module):
    def __init__(self, d: int = 8, h: int = 16) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, h)
        self.down = torch.nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(x))))


def _mlp(seed: int = 0) -> _MLP:
    torch.manual_seed(seed)
    return _MLP()


@case
def tensor_parallel_mlp() -> str:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = _mesh()
    ref = _mlp()
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(1))
    ref_out = ref(x)
    ref_out.sum().backward()
    tp = _mlp().to(TPU)
    parallelize_module(tp, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    assert tp.up.weight.to_local().shape == (16 // world(), 8)
    out = tp(x.to(TPU))
    same(out, ref_out.detach(), "TP forward")
    out.sum().backward()
    same(tp.up.weight.grad.full_tensor(), ref.up.weight.grad, "TP colwise weight grad")
    same(tp.down.weight.grad.full_tensor(), ref.down.weight.grad, "TP rowwise weight grad")
    # sequence parallel: norm on sequence shards, then col/row with sequence-sharded in/out
    from torch.distributed.tensor import Shard

    sp = _mlp().to(TPU)
    parallelize_module(sp, mesh, {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
    })
    out = sp(x.to(TPU))
    full = out.full_tensor() if hasattr(out, "full_tensor") else out
    same(full, ref_out.detach(), "SequenceParallel forward")
    return "ok"


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)) for _ in range(3)]


def _ref_losses(lr: float = 0.1) -> tuple[list[float], _MLP]:
    ref = _mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    losses = []
    for x, y in _batches():
        loss = torch.nn.functional.mse_loss(ref(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses, ref


@case
def ddp_training() -> list[float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ref_losses, ref = _ref_losses()
    model = DDP(_mlp().to(TPU))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in _batches():
        xs, ys = x.chunk(world())[rank()].to(TPU), y.chunk(world())[rank()].to(TPU)
        loss = torch.nn.functional.mse_loss(model(xs), ys)
        full = loss.detach().clone()
        dist.all_reduce(full, op=dist.ReduceOp.AVG)
        losses.append(full.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
    for (n, p), q in zip(model.module.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    return losses


def _fsdp_run(mp: bool) -> list[float]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if mp else {}
    model = _mlp().to(TPU)
    fully_shard(model.up, **kw)
    fully_shard(model.down, **kw)
    fully_shard(model, **kw)
    assert model.up.weight.to_local().shape[0] == 16 // world()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in _batches():
        xs, ys = x.chunk(world())[rank()].to(TPU), y.chunk(world())[rank()].to(TPU)
        loss = torch.nn.functional.mse_loss(model(xs).float(), ys)
        full = loss.detach().clone()
        dist.all_reduce(full, op=dist.ReduceOp.AVG)
        losses.append(full.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses


@case
def fsdp2_training() -> dict[str, list[float]]:
    ref_losses, _ = _ref_losses()
    fp32 = _fsdp_run(False)
    torch.testing.assert_close(torch.tensor(fp32), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
    bf16 = _fsdp_run(True)
    torch.testing.assert_close(torch.tensor(bf16), torch.tensor(ref_losses), rtol=3e-2, atol=3e-2)
    return {"single_process": ref_losses, "fsdp2": fp32, "fsdp2_bf16": bf16}


def _shared_tmpdir() -> str:
    import tempfile

    path = [tempfile.mkdtemp(prefix="tpu_dist_") if rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return str(path[0])


@case
def dcp_save_load() -> str:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    path = _shared_tmpdir()
    model = _mlp(seed=3).to(TPU)
    fully_shard(model)
    sd = {k: v for k, v in model.state_dict().items()}
    dcp.save(sd, checkpoint_id=path)
    other = _mlp(seed=4).to(TPU)
    fully_shard(other)
    sd2 = other.state_dict()
    dcp.load(sd2, checkpoint_id=path)
    other.load_state_dict(sd2)
    ref = _mlp(seed=3)
    for (n, p), q in zip(other.named_parameters(), ref.parameters(), strict=True):
        same(p.full_tensor(), q.detach(), f"DCP {n}")
    dist.barrier()
    if rank() == 0:
        import shutil

        shutil.rmtree(path, ignore_errors=True)
    return "ok"


# ------------------------------------------------------------------ Hugging Face tp_plan="auto"
def _hf_config(kind: str) -> Any:
    import transformers as tf

    # KV heads must divide by the TP degree: 2 (GQA) on 2 processes, 4 on 4.
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=max(2, world()), max_position_embeddings=64)
    if kind == "llama":
        return tf.LlamaConfig(intermediate_size=128, **common)
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                 num_experts_per_tok=2, head_dim=16, decoder_sparse_step=1, **common)
    if kind == "mixtral":
        return tf.MixtralConfig(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, **common)
    raise ValueError(kind)


_HF_DIR: dict[str, str] = {}


def _hf_saved(kind: str) -> str:
    """Rank 0 builds the model from its config (seeded) and saves it; every rank gets the path."""
    if kind not in _HF_DIR:
        from transformers import AutoModelForCausalLM

        path = _shared_tmpdir()
        if rank() == 0:
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(_hf_config(kind)).save_pretrained(path)
        dist.barrier()
        _HF_DIR[kind] = path
    return _HF_DIR[kind]


def _param_bytes(model: torch.nn.Module) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def _hf_tp(kind: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    path = _hf_saved(kind)
    tp = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"))
    assert tp.device.type == "tpu", tp.device
    ref = AutoModelForCausalLM.from_pretrained(path).to(TPU)
    ids = torch.tensor([[1, 5, 9, 3, 7, 11]], device=TPU)
    with torch.no_grad():
        lt, lr = tp(ids).logits, ref(ids).logits
    diff = (lt.cpu() - lr.cpu()).abs().max().item()
    torch.testing.assert_close(lt.cpu(), lr.cpu(), rtol=1e-4, atol=1e-4)
    gt = tp.generate(ids, max_new_tokens=6, do_sample=False).cpu().tolist()
    gr = ref.generate(ids, max_new_tokens=6, do_sample=False).cpu().tolist()
    assert gt == gr, (gt, gr)
    sharded = sum(1 for p in tp.parameters() if hasattr(p, "to_local") and p.to_local().shape != p.shape)
    assert sharded > 0, "no parameter is sharded"
    return {"max_logit_diff": diff, "tokens_equal": gt == gr, "tokens": gt[0],
            "bytes_per_process": _param_bytes(tp), "bytes_full": _param_bytes(ref), "sharded_params": sharded}


@case
def hf_tp_llama() -> dict[str, Any]:
    return _hf_tp("llama")


@case
def hf_tp_qwen3_moe() -> dict[str, Any]:
    return _hf_tp("qwen3_moe")


@case
def hf_tp_mixtral() -> dict[str, Any]:
    return _hf_tp("mixtral")


# ------------------------------------------------------------------ Diffusers TensorParallelConfig
def _tiny_flux() -> Any:
    import diffusers

    torch.manual_seed(0)
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(2, 2, 4), guidance_embeds=True)


def _flux_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.zeros(4, 4, 3)
    ids[..., 1] = torch.arange(4)[:, None]
    ids[..., 2] = torch.arange(4)[None, :]
    return {"hidden_states": torch.randn(2, 16, 8, generator=g),
            "encoder_hidden_states": torch.randn(2, 7, 32, generator=g),
            "pooled_projections": torch.randn(2, 16, generator=g),
            "timestep": torch.tensor([0.1, 0.7]), "guidance": torch.tensor([3.5, 3.5]),
            "img_ids": ids.reshape(16, 3), "txt_ids": torch.zeros(7, 3)}


@case
def diffusers_tp_flux() -> dict[str, Any]:
    from diffusers import FluxTransformer2DModel
    from diffusers.models._modeling_parallel import TensorParallelConfig

    batch = {k: v.to(TPU) for k, v in _flux_batch().items()}
    ref = _tiny_flux().to(TPU)
    with torch.no_grad():
        expect = ref(**batch).sample.cpu()
    # enable_parallelism on a model in memory
    tp = _tiny_flux().to(TPU)
    tp.enable_parallelism(config=TensorParallelConfig(tp_degree=world()))
    with torch.no_grad():
        got = tp(**batch).sample
    same(got, expect, "Flux enable_parallelism")
    # from_pretrained(..., parallel_config=...) shards while reading the checkpoint
    path = _shared_tmpdir()
    if rank() == 0:
        _tiny_flux().save_pretrained(path)
    dist.barrier()
    loaded = FluxTransformer2DModel.from_pretrained(path, parallel_config=TensorParallelConfig(tp_degree=world()))
    loaded = loaded.to(TPU)
    with torch.no_grad():
        got2 = loaded(**batch).sample
    same(got2, expect, "Flux from_pretrained(parallel_config)")
    return {"max_diff_enable": (got.cpu() - expect).abs().max().item(),
            "max_diff_from_pretrained": (got2.cpu() - expect).abs().max().item(),
            "bytes_per_process": _param_bytes(tp), "bytes_full": _param_bytes(ref)}


def _flux_pipe(parallel: bool) -> Any:
    import diffusers
    from diffusers.models._modeling_parallel import TensorParallelConfig

    torch.manual_seed(1)
    vae = diffusers.AutoencoderKL(in_channels=3, out_channels=3, latent_channels=2, block_out_channels=(8,),
                                  down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
                                  norm_num_groups=4, layers_per_block=1, shift_factor=0.1, scaling_factor=0.5)
    pipe = diffusers.FluxPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
                                  tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=_tiny_flux())
    pipe.set_progress_bar_config(disable=True)
    pipe.to("tpu")
    if parallel:
        pipe.transformer.enable_parallelism(config=TensorParallelConfig(tp_degree=world()))
    return pipe


@case
def diffusers_tp_flux_pipeline() -> float:
    g = torch.Generator().manual_seed(4)
    embeds = torch.randn(1, 7, 32, generator=g)
    pooled = torch.randn(1, 16, generator=g)
    images = []
    for parallel in (False, True):
        pipe = _flux_pipe(parallel)
        out = pipe(prompt_embeds=embeds.to(TPU), pooled_prompt_embeds=pooled.to(TPU), height=8, width=8,
                   num_inference_steps=2, guidance_scale=3.5, generator=torch.Generator().manual_seed(0),
                   output_type="pt").images
        images.append(out.cpu())
    torch.testing.assert_close(images[1], images[0], rtol=1e-4, atol=1e-4)
    return (images[1] - images[0]).abs().max().item()


# ------------------------------------------------------------------ torch.compile of a TP model
@case
def compiled_tp_mlp() -> dict[str, Any]:
    import torch_tpu
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = _mesh()
    ref = _mlp()
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(1))
    ref_out = ref(x)
    ref_out.sum().backward()
    tp = _mlp().to(TPU)
    parallelize_module(tp, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    compiled = torch.compile(tp, backend="tpu")
    torch._dynamo.utils.counters.clear()
    out = compiled(x.to(TPU))
    same(out, ref_out.detach(), "compiled TP forward")
    out.sum().backward()
    same(tp.up.weight.grad.full_tensor(), ref.up.weight.grad, "compiled TP colwise grad")
    same(tp.down.weight.grad.full_tensor(), ref.down.weight.grad, "compiled TP rowwise grad")
    with torch.no_grad():
        compiled(x.to(TPU))  # warm-up of the inference graph
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        builds = torch_tpu.cache_stats()
        for i in range(3):  # steady state: new inputs, same shapes -> no new graphs, no new programs
            xi = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(10 + i))
            same(compiled(xi.to(TPU)), ref(xi), f"compiled TP call {i}")
    after = torch_tpu.cache_stats()
    new_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames
    misses = after["misses"] - builds["misses"]
    assert new_graphs == 0 and misses == 0, (new_graphs, misses)
    return {"new_graphs_after_warmup": new_graphs, "program_misses": misses}


# ------------------------------------------------------------------ 2-D mesh (4 processes)
@case
def fsdp_x_tp_2d() -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    assert world() == 4
    mesh = init_device_mesh("tpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ref_losses, ref = _ref_losses()
    model = _mlp().to(TPU)
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp = mesh["dp"].get_local_rank()
    losses = []
    for x, y in _batches():
        xs, ys = x.chunk(2)[dp].to(TPU), y.chunk(2)[dp].to(TPU)
        loss = torch.nn.functional.mse_loss(model(xs), ys)
        full = loss.detach().clone()
        full = full.full_tensor() if hasattr(full, "full_tensor") else full
        dist.all_reduce(full, op=dist.ReduceOp.AVG)
        losses.append(full.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor().cpu(), q.detach(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=n: f"{n}: {m}")
    return losses


@case
def zero_copy_safety() -> str:
    """In-place collectives on aliased buffers must not leak into other tensors."""
    n = world()
    a = torch.ones(5, device=TPU)
    keep = a.clone()  # may share a's PJRT buffer internally: must stay ones
    alias = a.view(5)  # shares a's storage: must see the result
    dist.all_reduce(a)
    same(a, torch.full((5,), float(n)), "all_reduce result")
    same(alias, torch.full((5,), float(n)), "view of the reduced tensor")
    same(keep, torch.ones(5), "clone taken before the collective")
    same(torch.ones(5, device=TPU), torch.ones(5), "a fresh ones() after an in-place collective")
    b = torch.zeros(5, device=TPU) + rank()
    c = b * 1  # b's buffer is read by this op
    dist.broadcast(b, src=0)
    same(c, torch.full((5,), float(rank())), "tensor computed from the broadcast input before it")
    same(b, torch.zeros(5), "broadcast result")
    s = torch.arange(10.0, device=TPU)[2:7]  # a view: staged path
    dist.all_reduce(s)
    same(s, torch.arange(2.0, 7.0) * n, "all_reduce of a view")
    return "ok"


@case
def compiled_tp_decode() -> dict[str, Any]:
    """Transformers tp_plan Llama, forward compiled with backend="tpu", static KV cache: greedy
    tokens equal eager, and a second generate builds no graph and no program."""
    import torch_tpu
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    path = _hf_saved("llama")
    tp = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"))
    ids = torch.tensor([[1, 5, 9, 3, 7, 11]], device=TPU)
    eager = tp.generate(ids, max_new_tokens=6, do_sample=False).cpu().tolist()
    tp.forward = torch.compile(tp.forward, backend="tpu")
    kw = {"max_new_tokens": 6, "do_sample": False, "cache_implementation": "static"}
    misses0 = torch_tpu.cache_stats()["misses"]
    first = tp.generate(ids, **kw).cpu().tolist()
    warm_misses = torch_tpu.cache_stats()["misses"] - misses0
    torch._dynamo.utils.counters.clear()
    misses1 = torch_tpu.cache_stats()["misses"]
    second = tp.generate(ids, **kw).cpu().tolist()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    misses = torch_tpu.cache_stats()["misses"] - misses1
    assert first == eager and second == eager, (first, second, eager)
    assert graphs == 0 and misses == 0, (graphs, misses)
    return {"tokens_equal_eager": True, "new_graphs_after_warmup": graphs, "program_misses_after_warmup": misses,
            "programs_built_in_warmup": warm_misses}


# ------------------------------------------------------------------ sharded jax_op kernels
@case
def jax_op_sharded() -> str:
    """jax_op(mesh=get_pallas_mesh(...)): each rank runs the function on its own shards (shard_map
    semantics, axis_index = its rank); the gathered shards equal the global function on the CPU."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    from torch_tpu.pallas import get_pallas_mesh, jax_op

    r, n = rank(), world()
    mesh = get_pallas_mesh(("x",))
    assert tuple(mesh.axis_sizes) == (n,)
    full = torch.randn(4 * n, 3, generator=torch.Generator().manual_seed(7))
    bias = torch.randn(3, generator=torch.Generator().manual_seed(8))
    local = full[4 * r:4 * (r + 1)]

    # the per-shard body, with this rank's coordinate
    @jax_op("distjax::body", mesh=mesh, input_partition_specs=(P("x"), P()), output_partition_specs=P("x"))
    def body(a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.sin(a) * 2 + b + jax.lax.axis_index("x").astype(a.dtype)

    x = local.to(TPU).requires_grad_()
    out = body(x, bias.to(TPU))
    same(out, torch.sin(local) * 2 + bias + r, "per-shard body")
    gathered = torch.empty(4 * n, 3, device=TPU)
    dist.all_gather_into_tensor(gathered, out.detach())
    ranks = torch.arange(n).repeat_interleave(4).unsqueeze(1).float()
    same(gathered, torch.sin(full) * 2 + bias + ranks, "gathered shards")
    out.sum().backward()  # default backward (jax.vjp), per shard too
    same(x.grad, 2 * torch.cos(local), "per-shard gradient")

    # a function already written as a jax.shard_map over the mesh (global shapes outside)
    def scaled(a: jax.Array) -> jax.Array:
        return a * (jax.lax.axis_index("x") + 1).astype(a.dtype)

    smap = jax.shard_map(scaled, mesh=mesh, in_specs=P("x"), out_specs=P("x"))

    def global_fn(a: jax.Array) -> jax.Array:
        return smap(a)

    op = jax_op("distjax::smap", global_fn, mesh=mesh, input_partition_specs=(P("x"),),
                output_partition_specs=P("x"))
    same(op(local.to(TPU)), local * (r + 1), "shard_map-wrapped function")

    # collectives across processes: a clear error, on every rank
    @jax_op("distjax::psum", mesh=mesh, input_partition_specs=(P("x"),), output_partition_specs=P())
    def summed(a: jax.Array) -> jax.Array:
        return jax.lax.psum(a, "x")

    try:
        summed(local.to(TPU))
    except NotImplementedError as e:
        assert "psum" in str(e) and "torch.distributed" in str(e), e
    else:
        raise AssertionError("psum across processes did not raise")
    return "ok"
