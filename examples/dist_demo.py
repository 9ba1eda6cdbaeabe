"""Tensor-parallel generate of a tiny Llama on 2 processes, one chip each (`make dist-demo`).

Either let this script start its 2 processes (torch_tpu.distributed.spawn), or run it yourself
with `torchrun --nproc-per-node 2 examples/dist_demo.py`: it only needs the torchrun env vars.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist


def demo(rank: int, path: str) -> None:
    import transformers as tf
    from transformers.distributed import DistributedConfig

    if not dist.is_initialized():
        dist.init_process_group()  # no backend: "tpu_dist" for tpu tensors
    model = tf.AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"))
    ids = torch.tensor([[1, 15, 27, 3, 42]], device="tpu")
    model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)  # warm-up: compiles
    t = time.perf_counter()
    out = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    ms = (time.perf_counter() - t) * 1e3 / 12
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    full = sum(p.numel() for p in model.parameters())
    print(f"rank {rank}/{dist.get_world_size()} on {model.device} ({torch.tpu.distributed.transport()}): "
          f"holds {local}/{full} parameters; tokens {out[0].tolist()}; {ms:.1f} ms/token", flush=True)
    if rank == 0:
        ref = tf.AutoModelForCausalLM.from_pretrained(path).to("tpu")
        same = ref.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)[0].tolist() == out[0].tolist()
        print(f"single-device generate gives the same tokens: {same}", flush=True)
    dist.destroy_process_group()


def make_model() -> str:
    import transformers as tf

    path = tempfile.mkdtemp(prefix="tpu_dist_demo_")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    tf.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _torchrun_entry() -> None:
    rank = int(os.environ["RANK"])
    path = [make_model() if rank == 0 else None]
    dist.init_process_group()
    dist.broadcast_object_list(path, src=0)
    demo(rank, str(path[0]))


if __name__ == "__main__":
    if "RANK" in os.environ:  # started by torchrun
        _torchrun_entry()
        sys.exit(0)
    import torch_tpu.distributed as tpu_dist

    tpu_dist.spawn(demo, nprocs=2, args=(make_model(),))
