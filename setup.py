"""Builds torch_tpu._C. Sources are globbed from csrc/; pjrt_c_api.h comes from the installed
xla-cpu-pjrt wheel (never vendored)."""

import glob
import importlib.util
import os

from setuptools import setup

# `import torch` would load an already installed torch_tpu through the torch.backends entry point
# (failing when its _C is stale or absent); building needs torch's headers only.
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
from torch.utils.cpp_extension import BuildExtension, CppExtension


def pjrt_include_dir() -> str:
    spec = importlib.util.find_spec("xla_plugins.xla_cpu_pjrt")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("pjrt_c_api.h comes from the xla-cpu-pjrt wheel: pip install xla-cpu-pjrt==0.0.1")
    return os.path.join(list(spec.submodule_search_locations)[0], "include")


def kineto_include_dir() -> str:
    # torch's PrivateUse1 profiler header includes Kineto's headers by their bare names.
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.submodule_search_locations
    return os.path.join(list(spec.submodule_search_locations)[0], "include", "kineto")


def xla_ffi_include_dirs() -> list[str]:
    # The XLA FFI C/C++ API headers (xla/ffi/api/*.h) ship in the jaxlib wheel; with them the host
    # kernels (csrc/runtime/ffi_kernels.cc) are built, without them the XLA paths are used.
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return []
    inc = os.path.join(list(spec.submodule_search_locations)[0], "include")
    return [inc] if os.path.exists(os.path.join(inc, "xla", "ffi", "api", "ffi.h")) else []


sources = sorted(glob.glob("csrc/**/*.cc", recursive=True))
ext = CppExtension(
    name="torch_tpu._C",
    sources=sources,
    include_dirs=[os.path.abspath("csrc"), pjrt_include_dir(), kineto_include_dir(), *xla_ffi_include_dirs()],
    extra_compile_args=["-std=c++20", "-O2", "-fvisibility=hidden", "-Wno-unused-parameter"],
    extra_link_args=["-ldl"],
)

# `make build` compiles in place (ninja, incremental); the editable install that registers the
# package and its torch.backends entry point sets TORCH_TPU_SKIP_EXT=1 to avoid a second build.
setup(
    ext_modules=[] if os.environ.get("TORCH_TPU_SKIP_EXT") == "1" else [ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
