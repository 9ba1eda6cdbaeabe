"""Foreign StableHLO modules (lowered or exported by JAX) made ready to splice into our programs.

JAX's module has a public `@main` and private helpers; we rename every top-level symbol with a
prefix derived from the module text (unique, stable across processes, so the program text and
its disk-cache entry are the same in every run), make them private, drop debug locations and
JAX's argument attributes, and register the text with the `jax_call` lowering.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from torch_tpu import _C

_JAX_INSTALL = "pip install 'torch_tpu[jax]' (jax==0.10.2)"

# torch dtype <-> MLIR element type name
_MLIR_OF_TORCH = {
    torch.bool: "i1", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
    torch.uint8: "ui8", torch.uint16: "ui16", torch.uint32: "ui32", torch.uint64: "ui64",
    torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32", torch.float64: "f64",
}
_TORCH_OF_MLIR = {v: k for k, v in _MLIR_OF_TORCH.items()}


def require_jax(what: str) -> Any:
    """Imports jax, or raises an ImportError that says what to install."""
    try:
        import jax
    except ImportError as e:
        raise ImportError(f"{what} needs JAX, which is not installed: {_JAX_INSTALL}") from e
    _keep_jax_off_devices(jax)
    return jax


def _keep_jax_off_devices(jax: Any) -> None:
    """Lowering makes JAX create a backend for its default device. Before JAX has one, restrict it
    to its host CPU client so it never opens the accelerator this process's runtime owns (libtpu
    allows one client per process); JAX only traces and lowers here, it runs nothing."""
    from jax._src import xla_bridge

    if not xla_bridge._backends and not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")


def mlir_elem(dtype: torch.dtype, op: str, what: str) -> str:
    if dtype not in _MLIR_OF_TORCH:
        raise TypeError(f"{op}: {what} has dtype {dtype}, which the tpu device does not support")
    return _MLIR_OF_TORCH[dtype]


@dataclass(frozen=True)
class Kernel:
    key: str  # the jax_call kernel argument
    in_types: tuple[tuple[str, tuple[int, ...]], ...]
    out_types: tuple[tuple[str, tuple[int, ...]], ...]

    def out_dtypes(self) -> list[torch.dtype]:
        return [_TORCH_OF_MLIR[e] for e, _ in self.out_types]


def _shaped(t: Any) -> tuple[str, tuple[int, ...]]:
    from jax._src.lib.mlir import ir

    rt = ir.RankedTensorType(t)
    return (str(rt.element_type), tuple(int(d) for d in rt.shape))


def register_module(op: str, module: str | bytes, platform: str) -> Kernel:
    """Registers a JAX-lowered module (text, MLIR bytecode or a jax.export portable artifact) for
    op `op`; returns its kernel. Raises a clear error for a module this platform cannot run."""
    jax = require_jax(op)
    del jax
    from jax._src.interpreters import mlir as jmlir
    from jax._src.lib import _jax
    from jax._src.lib.mlir import ir

    ctx = jmlir.make_ir_context()
    with ctx, ir.Location.unknown():
        try:
            if isinstance(module, (bytes, bytearray)):
                try:  # jax.export's mlir_module_serialized: a versioned StableHLO portable artifact
                    m = _jax.mlir.deserialize_portable_artifact(bytes(module))
                except Exception:  # plain MLIR bytecode
                    m = ir.Module.parse(bytes(module))
            else:
                m = ir.Module.parse(module)
        except Exception as e:
            raise ValueError(f"{op}: the module is not valid StableHLO: {e}") from e
        asm = m.operation.get_asm(enable_debug_info=False)
        digest = hashlib.sha256(asm.encode()).hexdigest()[:16]
        _check_platform(op, m, asm, platform)
        prefix = f"jk{digest}_"
        body = m.body
        main = None
        funcs = list(body.operations)
        for f in funcs:
            if f.operation.name != "func.func":
                raise ValueError(f"{op}: the module holds a top-level '{f.operation.name}' (sharding "
                                 "meshes need the multi-chip path); only functions can be spliced")
            name = ir.StringAttr(f.attributes["sym_name"]).value
            if name == "main":
                main = f
            new = prefix + name
            ir.SymbolTable.replace_all_symbol_uses(name, new, m.operation)
            f.attributes["sym_name"] = ir.StringAttr.get(new)
            f.attributes["sym_visibility"] = ir.StringAttr.get("private")
        if main is None:
            raise ValueError(f"{op}: the module has no @main function")
        for attr in ("arg_attrs", "res_attrs"):
            if attr in main.attributes:
                del main.attributes[attr]
        ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
        in_types = tuple(_shaped(t) for t in ftype.inputs)
        out_types = tuple(_shaped(t) for t in ftype.results)
        for e, _ in in_types + out_types:
            if e not in _TORCH_OF_MLIR:
                raise TypeError(f"{op}: the JAX function uses element type {e}, which the tpu device does "
                                "not support (supported: bool, int8-64, uint8-64, float16, bfloat16, float32, "
                                "float64)")
        funcs_text = "\n".join(f.operation.get_asm(enable_debug_info=False) for f in funcs)
    key = f"{op}#{digest}"
    _C._jax_register(key, op, funcs_text, prefix + "main", [(e, list(s)) for e, s in in_types],
                     [(e, list(s)) for e, s in out_types])
    return Kernel(key, in_types, out_types)


def _check_platform(op: str, m: Any, asm: str, platform: str) -> None:
    """A Mosaic (Pallas TPU) or Triton custom call only runs on its own platform."""
    if platform != "tpu" and "tpu_custom_call" in asm:
        raise RuntimeError(
            f"{op}: the module calls a Mosaic TPU kernel (Pallas lowered for platform 'tpu'), which the "
            f"'{platform}' PJRT plugin cannot run. Lower the Pallas kernel with interpret=True (jax_op "
            "does so automatically off TPU) or run on a TPU.")
    if "__gpu$xla.gpu.triton" in asm or "mosaic_gpu" in asm:
        if platform not in ("cuda", "gpu"):
            raise RuntimeError(f"{op}: the module calls a GPU (Triton / Mosaic GPU) kernel, which the "
                               f"'{platform}' PJRT plugin cannot run")


def device_platform() -> str:
    """The PJRT platform of the tpu device ("cpu" on the CPU plugin, "tpu" on TPUs)."""
    return str(_C._platform()["platform_name"]).lower()
