"""What users pass to torch.compile on tpu: modes, XLA options, custom_compiler_options, and the
torch.export -> StableHLO path."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch._dynamo
import torch_tpu
import torch_tpu.export
from torch._dynamo.exc import BackendCompilerFailed
from torch_tpu import _C


@pytest.fixture(autouse=True)
def _reset_dynamo() -> None:
    torch._dynamo.reset()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.LayerNorm(8))


@pytest.mark.parametrize("kwargs", [
    {"backend": "tpu", "mode": "reduce-overhead"},
    {"backend": "tpu", "mode": "max-autotune"},
    {"mode": "max-autotune-no-cudagraphs"},
    {"backend": "tpu", "options": {"xla_optimization_level": "O1", "xla_cpu_enable_fast_math": False}},
    {"options": {"xla_backend_optimization_level": 2}},
])
def test_modes_and_options_are_accepted_silently(kwargs: dict, caplog: pytest.LogCaptureFixture) -> None:
    m = _model().to("tpu")
    x = torch.randn(3, 4, device="tpu")
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING):
        warnings.simplefilter("error")
        out = torch.compile(m, **kwargs)(x)
    assert not [r for r in caplog.records if "ignoring" in r.getMessage()], caplog.text
    torch.testing.assert_close(out.cpu(), m(x).cpu(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    ({"mode": "fastest"}, "unknown torch.compile mode 'fastest'"),
    ({"options": {"opt_level": 3}}, "options are XLA options named xla_"),
    ({"options": {"xla_optimization_level": "O7"}}, "must be one of O0, O1, O2, O3"),
    ({"options": {"xla_no_such_flag": True}}, "No such compile option: 'xla_no_such_flag'"),
])
def test_bad_modes_and_options_say_what_to_do(kwargs: dict, match: str) -> None:
    m = _model().to("tpu")
    with pytest.raises((BackendCompilerFailed, ValueError, RuntimeError), match=match):
        torch.compile(m, backend="tpu", **kwargs)(torch.randn(3, 4, device="tpu"))
    assert m(torch.randn(2, 4, device="tpu")).shape == (2, 8)  # the process carries on


def test_options_are_part_of_the_program_key() -> None:
    m = _model().to("tpu")
    x = torch.randn(5, 4, device="tpu")
    torch.compile(m, backend="tpu")(x)
    before = torch_tpu.cache_stats()
    torch._dynamo.reset()
    torch.compile(m, backend="tpu", options={"xla_cpu_enable_fast_math": False})(x)
    after = torch_tpu.cache_stats()
    # Same graph, other options: not served by the first program.
    assert after["memory_hits"] == before["memory_hits"]


def test_custom_compiler_options_block() -> None:
    assert torch.tpu.compiler.custom_compiler_options is torch_tpu.compiler.custom_compiler_options
    m = _model().to("tpu")
    x = torch.randn(3, 4, device="tpu")
    with pytest.raises(BackendCompilerFailed, match="No such compile option"):
        with torch.tpu.compiler.custom_compiler_options({"xla_not_a_flag": 1}):
            torch.compile(m, backend="tpu")(x)
    torch._dynamo.reset()
    with torch.tpu.compiler.custom_compiler_options({"xla_optimization_level": "O3"}):
        out = torch.compile(m, backend="tpu")(x)
    torch.testing.assert_close(out.cpu(), m(x).cpu(), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="xla_"):
        with torch.tpu.compiler.custom_compiler_options({"fast": 1}):
            pass


def test_export_to_stablehlo_round_trip() -> None:
    m = _model().eval()
    x = torch.randn(3, 4)
    ep = torch.export.export(m, (x,))
    text = torch_tpu.export.exported_to_stablehlo(ep)
    assert "func.func public @main(" in text and "tensor<3x4xf32>" in text
    assert "tensor<3x8xf32>" in text.split("->", 1)[1].split("{", 1)[0]  # a shaped result
    _C._compile_mlir(text, "export round trip")  # the PJRT plugin compiles the text
    # The same description, run: the exported graph computes the model.
    desc = torch_tpu.export._describe(ep)
    gid = _C._graph_build(desc)
    state = {**ep.state_dict, **ep.constants}
    args = [state[s.target] if s.target in state else x for s in ep.graph_signature.input_specs]
    (out,) = torch.ops.torch_tpu.run_graph(gid, [a.to("tpu") for a in args])
    torch.testing.assert_close(out.cpu(), m(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="ExportedProgram"):
        torch_tpu.export.exported_to_stablehlo(m)  # type: ignore[arg-type]


def test_hf_generate_compile_config_reduce_overhead(caplog: pytest.LogCaptureFixture) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    m = transformers.LlamaForCausalLM(cfg).eval().to("tpu")
    ids = torch.randint(0, 64, (1, 5)).to("tpu")
    eager = m.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static")
    before = torch_tpu.compile_stats()
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING):
        warnings.simplefilter("error")
        out = m.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static",
                         compile_config=transformers.CompileConfig(mode="reduce-overhead"))
    assert not [r for r in caplog.records if "ignoring" in r.getMessage()], caplog.text
    assert torch_tpu.compile_stats()["programs"] > before["programs"]  # generate did compile
    assert torch.equal(out.cpu(), eager.cpu())
