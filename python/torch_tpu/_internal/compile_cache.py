"""Warm start: the tpu backend's compiled graphs as PyTorch AOTAutogradCache entries.

AOTAutograd caches a backend's result on disk (under TORCHINDUCTOR_CACHE_DIR/aotautograd) when
the backend's compilers are SerializableAOTDispatchCompilers returning an OutputCode and the
bundled cache is on. Our OutputCode pickles what rebuilds the program in another process: the
graph description (plain values), the output spec and the constants, as one bytes blob.
Rebuilding lowers the description again and finds the XLA executable in the runtime's compile
cache (TORCH_TPU_CACHE_DIR), so a warm process skips AOTAutograd tracing, partitioning and XLA.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import pickle
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch._inductor.output_code import OutputCode

# XLA options (serialized CompileOptionsProto) of the graph being compiled now. They are not part
# of the AOTAutograd key (the traced graph does not depend on them), so a cached description is
# rebuilt with the options in force when it is loaded.
_XLA: list[bytes] = [b""]
_TAG: list[str] = []
_SAVE_AT_EXIT: list[bool] = []


def _save_dynamo_packages() -> None:
    """At exit: writes the Dynamo packages of the frames compiled in this process (what
    torch.compiler.save_cache_artifacts() writes under caching precompile), so the next process
    finds them without the user calling it."""
    try:
        from torch._dynamo.precompile_context import PrecompileContext

        PrecompileContext.save_to_dynamo_cache()
    except Exception as e:  # noqa: BLE001 - a cache write must never fail the exit
        import warnings

        warnings.warn(f"torch_tpu: could not save Dynamo's precompile cache at exit: {e}", stacklevel=1)


def backend_tag() -> str:
    """What in torch_tpu decides the traced graphs: the set of lowered ops (which decides the
    decomposition table) and the sources that trace and describe graphs. Folded into
    AOTAutograd's key (torch.compiler.config.cache_key_tag), so a torch_tpu upgrade never
    reuses a graph traced with another table."""
    if not _TAG:
        from torch_tpu import _C

        h = hashlib.sha256()
        h.update("\n".join(sorted(_C._lowered_ops())).encode())
        here = Path(__file__).parent
        for name in ("compile.py", "compile_meta.py", "compile_cache.py"):
            h.update((here / name).read_bytes())
        _TAG.append("torch_tpu-" + h.hexdigest()[:16])
    return _TAG[0]


@contextlib.contextmanager
def aot_cache(xla: bytes) -> Iterator[None]:
    """While the tpu backend compiles with XLA options `xla`: AOTAutograd's bundled cache on
    (entries hold our OutputCode), the backward compiled with the forward (AOTAutograd saves a
    training entry when the backward is compiled; lazily that would be at the first
    `backward()`, outside this block, and nothing would be saved), and the key tagged with
    backend_tag()."""
    import torch._functorch.config as functorch_config
    import torch.compiler.config as compiler_config

    if torch._dynamo.config.caching_precompile and not _SAVE_AT_EXIT:
        import atexit

        _SAVE_AT_EXIT.append(True)
        atexit.register(_save_dynamo_packages)  # runs before Dynamo's own exit hooks (LIFO)
    user_tag = compiler_config.cache_key_tag
    tag = backend_tag() if not user_tag else f"{user_tag}|{backend_tag()}"
    _XLA.append(xla)
    try:
        with functorch_config.patch(bundled_autograd_cache=True, force_non_lazy_backward_lowering=True), \
                compiler_config.patch(cache_key_tag=tag):
            yield
    finally:
        _XLA.pop()


def _load_options() -> bytes:
    """The XLA options a cached graph is rebuilt with: those of the backend call in progress, else
    (caching precompile: Dynamo loads its package without calling the backend) the options a call
    without `options=` gets, so the program key matches the one the saving process compiled."""
    if len(_XLA) > 1:
        return _XLA[-1]
    from torch_tpu._internal import compile as tpu_compile
    from torch_tpu._internal import xla_options

    return xla_options.encode({**tpu_compile.graph_defaults(), **xla_options.current()})


class TpuOutputCode(OutputCode):
    """A compiled tpu graph as AOTAutograd sees it: called boxed, picklable when the graph is one
    program without jax_op calls (split and op-by-op graphs bypass the cache)."""

    def __init__(self, fn: Callable[[list[Any]], Any]) -> None:
        from torch_tpu._internal.compile import _Program

        super().__init__()
        self._boxed_call = True
        self._fn: Callable[[list[Any]], Any] | None = fn
        # (desc, spec, constants) while compiled here; pickled bytes once prepared for the cache
        # (AOTAutograd deep-copies entries on save and load: bytes copy for free).
        self._payload: tuple[dict[str, Any], list, list[torch.Tensor]] | bytes | None = None
        if isinstance(fn, _Program) and not any(node.op == "jax_call" for node in fn.desc["nodes"]):
            self._payload = (fn.desc, fn.spec, fn.cpu_consts)

    def __deepcopy__(self, memo: dict[int, Any]) -> TpuOutputCode:
        # The program and the payload are never mutated (only replaced), so copies share them.
        new = copy.copy(self)
        memo[id(self)] = new
        return new

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
        if not isinstance(self._payload, bytes):
            desc, spec, consts = self._payload
            # options and precision are those in force when the entry is loaded
            desc = {k: v for k, v in desc.items() if k not in ("compile_options", "precision")}
            # AOTAutograd saves while its FakeTensorMode is active: a device constant's .cpu() would
            # be a fake tensor (unpicklable; the entry was dropped with a warning).
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                host = [c.cpu() for c in consts]
            self._payload = pickle.dumps((desc, spec, host), protocol=pickle.HIGHEST_PROTOCOL)
        self._fn = None

    def post_compile(self, example_inputs: Sequence[Any], constants: Any, graph_kwargs: Any) -> None:
        from torch_tpu._internal import compile as tpu_compile

        if self._fn is not None:  # compiled in this process
            return
        assert isinstance(self._payload, bytes)
        desc, spec, consts = pickle.loads(self._payload)  # noqa: S301 - our own cache entry
        tpu_compile._AOT_TIER[0] = "aot_cache"
        try:
            self._fn = tpu_compile._Program.rebuild({**desc, "compile_options": _load_options()}, spec, consts,
                                                    tpu_compile._tpu_device(example_inputs))
        finally:
            tpu_compile._AOT_TIER[0] = "traced"
        tpu_compile.STATS["graphs"] += 1
        tpu_compile.STATS["aot_cache_hits"] += 1

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass
