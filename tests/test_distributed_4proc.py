"""tpu_dist with 4 real processes: collectives, a 2-D (FSDP x TP) mesh, Transformers tp_plan."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest
from dist_pool import Pool


@pytest.fixture(scope="module")
def pool4() -> Iterator[Pool]:
    p = Pool(4)
    yield p
    p.close()


def test_collective_dtype_matrix_4_processes(pool4: Pool) -> None:
    res = pool4.ok("collective_matrix", timeout=300)
    bad = {(c, d): v for r in res for c, row in r.items() for d, v in row.items() if v != "ok"}
    assert not bad, bad


def test_fsdp_x_tp_2d_mesh_matches_single_process(pool4: Pool) -> None:
    losses = pool4.ok("fsdp_x_tp_2d", timeout=300)
    if os.environ.get("TORCH_TPU_DIST_TABLE"):
        print(json.dumps(losses[0]))
    assert all(x == losses[0] for x in losses)


def test_hf_tp_plan_llama_4_processes(pool4: Pool) -> None:
    res = pool4.ok("hf_tp_llama", timeout=300)
    if os.environ.get("TORCH_TPU_DIST_TABLE"):
        print(json.dumps(res[0]))
    for x in res:
        assert x["tokens_equal"] and x["max_logit_diff"] < 1e-4
        assert x["bytes_per_process"] < 0.4 * x["bytes_full"], x
