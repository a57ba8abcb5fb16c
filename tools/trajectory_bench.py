"""bench.py trajectories: one rollout request's trajectories through pickling as Ray moves them (protocol 5, large
buffers out of band), bytes and seconds, in one process on one thread.

The request is built by the rollout's own `split_trajectories` from batch tensors of the --shape's sizes (random
values: pickling does not look at them). Four ways of sending it, side by side:
  rows, torch pickle   each sample's tensors rows of the batch tensors, torch's own tensor pickling (before 2026-11-27)
  own, torch pickle    each sample's tensors in storage of their own (split_trajectories now)
  rows, raw bytes      rows, with rayflow.distributed.tensor_pickle's reduction
  own, raw bytes       both: what a rollout rank sends now
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import pickle
import statistics
import time

import torch

SHAPES = {
    # The tiny recipe (flowgrpo_tiny.yaml): 32x32 images, 4 latent tokens of 16 channels, 6 steps.
    "tiny": dict(batch=8, tokens=4, channels=16, steps=6, cond_tokens=8, cond_dim=32, image=32, cond_dtype="float32"),
    # The shapes base's recipes: 64x64, 64 tokens of 16 channels, 8 steps.
    "shapes": dict(batch=8, tokens=64, channels=16, steps=8, cond_tokens=40, cond_dim=32, image=64, cond_dtype="float32"),
    # Qwen-Image at 1024x1024 (the 8-GPU recipes' rollout.micro_batch_size of 8): 4096 tokens of 64 channels, 10 steps,
    # prompts of ~100 tokens of Qwen2.5-VL's 3584 in bf16.
    "qwen-image-1024": dict(batch=8, tokens=4096, channels=64, steps=10, cond_tokens=100, cond_dim=3584, image=1024,
                            cond_dtype="bfloat16"),
}
WAYS = ("rows, torch pickle", "own, torch pickle", "rows, raw bytes", "own, raw bytes")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="qwen-image-1024", choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=20)


def request_state(shape: dict):
    """A finished RolloutState of shape's sizes: every step captured, every step but the last stochastic."""
    from rayflow.models.base import Schedule
    from rayflow.sampling.denoise import RolloutState
    from rayflow.types import RolloutRequest, SamplingParams

    B, N, C, T = shape["batch"], shape["tokens"], shape["channels"], shape["steps"]
    # One prompt for the whole request, as a group's samples share it.
    positive, negative = (torch.randn(shape["cond_tokens"], shape["cond_dim"]).to(getattr(torch, shape["cond_dtype"]))
                          for _ in range(2))
    request = RolloutRequest("bench", ["a prompt"] * B, [0] * B, [0] * B, list(range(B)), SamplingParams(num_steps=T))
    sigmas = torch.linspace(1, 0, T + 1)
    return RolloutState(
        request=request, schedule=Schedule(sigmas=sigmas, timesteps=sigmas[:-1] * 1000), branches=[],
        conds={"positive": [positive] * B, "negative": [negative] * B}, latents=torch.randn(B, N, C), generators=[],
        sde_steps=frozenset(range(T - 1)), return_steps=frozenset(range(T + 1)), step=T,
        captured={i: torch.randn(B, N, C) for i in range(T + 1)}, means={i: torch.randn(B, N, C) for i in range(T - 1)},
        log_probs=[torch.randn(B) for _ in range(T)], versions=[0] * T,
    )


def as_batch_rows(trajectories: list) -> list:
    """The same trajectories with each sample's tensors rows of batch tensors (the layout before they were cloned)."""
    stacked = {name: torch.stack([getattr(t, name) for t in trajectories]) for name in ("latents", "log_probs", "means", "image")}
    return [dataclasses.replace(t, **{name: rows[b] for name, rows in stacked.items()}) for b, t in enumerate(trajectories)]


def timed(obj, raw_bytes: bool, repeats: int) -> dict:
    """Bytes (in band + out of band) and median seconds to pickle and to unpickle `obj` as Ray does."""
    import ray.cloudpickle

    from rayflow.distributed.tensor_pickle import reduce_tensor

    class Pickler(ray.cloudpickle.CloudPickler):
        dispatch_table = {torch.Tensor: reduce_tensor} if raw_bytes else {}

    def dumps():
        buffers, out = [], io.BytesIO()
        Pickler(out, protocol=5, buffer_callback=buffers.append).dump(obj)
        return out.getvalue(), buffers

    dump_s, load_s = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        data, buffers = dumps()
        dump_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        pickle.loads(data, buffers=buffers)
        load_s.append(time.perf_counter() - start)
    return {"bytes": len(data) + sum(memoryview(b).nbytes for b in buffers), "out_of_band_buffers": len(buffers),
            "pickle_s": statistics.median(dump_s), "unpickle_s": statistics.median(load_s)}


def run(args: argparse.Namespace) -> dict:
    from rayflow.sampling.denoise import split_trajectories

    torch.set_num_threads(1)
    shape = SHAPES[args.shape]
    state = request_state(shape)
    images = torch.randint(0, 256, (shape["batch"], shape["image"], shape["image"], 3), dtype=torch.uint8)
    own = split_trajectories(state, images)
    rows = as_batch_rows(own)
    tensor_bytes = sum(v.nbytes for t in own for v in (t.latents, t.log_probs, t.means, t.image))
    tensor_bytes += sum(v.nbytes for v in (own[0].timesteps, own[0].sigmas, own[0].sde_mask, own[0].versions,
                                           *own[0].conds.values()))  # shared by the request's samples
    ways = {way: timed(rows if way.startswith("rows") else own, way.endswith("raw bytes"), args.repeats) for way in WAYS}
    before, now = ways[WAYS[0]], ways[WAYS[-1]]
    return {
        "benchmark": "trajectories", "shape": {"name": args.shape, **shape}, "repeats": args.repeats,
        "tensor_bytes": tensor_bytes, "ways": ways,
        "now_against_before": {
            "bytes": now["bytes"] / before["bytes"],
            "pickle_s": now["pickle_s"] / before["pickle_s"], "unpickle_s": now["unpickle_s"] / before["unpickle_s"],
        },
        "note": "one request of shape.batch samples; tensor_bytes counts what the request holds (shared tensors once); "
                "seconds are medians, one thread, in one process (what a rollout rank pays to send and each receiver "
                "to read, before the object store's own copy)",
    }
