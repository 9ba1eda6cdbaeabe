"""Transformers `from_pretrained(device_map=...)` through Accelerate on 2 emulated tpu chips:
placements ("tpu", "tpu:1", "auto", "balanced", max_memory) and outputs / greedy generation equal
to the CPU; `safetensors.torch.load_file(device="tpu")`."""

from __future__ import annotations

import pytest

from tests.conftest import run_python

pytest.importorskip("accelerate")

CODE = r"""
import json, tempfile, torch, transformers
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
ref_model = transformers.LlamaForCausalLM(cfg).eval()
d = tempfile.mkdtemp()
ref_model.save_pretrained(d)
ids = torch.tensor([[1, 5, 9, 3, 7]])
with torch.no_grad():
    ref = ref_model(ids).logits
    ref_gen = ref_model.generate(ids, max_new_tokens=4, do_sample=False)
out = {}
cases = {"tpu": dict(device_map="tpu"), "tpu:1": dict(device_map="tpu:1"), "auto": dict(device_map="auto"),
         "balanced": dict(device_map="balanced"),
         "max_memory": dict(device_map="auto", max_memory={0: "100KB", 1: "200KB", "cpu": "1GB"})}
for name, kw in cases.items():
    m = transformers.LlamaForCausalLM.from_pretrained(d, **kw)
    with torch.no_grad():
        logits = m(ids.to(m.device)).logits
        gen = m.generate(ids.to(m.device), max_new_tokens=4, do_sample=False)
    out[name] = {"err": (logits.cpu() - ref).abs().max().item(), "gen_equal": torch.equal(gen.cpu(), ref_gen),
                 "devices": sorted({str(p.device) for p in m.parameters()}),
                 "map": {k: str(v) for k, v in (getattr(m, "hf_device_map", None) or {}).items()}}
import safetensors.torch as st
st.save_file({"w": torch.arange(6.0)}, d + "/x.safetensors")
w = st.load_file(d + "/x.safetensors", device="tpu:1")["w"]
out["safetensors"] = [str(w.device), w.cpu().tolist()]
print("RESULT " + json.dumps(out))
"""


def test_device_maps_on_two_chips() -> None:
    import json

    r = run_python(CODE, env={"TORCH_TPU_NUM_DEVICES": "2"})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.split("RESULT ", 1)[1])
    print(json.dumps(res, indent=1))
    for name in ("tpu", "tpu:1", "auto", "balanced", "max_memory"):
        assert res[name]["err"] < 1e-5 and res[name]["gen_equal"], (name, res[name])
    assert set(res["tpu"]["devices"]) == {"tpu:0"}
    assert set(res["tpu:1"]["devices"]) == {"tpu:1"}
    for name in ("auto", "balanced", "max_memory"):
        m = res[name]["map"]
        assert set(res[name]["devices"]) == {"tpu:0", "tpu:1"}, res[name]
        assert set(m.values()) == {"0", "1"} and m["model.embed_tokens"] == "0" and m["lm_head"] == "1", m
    # max_memory caps chip 0 at 100 KB: fewer layers there than with "auto"
    n0 = lambda name: sum(v == "0" for v in res[name]["map"].values())  # noqa: E731
    assert n0("max_memory") < n0("auto")
    assert res["safetensors"] == ["tpu:1", [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]
