"""`run_ranks(fn, world, *args)`: `fn(rank, *args)` in `world` new processes at once (the ranks of a process group
that `fn` joins), their return values by rank. `FORKSERVER`: the multiprocessing context they fork from.

The processes fork from multiprocessing's forkserver, started once per test session with PRELOAD imported: a spawned
process imported torch and the model code again, about 10 s of CPU a rank on 2 cores, for a step of the tiny model.
torch.multiprocessing runs them: a rank that raises stops the others and its traceback is raised here.
"""

import multiprocessing
import os
import tempfile

import torch.multiprocessing

PRELOAD = ["torch", "torch.distributed.fsdp", "peft", "diffusers.pipelines.qwenimage.pipeline_qwenimage",
           "rayflow.learner.backend"]
"""What the ranks find imported: torch, FSDP2, peft, the tiny model's classes and the learner."""

multiprocessing.set_forkserver_preload(PRELOAD)  # before the server starts, at the first process forked from it
FORKSERVER = multiprocessing.get_context("forkserver")
"""For tests that start and stop their processes themselves (queues, kills): the same preloaded server."""


def _returning(rank: int, fn, args: tuple, directory: str) -> None:
    torch.save(fn(rank, *args), os.path.join(directory, f"{rank}.pt"))


def run_ranks(fn, world: int, *args) -> list:
    with tempfile.TemporaryDirectory() as directory:
        torch.multiprocessing.start_processes(_returning, args=(fn, args, directory), nprocs=world,
                                              start_method="forkserver")
        return [torch.load(os.path.join(directory, f"{rank}.pt"), weights_only=False) for rank in range(world)]
