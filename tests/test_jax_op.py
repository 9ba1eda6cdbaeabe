"""torch.tpu.pallas.jax_op: JAX and Pallas functions as torch ops on tpu tensors, checked against
the same math in PyTorch on the CPU (strict eager, fused eager, torch.compile, autograd,
donation, the disk cache across processes, and the errors a kernel author can hit)."""

from __future__ import annotations

import os
import textwrap
import warnings

import pytest
import torch
import torch_tpu
from conftest import run_python

jax = pytest.importorskip("jax")
jnp = jax.numpy
from jax.experimental import pallas as pl  # noqa: E402
from torch_tpu.pallas import jax_op  # noqa: E402


@jax_op("tpu_test::sinmm")
def sinmm(x: jax.Array, y: jax.Array, scale: float = 2.0) -> jax.Array:
    return jnp.sin(x) @ y * scale


def _sinmm_ref(x: torch.Tensor, y: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
    return torch.sin(x) @ y * scale


def _axpy_kernel(x_ref, y_ref, o_ref):  # noqa: ANN001, ANN202
    o_ref[...] = x_ref[...] * 2.0 + y_ref[...]


@jax_op("tpu_test::pallas_axpy")
def pallas_axpy(x: jax.Array, y: jax.Array) -> jax.Array:
    # Written for TPU (no interpret=): jax_op picks interpret mode on the CPU plugin.
    return pl.pallas_call(_axpy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x, y)


@jax_op("tpu_test::split")
def split_minmax(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    return jnp.max(x, axis=axis), jnp.min(x, axis=axis)


def test_torch_tpu_pallas_names() -> None:
    assert torch.tpu.pallas.jax_op is jax_op  # type: ignore[attr-defined]
    import torch.tpu.pallas as tp  # the reference's import path

    assert tp.jax_op is jax_op
    assert "(Tensor x, Tensor y, float scale=2.) -> Tensor" in str(sinmm._opoverload._schema)


def test_import_torch_tpu_stays_free_of_jax() -> None:
    r = run_python("import sys, torch, torch_tpu, torch.tpu.pallas, torch.tpu.ops; "
                   "assert 'jax' not in sys.modules, 'jax imported'; print('ok')")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(4, 8, dtype=dtype), torch.randn(8, 3, dtype=dtype)
    torch_tpu.reset_fallback_stats()
    out = sinmm(x.to("tpu"), y.to("tpu"))
    assert out.device.type == "tpu" and out.dtype == dtype and out.shape == (4, 3)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    torch.testing.assert_close(out.cpu(), _sinmm_ref(x.float(), y.float()).to(dtype), **tol)
    # A new static value is a new kernel; a view argument is read through its strides.
    out3 = sinmm(x.to("tpu"), y.t().contiguous().to("tpu").t(), 3.0)
    torch.testing.assert_close(out3.cpu(), _sinmm_ref(x.float(), y.float(), 3.0).to(dtype), **tol)
    assert torch_tpu.fallback_stats() == {}


def test_pallas_kernel_runs_on_the_cpu_plugin() -> None:
    x, y = torch.randn(8, 128), torch.randn(8, 128)
    torch.testing.assert_close(pallas_axpy(x.to("tpu"), y.to("tpu")).cpu(), x * 2 + y)


def test_multiple_outputs_and_static_int() -> None:
    x = torch.randn(5, 6)
    mx, mn = split_minmax(x.to("tpu"), 1)
    torch.testing.assert_close(mx.cpu(), x.amax(1))
    torch.testing.assert_close(mn.cpu(), x.amin(1))


def test_no_host_sync_and_compiled_once() -> None:
    x, y = torch.randn(4, 8).to("tpu"), torch.randn(8, 3).to("tpu")
    sinmm(x, y)
    torch_tpu.synchronize()
    before, misses = torch_tpu.dispatch_stats(), torch_tpu.cache_stats()["misses"]
    for _ in range(3):
        sinmm(x, y)
    after = torch_tpu.dispatch_stats()
    assert after["host_syncs"] == before["host_syncs"]
    assert after["launches"] - before["launches"] == 3
    assert torch_tpu.cache_stats()["misses"] == misses


def test_fused_eager_one_program() -> None:
    x, y = torch.randn(4, 8), torch.randn(8, 3)
    xt, yt = x.to("tpu"), y.to("tpu")
    torch_tpu.synchronize()
    with torch_tpu.set_eager_mode(torch_tpu.EagerMode.DEFER_AND_FUSE):
        before = torch_tpu.dispatch_stats()["launches"]
        out = torch.relu(sinmm(xt, yt)) + 1
        got = out.cpu()
        assert torch_tpu.dispatch_stats()["launches"] - before == 1  # relu, kernel, add: one program
    torch.testing.assert_close(got, torch.relu(_sinmm_ref(x, y)) + 1)


def test_compiled_graph_splices_the_kernel() -> None:
    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.relu(sinmm(a, b)) + pallas_axpy(a, a).sum()

    x, y = torch.randn(4, 8), torch.randn(8, 3)
    cf = torch.compile(f, backend="tpu", fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "runs op by op" fallback
        out = cf(x.to("tpu"), y.to("tpu"))
    torch.testing.assert_close(out.cpu(), torch.relu(_sinmm_ref(x, y)) + (x * 3).sum(), atol=1e-4, rtol=1e-5)
    torch_tpu.synchronize()
    before = torch_tpu.dispatch_stats()["launches"]
    cf(x.to("tpu"), y.to("tpu"))
    torch_tpu.synchronize()
    # Two uploads (.to) and one program: the JAX modules are part of the graph's program.
    assert torch_tpu.dispatch_stats()["launches"] - before <= 1


def test_default_backward_from_jax_vjp() -> None:
    x, y = torch.randn(4, 8), torch.randn(8, 3)
    xt, yt = x.to("tpu").requires_grad_(), y.to("tpu").requires_grad_()
    (sinmm(xt, yt, 1.5) ** 2).sum().backward()
    xc, yc = x.clone().requires_grad_(), y.clone().requires_grad_()
    (_sinmm_ref(xc, yc, 1.5) ** 2).sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), xc.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(yt.grad.cpu(), yc.grad, atol=1e-4, rtol=1e-4)


def test_compiled_training_graph() -> None:
    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return sinmm(a, b).square().sum()

    x, y = torch.randn(4, 8), torch.randn(8, 3)
    xt, yt = x.to("tpu").requires_grad_(), y.to("tpu").requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.compile(f, backend="tpu", fullgraph=True)(xt, yt).backward()
    xc, yc = x.clone().requires_grad_(), y.clone().requires_grad_()
    _sinmm_ref(xc, yc).square().sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), xc.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(yt.grad.cpu(), yc.grad, atol=1e-4, rtol=1e-4)


def test_register_autograd_overrides_the_default() -> None:
    @jax_op("tpu_test::cube")
    def cube(x: jax.Array) -> jax.Array:
        return x * x * x

    calls = []

    def setup_context(ctx, inputs, output):  # noqa: ANN001, ANN202
        ctx.save_for_backward(inputs[0])

    def backward(ctx, g):  # noqa: ANN001, ANN202
        calls.append(1)
        (x,) = ctx.saved_tensors
        return g * 3 * x * x

    cube.register_autograd(backward, setup_context=setup_context)
    x = torch.randn(6)
    xt = x.to("tpu").requires_grad_()
    cube(xt).sum().backward()
    assert calls == [1]
    torch.testing.assert_close(xt.grad.cpu(), 3 * x * x)


def test_donate_argnums() -> None:
    @jax_op("tpu_test::inc", donate_argnums=(0,))
    def inc(x: jax.Array) -> jax.Array:
        return x + 1

    x = torch.arange(6, dtype=torch.float32)
    xt = x.to("tpu")
    out = inc(xt)
    torch.testing.assert_close(out.cpu(), x + 1)
    # The output took over the donated buffer (written in place by the program); the donated
    # input is left without device memory, as a donated jax.Array is deleted.
    assert out.untyped_storage().data_ptr() != xt.untyped_storage().data_ptr()
    assert xt.cpu().abs().max().item() == 0

    @jax_op("tpu_test::sum_and_double", donate_argnums=(1,))
    def sum_and_double(x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
        return x.sum(), y * 2  # y is paired with the second output (same shape and dtype)

    y = torch.randn(3, 4)
    s_, d_ = sum_and_double(torch.ones(2).to("tpu"), y.to("tpu"))
    torch.testing.assert_close(s_.cpu(), torch.tensor(2.0))
    torch.testing.assert_close(d_.cpu(), y * 2)

    def scaled(x: jax.Array, k: float) -> jax.Array:
        return x * k

    with pytest.raises(ValueError, match="tpu_test::bad_donate.*out of range"):
        jax_op("tpu_test::bad_donate", scaled, donate_argnums=(3,))

    with pytest.raises(ValueError, match="tpu_test::bad_donate2.*'k'.*not a jax.Array"):
        jax_op("tpu_test::bad_donate2", scaled, donate_argnums=(1,))


def test_bad_inputs_name_the_op() -> None:
    def unannotated(x, k: int):  # noqa: ANN001, ANN202
        return x

    with pytest.raises(TypeError, match="tpu_test::unannotated.*'x' has no annotation"):
        jax_op("tpu_test::unannotated", unannotated)

    @jax_op("tpu_test::nonzero")
    def nonzero(x: jax.Array) -> jax.Array:
        return x[x > 0]

    with pytest.raises(ValueError, match="tpu_test::nonzero.*depends on the\\s+values"):
        nonzero(torch.randn(8).to("tpu"))

    @jax_op("tpu_test::twice")
    def twice(x: jax.Array) -> jax.Array:
        return x, x  # type: ignore[return-value]

    with pytest.raises(TypeError, match="tpu_test::twice.*annotate its return"):
        twice(torch.randn(3).to("tpu"))

    @jax_op("tpu_test::ident64")
    def ident64(x: jax.Array) -> jax.Array:
        return x + 1

    with pytest.raises(TypeError, match="tpu_test::ident64.*jax_enable_x64"):
        ident64(torch.arange(3).to("tpu"))

    @jax_op("tpu_test::to_complex")
    def to_complex(x: jax.Array) -> jax.Array:
        return x.astype(jnp.complex64)

    with pytest.raises(TypeError, match="tpu_test::to_complex.*complex.*not\\s+support"):
        to_complex(torch.randn(3).to("tpu"))

    with pytest.raises(ValueError, match="tpu_test::sinmm.*on cpu"):
        sinmm(torch.randn(4, 8), torch.randn(8, 3).to("tpu"))

    def plain(x: jax.Array) -> jax.Array:
        return x + 1

    with pytest.raises(TypeError, match="tpu_test::meshed.*JAX mesh"):
        jax_op("tpu_test::meshed", plain, mesh=object())


def test_mesh_without_process_group() -> None:
    """No process group: a one-chip mesh runs here (axis_index 0); a mesh over more chips, a spec
    naming an unknown axis, or a collective raise errors saying what to do. (2 processes:
    tests/test_distributed.py::test_jax_op_sharded_over_processes.)"""
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as P
    from torch_tpu.pallas import get_pallas_mesh

    mesh = torch.tpu.pallas.get_pallas_mesh(("x", "y"))
    assert tuple(mesh.axis_sizes) == (1, 1) and tuple(mesh.axis_names) == ("x", "y")

    @jax_op("tpu_test::shard_body", mesh=mesh, input_partition_specs=(P("x", "y"),), output_partition_specs=P("x"))
    def body(a: jax.Array) -> jax.Array:
        return a * 3 + jax.lax.axis_index(("x", "y")).astype(a.dtype)

    a = torch.randn(4, 2)
    torch.testing.assert_close(body(a.to("tpu")).cpu(), a * 3)
    with pytest.raises(RuntimeError, match="no process group is initialised.*init_process_group"):
        get_pallas_mesh(("x",), mesh_shape=(2,))

    def raw(a: jax.Array) -> jax.Array:
        return a
    with pytest.raises(RuntimeError, match="tpu_test::wide.*2 chips.*no process group"):
        jax_op("tpu_test::wide", raw, mesh=AbstractMesh((2,), ("x",)), input_partition_specs=(P("x"),))
    with pytest.raises(ValueError, match="tpu_test::badaxis.*'z'"):
        jax_op("tpu_test::badaxis", raw, mesh=mesh, input_partition_specs=(P("z"),))
    with pytest.raises(ValueError, match="tpu_test::nspecs.*2 entries for 1"):
        jax_op("tpu_test::nspecs", raw, mesh=mesh, input_partition_specs=(P(), P()))

    @jax_op("tpu_test::psum", mesh=mesh, input_partition_specs=(P("x"),))
    def summed(a: jax.Array) -> jax.Array:
        return jax.lax.psum(a, "x")

    with pytest.raises(NotImplementedError, match="tpu_test::psum.*'psum'.*torch.distributed"):
        summed(a.to("tpu"))


def test_without_jax_the_error_says_what_to_install() -> None:
    r = run_python(textwrap.dedent("""
        import sys
        sys.modules['jax'] = None  # as if JAX were not installed
        import torch, torch_tpu
        from torch_tpu.pallas import jax_op
        try:
            jax_op('x::y', lambda a: a)
        except ImportError as e:
            print('IMPORTERROR', e)
    """))
    assert "IMPORTERROR" in r.stdout and "pip install" in r.stdout and "jax" in r.stdout, r.stdout + r.stderr


def test_disk_cache_hit_in_a_new_process(tmp_path: os.PathLike) -> None:
    code = textwrap.dedent("""
        import torch, torch_tpu, jax, jax.numpy as jnp
        from torch_tpu.pallas import jax_op
        @jax_op("tpu_test::cached")
        def k(x: jax.Array) -> jax.Array:
            return jnp.tanh(x) * 3
        torch_tpu.reset_cache_stats()
        x = torch.linspace(-1, 1, 7)
        assert torch.allclose(k(x.to("tpu")).cpu(), torch.tanh(x) * 3, atol=1e-6)
        s = torch_tpu.cache_stats()
        print("STATS", s["misses"], s["disk_hits"])
    """)
    env = {"TORCH_TPU_CACHE_DIR": str(tmp_path)}
    first = run_python(code, env)
    second = run_python(code, env)
    assert "STATS" in first.stdout, first.stderr
    m1, _ = map(int, first.stdout.split("STATS")[1].split())
    m2, d2 = map(int, second.stdout.split("STATS")[1].split())
    assert m1 >= 1 and m2 == 0 and d2 >= 1


# ---- torch_tpu._internal.pallas.tpu_torch_pallas: what torch 2.13's Inductor Pallas codegen calls


def _export(fn, *shapes):  # noqa: ANN001, ANN002, ANN202
    avals = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    return jax.export.export(jax.jit(fn), platforms=["tpu"])(*avals)  # as Inductor exports


def test_inductor_bridge_both_keyword_forms() -> None:
    from torch_tpu._internal.pallas import tpu_torch_pallas as tp

    exported = _export(lambda x, y: (jnp.tanh(x) + y, x * y), (4, 8), (4, 8))
    assert not tp.lookup_custom_kernel("ind_k", "ind_k_4_8")
    tp.register_custom_kernel("ind_k", "ind_k_4_8", serialized_mlir_module=exported.mlir_module_serialized)
    assert tp.lookup_custom_kernel("ind_k", "ind_k_4_8")
    tp.register_custom_kernel("ind_k", "ind_k_pos", exported.mlir_module_serialized)  # positional form
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    shapes = [torch.empty(4, 8, device="tpu"), torch.empty(4, 8, device="tpu")]
    a, b = tp.call_custom_kernel("ind_k", "ind_k_4_8", inputs=[x.to("tpu"), y.to("tpu")], output_shapes=shapes,
                                 donate_argnums=[])
    torch.testing.assert_close(a.cpu(), torch.tanh(x) + y)
    torch.testing.assert_close(b.cpu(), x * y)
    xt = x.to("tpu")
    (c, _d) = tp.call_custom_kernel("ind_k", "ind_k_pos", inputs=[xt, y.to("tpu")], output_shapes=shapes,
                                    input_output_aliases={0: 0})
    xt.copy_(c)  # what the generated code does with aliased outputs
    torch.testing.assert_close(xt.cpu(), torch.tanh(x) + y)
    with pytest.raises(ValueError, match="pallas::ind_k: output 0 is torch.float32\\[4, 8\\]"):
        tp.call_custom_kernel("ind_k", "ind_k_4_8", inputs=[x.to("tpu"), y.to("tpu")],
                              output_shapes=[torch.empty(2, device="tpu")] * 2)
    with pytest.raises(KeyError, match="register_custom_kernel first"):
        tp.call_custom_kernel("nope", "k", inputs=[], output_shapes=[])


def test_inductor_bridge_mosaic_module_on_cpu_plugin_names_the_platform() -> None:
    from torch_tpu._internal.pallas import tpu_torch_pallas as tp

    def kern(x_ref, o_ref):  # noqa: ANN001, ANN202
        o_ref[...] = x_ref[...] + 1

    exported = _export(lambda x: pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x), (8, 128))
    platform = torch_tpu._C._platform()["platform_name"].lower()
    if platform == "tpu":
        pytest.skip("the Mosaic module runs on a TPU")
    with pytest.raises(RuntimeError, match=f"Mosaic TPU kernel.*'{platform}' PJRT plugin cannot run"):
        tp.register_custom_kernel("mosaic_k", "k", serialized_mlir_module=exported.mlir_module_serialized)
