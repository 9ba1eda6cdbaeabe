"""Warm start: the tpu backend's compiled graphs as PyTorch AOTAutogradCache entries.

AOTAutograd caches a backend's result on disk (under TORCHINDUCTOR_CACHE_DIR/aotautograd) when
the backend's compilers are SerializableAOTDispatchCompilers returning an OutputCode and the
bundled cache is on. Our OutputCode pickles what rebuilds the program in another process: the
graph description (plain values), the output spec and the constants. Rebuilding lowers the
description again and finds the XLA executable in the runtime's compile cache
(TORCH_TPU_CACHE_DIR), so a warm process skips AOTAutograd tracing, partitioning and XLA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._inductor.output_code import OutputCode

# XLA options (serialized CompileOptionsProto) of the graph being compiled now. They are not part
# of the AOTAutograd key (the traced graph does not depend on them), so a cached description is
# rebuilt with the options in force when it is loaded.
_XLA: list[bytes] = [b""]


@contextlib.contextmanager
def aot_cache(xla: bytes) -> Iterator[None]:
    """Turns on AOTAutograd's bundled cache (entries hold our OutputCode) while the tpu backend
    compiles with XLA options `xla`."""
    import torch._functorch.config as functorch_config

    _XLA.append(xla)
    try:
        with functorch_config.patch(bundled_autograd_cache=True):
            yield
    finally:
        _XLA.pop()


class TpuOutputCode(OutputCode):
    """A compiled tpu graph as AOTAutograd sees it: called boxed, picklable when the graph is one
    program without jax_op calls (split and op-by-op graphs bypass the cache)."""

    def __init__(self, fn: Callable[[list[Any]], Any]) -> None:
        from torch_tpu._internal.compile import _Program

        super().__init__()
        self._boxed_call = True
        self._fn: Callable[[list[Any]], Any] | None = fn
        self._payload: tuple[dict[str, Any], list, list[torch.Tensor]] | None = None
        if isinstance(fn, _Program) and not any(node[0] == "jax_call" for node in fn.desc["nodes"]):
            self._payload = (fn.desc, fn.spec, fn.cpu_consts)

    def __call__(self, inputs: list[Any]) -> Any:
        from torch_tpu._internal.compile import _Program

        if self._fn is None:
            raise RuntimeError("torch_tpu: cached graph used before post_compile rebuilt it")
        if isinstance(self._fn, _Program):
            result = self._fn(inputs)
            inputs.clear()
            return result
        return self._fn(inputs)

    def prepare_for_serialization(self) -> None:
        from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache

        if self._payload is None:
            raise BypassAOTAutogradCache("torch_tpu: graph is split, runs op by op or calls a jax_op")
        desc, spec, consts = self._payload
        self._payload = ({**desc, "compile_options": b""}, spec, [c.cpu() for c in consts])
        self._fn = None

    def post_compile(self, example_inputs: Sequence[Any], constants: Any, graph_kwargs: Any) -> None:
        from torch_tpu._internal import compile as tpu_compile

        if self._fn is not None:  # compiled in this process
            return
        assert self._payload is not None
        desc, spec, consts = self._payload
        tpu_compile._AOT_TIER[0] = "aot_cache"
        try:
            self._fn = tpu_compile._Program.rebuild({**desc, "compile_options": _XLA[-1]}, spec, consts,
                                                    tpu_compile._tpu_device(example_inputs))
        finally:
            tpu_compile._AOT_TIER[0] = "traced"
        tpu_compile.STATS["graphs"] += 1
        tpu_compile.STATS["aot_cache_hits"] += 1

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass
