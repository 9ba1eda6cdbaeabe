"""Starting N processes with one chip each on this host (plain `torchrun` works as well)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """A TCP port that is free right now on 127.0.0.1 (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def transport() -> str:
    """Which path tpu collectives take in this process (docs/distributed.md)."""
    import torch

    platform = torch.tpu.get_device_properties().platform_name
    if platform == "cpu":
        return "gloo on the chip's buffers (CPU plugin: device memory is host memory, no copies)"
    return f"gloo, host-staged ({platform}: device->host copy, gloo collective, host->device copy)"


def _entry(rank: int, fn: Callable[..., Any], nprocs: int, port: int, args: tuple[Any, ...]) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
        MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"), MASTER_PORT=str(port),
    )
    fn(rank, *args)


def spawn(fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...] = (), *, join: bool = True,
          master_port: int | None = None) -> Any:
    """Run `fn(rank, *args)` in `nprocs` processes, each owning one chip seen as tpu:0.

    Sets RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT like torchrun, so
    `torch.distributed.init_process_group()` inside `fn` needs no arguments.
    """
    import torch.multiprocessing as mp

    port = master_port or free_port()
    return mp.start_processes(_entry, args=(fn, nprocs, port, args), nprocs=nprocs, join=join,
                              start_method="spawn")
