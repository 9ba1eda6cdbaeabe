"""`torch.tpu.ops`: tpu kernels beyond ATen.

`ragged_dot(lhs, rhs, group_sizes)` - JAX's ragged dot for MoE: rows of `lhs` [M, K] are sorted by
group, group g owns the next `group_sizes[g]` rows and multiplies them by `rhs[g]` ([G, K, N]);
rows past the groups are zero. `ragged_dot_weight_grad(lhs, grad, group_sizes)` is its weight
gradient, [G, K, N] = per group lhs[rows].T @ grad[rows]. Both are lowered (csrc/lowering/
grouped_mm.cc, the paths `aten::_grouped_mm` uses too): no host sync, float32/bfloat16/float16,
differentiable, usable in eager (strict or fused) and inside torch.compile graphs. A Pallas
implementation (`impl="pallas"`, via torch.tpu.pallas.jax_op) is shipped for TPUs, where
Mosaic runs it; by default the faster path for the platform is taken: Pallas on a TPU; on the CPU
PJRT plugin a host kernel, an XLA FFI custom call into ATen's CPU GEMM inside the same program
(`host_kernels()` reports or switches it; csrc/runtime/ffi_kernels.cc); elsewhere the XLA path.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["host_kernels", "ragged_dot", "ragged_dot_weight_grad"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_lib = torch.library.Library("torch_tpu", "FRAGMENT")
_lib.define("ragged_dot(Tensor lhs, Tensor rhs, Tensor group_sizes) -> Tensor")
_lib.define("ragged_dot_weight_grad(Tensor lhs, Tensor grad, Tensor group_sizes) -> Tensor")


def _check(name: str, a: torch.Tensor, b: torch.Tensor, gs: torch.Tensor, b_rank: int) -> None:
    for what, t in (("lhs", a), ("rhs" if b_rank == 3 else "grad", b), ("group_sizes", gs)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {what} must be a tensor, got {type(t).__name__}")
    if a.dtype not in _DTYPES or b.dtype != a.dtype:
        raise TypeError(f"{name}: lhs and {'rhs' if b_rank == 3 else 'grad'} must share one dtype among "
                        f"float32, bfloat16, float16; got {a.dtype} and {b.dtype}")
    if gs.dtype not in (torch.int32, torch.int64) or gs.dim() != 1:
        raise TypeError(f"{name}: group_sizes must be a 1-D int32/int64 tensor, got {gs.dtype} of shape "
                        f"{list(gs.shape)}")
    if a.dim() != 2 or b.dim() != b_rank:
        raise ValueError(f"{name}: expected lhs [M, K] and a {b_rank}-D second operand, got shapes "
                         f"{list(a.shape)} and {list(b.shape)}")
    if b_rank == 3 and (b.shape[0] != gs.shape[0] or b.shape[1] != a.shape[1]):
        raise ValueError(f"{name}: rhs must be [G, K, N] with G = len(group_sizes) = {gs.shape[0]} and "
                         f"K = lhs.shape[1] = {a.shape[1]}, got {list(b.shape)}")
    if b_rank == 2 and b.shape[0] != a.shape[0]:
        raise ValueError(f"{name}: lhs and grad must have the same number of rows, got {a.shape[0]} and {b.shape[0]}")
    if len({a.device, b.device, gs.device}) != 1:
        raise ValueError(f"{name}: all tensors must be on one device, got {a.device}, {b.device}, {gs.device}")


@torch.library.register_fake("torch_tpu::ragged_dot")
def _ragged_dot_fake(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    _check("ragged_dot", lhs, rhs, group_sizes, 3)
    return lhs.new_empty(lhs.shape[0], rhs.shape[2])


@torch.library.register_fake("torch_tpu::ragged_dot_weight_grad")
def _wgrad_fake(lhs: torch.Tensor, grad: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    _check("ragged_dot_weight_grad", lhs, grad, group_sizes, 2)
    return lhs.new_empty(group_sizes.shape[0], lhs.shape[1], grad.shape[1])


# CPU kernels (the reference semantics; one mm per group after reading the sizes).
@torch.library.impl(_lib, "ragged_dot", "CPU")
def _ragged_dot_cpu(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    _check("ragged_dot", lhs, rhs, group_sizes, 3)
    out = lhs.new_zeros(lhs.shape[0], rhs.shape[2])
    start = 0
    for g, n in enumerate(group_sizes.tolist()):
        end = min(start + max(int(n), 0), lhs.shape[0])
        if end > start:
            out[start:end] = (lhs[start:end].float() @ rhs[g].float()).to(lhs.dtype)
        start = end
    return out


@torch.library.impl(_lib, "ragged_dot_weight_grad", "CPU")
def _wgrad_cpu(lhs: torch.Tensor, grad: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    _check("ragged_dot_weight_grad", lhs, grad, group_sizes, 2)
    out = lhs.new_zeros(group_sizes.shape[0], lhs.shape[1], grad.shape[1])
    start = 0
    for g, n in enumerate(group_sizes.tolist()):
        end = min(start + max(int(n), 0), lhs.shape[0])
        if end > start:
            out[g] = (lhs[start:end].float().t() @ grad[start:end].float()).to(lhs.dtype)
        start = end
    return out


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    lhs, rhs, gs = inputs
    ctx.save_for_backward(lhs, rhs, gs)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    lhs, rhs, gs = ctx.saved_tensors
    d_lhs = torch.ops.torch_tpu.ragged_dot(grad, rhs.transpose(1, 2), gs) if ctx.needs_input_grad[0] else None
    d_rhs = torch.ops.torch_tpu.ragged_dot_weight_grad(lhs, grad, gs) if ctx.needs_input_grad[1] else None
    return d_lhs, d_rhs, None


def _wgrad_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    lhs, grad, gs = inputs
    ctx.save_for_backward(lhs, grad, gs)


def _wgrad_backward(ctx: Any, gw: torch.Tensor) -> tuple[Any, ...]:
    # W[g] = lhs_g^T grad_g: d lhs_g = grad_g gw[g]^T, d grad_g = lhs_g gw[g].
    lhs, grad, gs = ctx.saved_tensors
    d_lhs = torch.ops.torch_tpu.ragged_dot(grad, gw.transpose(1, 2), gs) if ctx.needs_input_grad[0] else None
    d_grad = torch.ops.torch_tpu.ragged_dot(lhs, gw, gs) if ctx.needs_input_grad[1] else None
    return d_lhs, d_grad, None


torch.library.register_autograd("torch_tpu::ragged_dot", _backward, setup_context=_setup)
torch.library.register_autograd("torch_tpu::ragged_dot_weight_grad", _wgrad_backward, setup_context=_wgrad_setup)


_pallas_default: bool | None = None  # the platform's choice, fixed once the client runs


def _use_pallas(impl: str | None, device: torch.device) -> bool:
    global _pallas_default
    if impl is None:
        if device.type != "tpu":
            return False
        if _pallas_default is None:
            # Mosaic runs the Pallas kernel on TPUs; elsewhere it could only be interpreted (slower
            # than XLA). Asked once: 3.5 us a call, 0.7 % of a decode-size ragged dot.
            from torch_tpu.pallas._foreign import device_platform

            _pallas_default = device_platform() == "tpu" and _pallas_available()
        return _pallas_default
    if impl not in ("xla", "pallas"):
        raise ValueError(f"ragged_dot: impl must be None, 'xla' or 'pallas', got {impl!r}")
    return impl == "pallas"


def _pallas_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("jax") is not None


def _call(op: Any, a: torch.Tensor, b: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return op(a, b, group_sizes)
    # Nothing to differentiate: skip the Python autograd kernel (~0.08 ms per call; decode).
    with torch._C._AutoDispatchBelowAutograd():
        return op(a, b, group_sizes)


def ragged_dot(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, *, impl: str | None = None
               ) -> torch.Tensor:
    """[M, K] x [G, K, N] -> [M, N]: rows grouped by `group_sizes` (sorted), group g times rhs[g]."""
    _check("ragged_dot", lhs, rhs, group_sizes, 3)
    if impl is None and torch.compiler.is_compiling():
        return torch.ops.torch_tpu.ragged_dot(lhs, rhs, group_sizes)  # one lowered node in the graph
    if _use_pallas(impl, lhs.device):
        from torch_tpu.ops import _pallas_ragged_dot

        return _pallas_ragged_dot.ragged_dot(lhs, rhs, group_sizes)
    return _call(torch.ops.torch_tpu.ragged_dot.default, lhs, rhs, group_sizes)


def ragged_dot_weight_grad(lhs: torch.Tensor, grad: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """[M, K], [M, N] -> [G, K, N]: per group, lhs[rows_g].T @ grad[rows_g] (zero for empty groups)."""
    _check("ragged_dot_weight_grad", lhs, grad, group_sizes, 2)
    return _call(torch.ops.torch_tpu.ragged_dot_weight_grad.default, lhs, grad, group_sizes)


def host_kernels(enabled: bool | str | None = None, kind: str | None = None) -> str:
    """The host kernels of the CPU PJRT plugin, XLA FFI custom calls into PyTorch's CPU kernels inside
    the programs: ragged_dot, its weight gradient and the grouped forms of `_grouped_mm` (ATen's CPU
    GEMM per group), float convolution forwards (kind "conv", PyTorch's CPU convolution) and float32
    mm / addmm / bmm / baddbmm from a measured size on (kind "gemm", PyTorch's CPU GEMM on two threads:
    in eager programs 2 to 128 rows, in compiled graphs 2-D products of 2 to 512 rows). Returns
    "on", "off", "always" or "unavailable: <why>" (another platform, built without jaxlib's XLA FFI
    headers, the plugin refused them, or TORCH_TPU_HOST_KERNELS=0). `enabled` switches them for the
    programs built after the call (compiled graphs read the switch when they compile; a cached eager
    program keeps the path it was built with): True (the default state) uses them from a size where
    they beat the XLA path, "always" for every size, False never. With `kind`, True / False switch
    that kind alone (the others keep their state) and the answer is that kind's."""
    modes = {None: -1, False: 0, True: 1, "always": 2}
    if not (enabled is None or isinstance(enabled, bool) or enabled == "always"):
        raise TypeError(f"host_kernels: enabled must be a bool, 'always' or None, got {enabled!r}")
    if kind is not None:
        if kind not in ("conv", "gemm"):
            raise ValueError(f"host_kernels: kind must be 'conv' or 'gemm', got {kind!r}")
        if enabled == "always":
            raise ValueError("host_kernels: 'always' applies to every kind at once (kind=None)")
    return str(torch.ops.torch_tpu._host_kernels(modes[enabled], kind))
