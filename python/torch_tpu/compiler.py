"""`torch.tpu.compiler` / `torch_tpu.compiler`: XLA compile options for compiled graphs.

    with torch_tpu.compiler.custom_compiler_options({"xla_optimization_level": "O3"}):
        out = compiled_model(x)   # graphs built in the block use these options

Same as `torch.compile(..., options={...})`; names and encoding in `_internal/xla_options.py`.
"""

from __future__ import annotations

from torch_tpu._internal.xla_options import custom_compiler_options

__all__ = ["custom_compiler_options"]
