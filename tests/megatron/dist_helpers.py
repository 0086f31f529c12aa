"""Run a function on N gloo ranks (fresh spawned processes) and get each rank's return value back.

`run_ranks(fn, world_size, *args)` -> [fn's return value on rank 0, rank 1, ...]. `fn(rank, *args)`
must be a module-level function (spawn pickles it by name). Return values travel through a file per
rank saved with `torch.save` and read back with `weights_only=True`: dicts, lists, tuples, tensors,
numbers, strings and None. A rank's exception is re-raised here with that rank's traceback.

Spawned processes, never the pytest process: megatron-core's parallel state and
`skyq.trainer.megatron.cpu_compat` (which patches `torch.cuda`) are global to a process.

No `__init__.py` in tests/megatron: with one, pytest's `tests/` path entry would make this folder a
regular package named `megatron` and hide megatron-core.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import torch

TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    import torch.distributed as dist

    warnings.filterwarnings("ignore", module=r"megatron\..*")
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine|transformer_engine).*")
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=TIMEOUT_S))
    out = Path(out_dir)
    try:
        result = fn(rank, *args)
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        dist.destroy_process_group()


class RankError(RuntimeError):
    """A spawned rank raised; the message carries its traceback."""


def run_ranks(fn, world_size: int, *args) -> list:
    """`fn(rank, *args)` on `world_size` gloo ranks; the list of their return values, by rank."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="skyq-megatron-") as out_dir:
        try:
            mp.spawn(_entry, args=(fn, world_size, _free_port(), out_dir, args), nprocs=world_size, join=True)
        except Exception as err:
            errors = sorted(Path(out_dir).glob("rank*.err"))
            if errors:
                raise RankError("\n".join(f"{e.stem}:\n{e.read_text()}" for e in errors)) from err
            raise
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=True) for r in range(world_size)]


def init_parallel(tp: int = 1, ep: int = 1, etp: int | None = None, pp: int = 1) -> None:
    """(Re-)initialise megatron-core's model-parallel groups on the current process group."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
