"""The kernels-library repository torch_tpu ships (`build/torch-tpu/tpu_moe`): a ragged-dot MoE
experts layer and an RMSNorm layer, loaded locally (no Hub download).

    import kernels, torch_tpu.kernels_repo as repo
    repo.mark_transformers_layers()    # Transformers' experts / RMSNorm classes become kernel layers
    with kernels.use_kernel_mapping(repo.kernel_mapping()):
        model = kernels.kernelize(model, device="tpu", mode=kernels.Mode.INFERENCE)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["path", "kernel_mapping", "mark_transformers_layers", "transformers_kernel_config_mapping"]

# kernel_layer_name -> layer class in the repository
LAYERS = {"TpuMoEExperts": "MoEExperts", "RMSNorm": "RMSNorm"}


def path() -> Path:
    """The repository root (holds build/torch-tpu/)."""
    return Path(__file__).resolve().parent


def kernel_mapping(modes: Any = None) -> dict[str, Any]:
    """A kernels mapping {layer name: {"tpu": {mode: LocalLayerRepository}}} for this repository."""
    from kernels import LocalLayerRepository, Mode

    modes = modes if modes is not None else [Mode.INFERENCE, Mode.TRAINING, Mode.INFERENCE | Mode.TORCH_COMPILE,
                                             Mode.TRAINING | Mode.TORCH_COMPILE]
    return {name: {"tpu": {m: LocalLayerRepository(repo_path=path(), layer_name=cls) for m in modes}}
            for name, cls in LAYERS.items()}


def transformers_kernel_config_mapping() -> dict[str, dict[str, str]]:
    """The same mapping in Transformers' KernelConfig form (use_local_kernel=True)."""
    return {name: {"tpu": f"{path()}:{cls}"} for name, cls in LAYERS.items()}


_TRANSFORMERS_LAYERS = (
    ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeExperts", "TpuMoEExperts"),
    ("transformers.models.mixtral.modeling_mixtral", "MixtralExperts", "TpuMoEExperts"),
    ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeRMSNorm", "RMSNorm"),
    ("transformers.models.mixtral.modeling_mixtral", "MixtralRMSNorm", "RMSNorm"),
)


def mark_transformers_layers() -> list[type]:
    """Makes Transformers' Qwen3-MoE / Mixtral experts ("TpuMoEExperts") and RMSNorm ("RMSNorm")
    classes kernel layers. Transformers marks no experts class, and marks RMSNorm only when it
    accepts the installed kernels version (5.24 wants >= 0.18.2); forwards are unchanged until
    kernelize."""
    import importlib

    from kernels import replace_kernel_forward_from_hub

    marked = []
    for mod, cls, layer in _TRANSFORMERS_LAYERS:
        klass = getattr(importlib.import_module(mod), cls)
        if getattr(klass, "kernel_layer_name", None) != layer:
            replace_kernel_forward_from_hub(klass, layer)
        marked.append(klass)
    return marked
