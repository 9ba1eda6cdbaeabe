"""Multi-process tests of the tpu_dist backend: 2 real processes (like torchrun), one chip each.

One pool of workers runs all cases (tests/dist_pool.py); each case checks tpu results against
PyTorch on the CPU inside the workers (tests/dist_cases.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from dist_pool import REPO, Pool, free_port, rank_env


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    p = Pool(2)
    yield p
    p.close()


def test_process_model(pool: Pool) -> None:
    res = pool.ok("process_model")
    for r, x in enumerate(res):
        assert x["device_count"] == 1 and x["current"] == 0, x  # each process owns one chip: tpu:0
        assert x["local_rank"] == r
        assert "tpu_dist" in x["tpu_backend"], x


def test_collective_dtype_matrix(pool: Pool) -> None:
    res = pool.ok("collective_matrix", timeout=300)
    table = res[0]
    if os.environ.get("TORCH_TPU_DIST_TABLE"):
        print(json.dumps(table, indent=1))
    bad = {(c, d): v for r in res for c, row in r.items() for d, v in row.items() if v != "ok"}
    assert not bad, bad
    assert len(table) == 10 and all(len(row) == 10 for row in table.values())


def test_functional_collectives(pool: Pool) -> None:
    pool.ok("functional_collectives")


def test_zero_copy_collectives_do_not_leak(pool: Pool) -> None:
    pool.ok("zero_copy_safety")


def test_new_group(pool: Pool) -> None:
    assert pool.ok("new_group_subgroups") == [[0, 2], [1, 2]]


def test_object_collectives(pool: Pool) -> None:
    pool.ok("object_collectives")


def test_dtensor_ops(pool: Pool) -> None:
    pool.ok("dtensor_ops")


def test_tensor_parallel_colwise_rowwise_sequence(pool: Pool) -> None:
    pool.ok("tensor_parallel_mlp")


def test_ddp_matches_single_process(pool: Pool) -> None:
    losses = pool.ok("ddp_training")
    assert losses[0] == losses[1]


def test_fsdp2_and_bf16_policy_match_single_process(pool: Pool) -> None:
    res = pool.ok("fsdp2_training")
    if os.environ.get("TORCH_TPU_DIST_TABLE"):
        print(json.dumps(res[0]))


def test_dcp_save_load_sharded(pool: Pool) -> None:
    pool.ok("dcp_save_load")


def test_mismatched_shapes_raise_on_every_rank(pool: Pool) -> None:
    msgs = pool.ok("mismatched_shapes")
    assert msgs[0] == msgs[1]


def test_mismatched_dtypes_raise_on_every_rank(pool: Pool) -> None:
    pool.ok("mismatched_dtypes")


def test_cpu_tensor_on_tpu_group(pool: Pool) -> None:
    pool.ok("cpu_tensor_on_tpu_group")


def _launch(code: str, world: int = 2, timeout: int = 120) -> list[subprocess.CompletedProcess[str]]:
    port, port2 = free_port(), free_port()
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO,
                              env=rank_env(r, world, port, {"MASTER_PORT2": str(port2)}),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=timeout)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, ""))
    return out


def test_dead_rank_makes_the_others_raise() -> None:
    code = (
        "import datetime, os, time, torch, torch.distributed as dist\n"
        "dist.init_process_group('tpu_dist', timeout=datetime.timedelta(seconds=20))\n"
        "x = torch.ones(4, device='tpu'); dist.all_reduce(x)\n"
        "if dist.get_rank() == 1: os._exit(3)\n"
        "t = time.time()\n"
        "try:\n"
        "    dist.all_reduce(x)\n"
        "except Exception as e:\n"
        "    print('RAISED', round(time.time() - t, 1), type(e).__name__, str(e)[:200])\n"
        "os._exit(0)\n"
    )
    r0, r1 = _launch(code)
    assert r1.returncode == 3
    assert "RAISED" in r0.stdout, r0.stdout[-2000:]
    secs = float(r0.stdout.split("RAISED ")[1].split()[0])
    assert secs < 25, r0.stdout


def test_missing_master_addr_says_what_is_missing() -> None:
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    p = subprocess.run([sys.executable, "-c", "import torch.distributed as dist; dist.init_process_group('tpu_dist')"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "MASTER_ADDR" in p.stderr, p.stderr[-2000:]


def test_backend_string_forms() -> None:
    code = (
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('cpu:gloo,tpu:tpu_dist')\n"
        "x = torch.ones(3, device='tpu'); c = torch.ones(3)\n"
        "dist.all_reduce(x); dist.all_reduce(c)\n"
        "print('OUT', x.device.type, x.cpu().tolist(), c.tolist())\n"
        "dist.destroy_process_group()\n"
        "os.environ['MASTER_PORT'] = os.environ['MASTER_PORT2']  # a fresh store: no race with the old one\n"
        "dist.init_process_group('tpu')\n"
        "y = torch.ones(2, device='tpu'); dist.all_reduce(y); print('OUT2', y.cpu().tolist())\n"
        "dist.destroy_process_group()\n"
    )
    for r in _launch(code):
        assert "OUT tpu [2.0, 2.0, 2.0] [2.0, 2.0, 2.0]" in r.stdout, r.stdout[-3000:]
        assert "OUT2 [2.0, 2.0]" in r.stdout, r.stdout[-3000:]


@pytest.mark.parametrize("model", ["llama", "qwen3_moe", "mixtral"])
def test_hf_tp_plan_auto_matches_single_device(pool: Pool, model: str) -> None:
    res = pool.ok(f"hf_tp_{model}", timeout=300)
    if os.environ.get("TORCH_TPU_DIST_TABLE"):
        print(model, json.dumps(res[0]))
    assert res[0]["tokens"] == res[1]["tokens"]
    for x in res:
        assert x["tokens_equal"] and x["max_logit_diff"] < 1e-4
        assert x["bytes_per_process"] < 0.6 * x["bytes_full"], x  # each process holds its shard only


def test_diffusers_flux_tensor_parallel(pool: Pool) -> None:
    res = pool.ok("diffusers_tp_flux", timeout=300)
    if os.environ.get("TORCH_TPU_DIST_TABLE"):
        print(json.dumps(res[0]))
    for x in res:
        assert x["bytes_per_process"] < x["bytes_full"]


def test_diffusers_flux_pipeline_with_parallel_transformer(pool: Pool) -> None:
    pool.ok("diffusers_tp_flux_pipeline", timeout=300)


def test_compiled_tensor_parallel_splits_at_collectives(pool: Pool) -> None:
    res = pool.ok("compiled_tp_mlp", timeout=300)
    assert all(x["new_graphs_after_warmup"] == 0 and x["program_misses"] == 0 for x in res), res


def test_spawn_helper_and_torch_tpu_distributed_alias() -> None:
    code = (
        "import os, sys, torch, torch.distributed as dist\n"
        "def fn(rank, out):\n"
        "    dist.init_process_group()\n"
        "    x = torch.full((2,), float(rank + 1), device='tpu'); dist.all_reduce(x)\n"
        "    open(os.path.join(out, str(rank)), 'w').write(str(x.cpu().tolist()))\n"
        "    dist.destroy_process_group()\n"
        "if __name__ == '__main__':\n"
        "    import torch.tpu.distributed as td\n"
        "    assert td is torch.tpu.distributed and 'tpu_dist' in td.BACKEND_NAMES\n"
        "    td.spawn(fn, nprocs=2, args=(sys.argv[1],))\n"
    )
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "spawn_case.py")
        with open(script, "w") as f:
            f.write(code)
        env = dict(os.environ)
        env.pop("TORCH_TPU_NUM_DEVICES", None)
        p = subprocess.run([sys.executable, script, d], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 0, p.stderr[-3000:]
        for r in range(2):
            with open(os.path.join(d, str(r))) as f:
                assert f.read() == "[3.0, 3.0]"


def test_jax_op_sharded_over_processes(pool: Pool) -> None:
    pytest.importorskip("jax")
    pool.ok("jax_op_sharded", timeout=120)


def test_compiled_tp_decode_no_recompiles(pool: Pool) -> None:
    res = pool.ok("compiled_tp_decode", timeout=300)
    if os.environ.get("TORCH_TPU_DIST_TABLE"):
        print(json.dumps(res[0]))
