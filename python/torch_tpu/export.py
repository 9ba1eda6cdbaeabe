"""`torch_tpu.export`: StableHLO from `torch.export`.

    ep = torch.export.export(model, args)
    text = torch_tpu.export.exported_to_stablehlo(ep)   # MLIR text, `func.func @main`

The exported graph is decomposed with the compile backend's table (ops with a lowering stay
whole) and lowered by the same lowering table as eager and torch.compile. Program arguments are
the graph's placeholders in order (lifted parameters and buffers first, then user inputs, as
`ep.graph_signature.input_specs` lists them); results are the graph's outputs (mutated buffers
first, then user outputs), as shaped values. The text compiles on the PJRT plugin (round-trip test
in tests/test_compile_options.py).
"""

from __future__ import annotations

from typing import Any

import torch

from torch_tpu import _C
from torch_tpu._internal import compile as tpu_compile

__all__ = ["exported_to_stablehlo"]


def exported_to_stablehlo(exported: torch.export.ExportedProgram) -> str:
    """StableHLO text of an ExportedProgram (see the module docstring for its signature)."""
    if not isinstance(exported, torch.export.ExportedProgram):
        raise TypeError(f"exported_to_stablehlo expects a torch.export.ExportedProgram, got {type(exported).__name__}")
    desc = _describe(exported)
    desc["plain_outputs"] = True
    return _C._graph_text(desc)


def _describe(exported: torch.export.ExportedProgram) -> dict[str, Any]:
    with tpu_compile.lowered_ops_stay_whole():
        ep = exported.run_decompositions(tpu_compile.decompositions())
    try:
        desc, spec, constants = tpu_compile._Describer(ep.graph_module, "export").describe()
    except tpu_compile.Unsupported as e:
        raise RuntimeError(f"torch_tpu.export: cannot lower the exported graph: {e}") from None
    if constants:
        raise RuntimeError("torch_tpu.export: the exported graph holds tensor constants; lift them "
                           "(torch.export lifts parameters and buffers by default)")
    missing = _C._graph_unsupported(desc)
    if missing:
        raise RuntimeError("torch_tpu.export: no lowering for " + ", ".join(sorted(set(missing))))
    if any(kind != "out" for kind, _ in spec):
        raise RuntimeError("torch_tpu.export: graph outputs that are inputs or constants are not supported")
    return desc
