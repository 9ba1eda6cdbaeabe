"""The Hugging Face `kernels` library on tpu: backend detection, the local repository torch_tpu ships
(`torch_tpu/kernels_repo/build/torch-tpu/tpu_moe`), and kernelized Qwen3-MoE / Mixtral models whose
experts run two ragged dots, compared with the unkernelized model and with CPU eager."""

from __future__ import annotations

import pytest
import torch
import torch_tpu

kernels = pytest.importorskip("kernels")

import torch_tpu.kernels_repo as repo  # noqa: E402


def _tiny(kind: str) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common: dict = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, num_experts_per_tok=2, max_position_embeddings=64)
    if kind == "qwen3_moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, intermediate_size=128, moe_intermediate_size=32,
                                                  num_experts=4, decoder_sparse_step=1, norm_topk_prob=True))
    return MixtralForCausalLM(MixtralConfig(**common, intermediate_size=32, num_local_experts=4))


def test_backend_is_tpu_and_local_repo_loads() -> None:
    from kernels.backends import _backend

    assert hasattr(torch.backends, "tpu")
    assert _backend().name == "tpu"
    k = kernels.get_local_kernel(repo.path())
    assert (repo.path() / "build" / "torch-tpu" / "metadata.json").is_file()
    assert {"MoEExperts", "RMSNorm"} <= set(dir(k.layers))


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_kernelize_swaps_experts_and_norms(kind: str) -> None:
    repo.mark_transformers_layers()
    model = _tiny(kind).eval()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cpu_ref = model(input_ids=ids).logits
    model = model.to("tpu")
    with torch.no_grad():
        plain = model(input_ids=ids.to("tpu")).logits.cpu()
    with kernels.use_kernel_mapping(repo.kernel_mapping()):
        model = kernels.kernelize(model, device="tpu", mode=kernels.Mode.INFERENCE)
    layer = model.model.layers[0]
    assert layer.mlp.experts.forward.__func__.__qualname__ == "MoEExperts.forward"
    assert layer.input_layernorm.forward.__func__.__qualname__ == "RMSNorm.forward"
    torch_tpu.reset_fallback_stats()
    torch_tpu.synchronize()
    syncs = torch_tpu.dispatch_stats()["host_syncs"]
    with torch.no_grad():
        out = model(input_ids=ids.to("tpu")).logits
    assert torch_tpu.dispatch_stats()["host_syncs"] == syncs  # routing stays on the device
    assert torch_tpu.fallback_stats() == {}
    torch.testing.assert_close(out.cpu(), plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.cpu(), cpu_ref, atol=1e-4, rtol=1e-4)
    # float32 inference reads a cached [E, K, N] copy of the experts: changing the weights in place
    # refreshes it (the CPU model gets the same change)
    cpu_model = _tiny(kind).eval()
    with torch.no_grad():
        for m in (cpu_model, model):
            m.model.layers[0].mlp.experts.gate_up_proj.mul_(-0.5)
        torch.testing.assert_close(model(input_ids=ids.to("tpu")).logits.cpu(), cpu_model(input_ids=ids).logits,
                                   atol=1e-4, rtol=1e-4)


def test_transformers_kernel_config_mapping() -> None:
    """What Transformers' use_kernels=True does after its version check (it wants kernels >= 0.18.2,
    newer than PyPI's 0.17.2): a KernelConfig with local paths for "tpu", then kernelize."""
    from transformers import KernelConfig

    repo.mark_transformers_layers()
    model = _tiny("mixtral").eval().to("tpu")
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(2)).to("tpu")
    with torch.no_grad():
        ref = model(input_ids=ids).logits.cpu()
    kc = KernelConfig(repo.transformers_kernel_config_mapping(), use_local_kernel=True)
    kc.sanitize_kernel_mapping(model)
    kc.create_compatible_mapping(model)
    with kernels.use_kernel_mapping(kc.kernel_mapping, inherit_mapping=False):
        kernels.kernelize(model, device="tpu", mode=kernels.Mode.INFERENCE)
    assert model.model.layers[1].mlp.experts.forward.__func__.__qualname__ == "MoEExperts.forward"
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits.cpu(), ref, atol=1e-5, rtol=1e-5)


def test_kernelized_training_backward() -> None:
    repo.mark_transformers_layers()
    cpu = _tiny("qwen3_moe")
    tpu = _tiny("qwen3_moe").to("tpu")
    with kernels.use_kernel_mapping(repo.kernel_mapping()):
        kernels.kernelize(tpu, device="tpu", mode=kernels.Mode.TRAINING)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))
    cpu(input_ids=ids, labels=ids).loss.backward()
    tpu(input_ids=ids.to("tpu"), labels=ids.to("tpu")).loss.backward()
    g_cpu = cpu.model.layers[0].mlp.experts.gate_up_proj.grad
    g_tpu = tpu.model.layers[0].mlp.experts.gate_up_proj.grad.cpu()
    torch.testing.assert_close(g_tpu, g_cpu, atol=1e-4, rtol=1e-3)
