"""Meta kernels and Dynamo hooks compiled tpu graphs need that PyTorch lacks.

- `_grouped_mm`: PyTorch's meta accepts bfloat16 only (CUDA's rule); the CPU kernel and tpu's
  (csrc/aten/explicit_kernels.cc) take float32/float16 too. The override follows the CPU checks.
- `_fused_sgd(_)` and the `tensor_lr` / functional overloads of `_fused_adam(w)(_)` have no meta:
  they get one (in-place: nothing to compute; functional: fresh tensors like the mutated lists).
- Their in-place forms functionalize as the functional op + copy_ (PyTorch's generated rule fails
  on empty lists).
- Dynamo never traces into torch.optim's `_fused_<name>` functions (wrapped in
  `torch.compiler.disable`); for tpu parameters they are traced, so the fused step is in the graph.

Installed once, at the first `torch.compile` call (never at `import torch_tpu`).
"""

from __future__ import annotations

from typing import Any

import torch

_LIBS: list[torch.library.Library] = []


def _grouped_mm_meta(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    ok = (torch.float32, torch.bfloat16, torch.float16)
    torch._check(mat_a.dtype in ok, lambda: f"_grouped_mm: expected mat_a to be Float32, BFloat16 or Float16, "
                 f"got {mat_a.dtype}")
    torch._check(mat_b.dtype == mat_a.dtype, lambda: f"_grouped_mm: expected mat_b to have mat_a's dtype "
                 f"{mat_a.dtype}, got {mat_b.dtype}")
    torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3),
                 lambda: "_grouped_mm: multiplicands must be 2-D or 3-D")
    torch._check(mat_a.size(-1) == mat_b.size(-2),
                 lambda: "_grouped_mm: contraction dimension of mat_a and mat_b must match")
    torch._check(bias is None, lambda: "_grouped_mm: bias is not supported (as in PyTorch)")
    torch._check(out_dtype is None or out_dtype == mat_a.dtype,
                 lambda: "_grouped_mm: output dtype must match mat_a's dtype")
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    torch._check((a2 or b2) == (offs is not None),
                 lambda: "_grouped_mm: offs is required when an operand is 2-D and not allowed when both are 3-D")
    if a2 and b2:
        assert offs is not None
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif a2:
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b2:
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    return mat_a.new_empty(size)


def _fused_meta(op: torch._ops.OpOverload) -> Any:
    schema = op._schema
    inplace = schema.name.endswith("_")
    arg_names = [a.name for a in schema.arguments]

    def meta(*args: Any, **kwargs: Any) -> Any:
        if inplace:
            return None
        bound = dict(zip(arg_names, args, strict=False)) | kwargs
        return tuple([torch.empty_like(t) for t in bound[r.name[:-len("_out")]]] for r in schema.returns)
    return meta


def _functionalize_via_functional_op(op: torch._ops.OpOverload) -> Any:
    """FunctionalTensorMode rule for an in-place fused optimizer op: the functional op, then
    copy_ into the mutated lists. PyTorch's generated functionalization kernel asserts on an empty
    mutable list (Adam's `max_exp_avg_sqs` without amsgrad, SGD's momentum buffers without momentum)."""
    functional = getattr(getattr(torch.ops.aten, op._schema.name[len("aten::"):-1]), op._overloadname)
    arg_names = [a.name for a in op._schema.arguments]

    def handler(mode: Any, *args: Any, **kwargs: Any) -> None:
        bound = dict(zip(arg_names, args, strict=False)) | kwargs
        with mode:
            outs = functional(*args, **kwargs)
            for ret, new in zip(functional._schema.returns, outs, strict=True):
                name = ret.name[:-len("_out")]
                if name == "grads" and bound.get("grad_scale") is None:
                    continue  # grads change only when unscaled
                for dst, src in zip(bound[name], new, strict=True):
                    dst.copy_(src)
    return handler


def _has_meta(op: torch._ops.OpOverload) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta")


def _trace_fused_optimizers() -> None:
    from torch._dynamo.eval_frame import TorchPatcher
    from torch.optim import adam, adamw, sgd

    TorchPatcher.patch()  # Dynamo's own wrapping first (it runs once, on first compile)
    for mod, name in ((sgd, "_fused_sgd"), (adam, "_fused_adam"), (adamw, "_fused_adam")):
        fn = getattr(mod, name, None)
        if fn is None or getattr(fn, "_torch_tpu_routed", False):
            continue
        traced = getattr(fn, "_torchdynamo_orig_callable", None) or getattr(fn, "__wrapped__", fn)

        def routed(params: list[torch.Tensor], *args: Any, _fn: Any = fn, _traced: Any = traced,
                   **kwargs: Any) -> Any:
            # Dynamo evaluates (and guards on) the device: tpu steps are traced into the graph.
            if params and params[0].device.type == "tpu":
                return _traced(params, *args, **kwargs)
            return _fn(params, *args, **kwargs)

        routed._torch_tpu_routed = True  # type: ignore[attr-defined]
        setattr(mod, name, routed)


def install() -> None:
    if _LIBS:
        return
    lib = torch.library.Library("aten", "IMPL")
    _LIBS.append(lib)
    lib.impl("_grouped_mm", _grouped_mm_meta, "Meta", allow_override=True)
    op = torch.ops.aten._grouped_mm.default
    op.py_kernels[torch._C.DispatchKey.Meta] = _grouped_mm_meta  # what the Python dispatcher calls
    op._dispatch_cache.clear()
    for name in ("_fused_sgd_", "_fused_sgd", "_fused_adam_", "_fused_adam", "_fused_adamw_", "_fused_adamw"):
        packet = getattr(torch.ops.aten, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if "out" in overload:
                continue
            if not _has_meta(op):
                lib.impl(op, _fused_meta(op), "Meta")
            if name.endswith("_"):
                from torch._subclasses.functional_tensor import FunctionalTensorMode

                if FunctionalTensorMode not in op.python_key_table:
                    op.py_impl(FunctionalTensorMode)(_functionalize_via_functional_op(op))
    _trace_fused_optimizers()
