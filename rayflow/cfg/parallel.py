"""CFG parallelism: the CFG branches of one denoising step spread over the W ranks of a group.

Branch i runs on rank i % W (round robin). Every rank sends one all_gather payload holding its
predictions as K = ceil(N / W) slots [K, B, N_tok, C] (zero-padded when it has fewer than K
branches; all zeros on an idle rank, which ran one dummy forward per request only to learn the
prediction shape). Branch i is then gathered[i % W][i // W], so every rank holds every
prediction in branch order and combines them with the policy's own arithmetic: all ranks compute
the same guided velocity, bit for bit, for any W >= 1 and any N >= 1. Nothing here sums partial
results across ranks (an all-reduce of weighted terms is only right for one branch layout).

The VAE decode after the last step is shared too (`parallel_decode`): with sampling.decode_batch_size = n > 0 decode
chunk j (rows j·n … j·n + n − 1) runs on rank j % W, and one all_gather per round of W chunks hands every chunk to
every rank, so each holds the images one process decoding the same chunks in turn makes.

A small int64 header rides on the same payload (the caller's: e.g. the newest policy version a
rank holds, and a request tag), so agreeing on a step boundary costs no extra collective.

No Ray and no process groups here: `group` is anything with `rank`, `size` and
`all_gather(tensor) -> list[tensor]`, so this is tested with an in-process fake.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from rayflow.cfg.policy import CFGBranch, CFGPolicy
from rayflow.models.base import DiffusionModel, PromptEmbeds
from rayflow.sampling.denoise import RolloutState, branch_velocity, decode_chunks
from rayflow.types import SamplingParams

HEADER_LEN = 8
"""int64 header entries per payload: 64 bytes, so the predictions after it start cache-line
aligned, as a freshly allocated tensor does (kernels then take the same paths as in one process)."""


class Group(Protocol):
    rank: int
    size: int

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...


def dispatch_branches(num_branches: int, world_size: int, rank: int) -> list[int]:
    """The branches rank `rank` runs: i with i % world_size == rank, ascending (empty on an idle rank)."""
    if num_branches < 1 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"dispatch_branches: need num_branches >= 1 and 0 <= rank < world_size; "
            f"got {num_branches=}, {world_size=}, {rank=}"
        )
    return list(range(rank, num_branches, world_size))


def slots_per_rank(num_branches: int, world_size: int) -> int:
    """K: the most branches any rank runs, and so the slots every rank sends."""
    return math.ceil(num_branches / world_size)


def pack(header: Sequence[int], slots: torch.Tensor) -> torch.Tensor:
    """One uint8 payload: the header (int64, padded to HEADER_LEN) then the slots' raw bytes.

    Bytes keep any prediction dtype exact (bf16 included) next to exact int64 header values."""
    if len(header) > HEADER_LEN:
        raise ValueError(f"header of {len(header)} entries; at most {HEADER_LEN}")
    head = torch.zeros(HEADER_LEN, dtype=torch.int64)
    head[: len(header)] = torch.tensor(list(header), dtype=torch.int64)
    return torch.cat([head.to(slots.device).view(torch.uint8), slots.contiguous().view(-1).view(torch.uint8)])


def unpack(payload: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack`: (header [HEADER_LEN] int64, slots shaped and typed as `like`)."""
    split = HEADER_LEN * 8
    header = payload[:split].view(torch.int64)
    slots = payload[split:].view(like.dtype).view(like.shape)
    return header.cpu(), slots


def all_gather_header(group: Group, header: Sequence[int]) -> torch.Tensor:
    """Every rank's header, [W, HEADER_LEN] int64, without predictions (e.g. before a request's first step)."""
    payload = pack(header, torch.zeros(0, dtype=torch.uint8))
    return torch.stack([unpack(p, torch.zeros(0, dtype=torch.uint8))[0] for p in group.all_gather(payload)])


def batched_branch_velocity(
    model: DiffusionModel, state: RolloutState, branches: list[CFGBranch]
) -> list[torch.Tensor]:
    """Several branches in ONE forward of batch len(branches)·B, split back into [B, N, C] each.

    Faster than one forward per branch, but not bit-identical to it (a different batch size, and
    prompts of different lengths padded and masked)."""
    if any(set(b.kwargs) != {"cond"} for b in branches):
        raise ValueError("rollout.batch_branches supports branches whose only forward argument is `cond`")
    embeds = [e for b in branches for e in b.kwargs["cond"].unpadded()]
    p = state.params
    latents = state.latents.repeat(len(branches), *([1] * (state.latents.ndim - 1)))
    out = model.predict_velocity(latents, state.timestep, PromptEmbeds.pad(embeds), p.height, p.width)
    return list(out.split(state.latents.shape[0]))


class CFGParallel:
    """One rank's share of CFG-parallel guidance for one request.

    Create one per request (it caches the prediction shape after the first step) and call
    `velocity` once per denoising step on every rank of `group`, in the same order.
    """

    def __init__(self, group: Group, num_branches: int, batch_branches: bool = False):
        self.group = group
        self.num_branches = num_branches
        self.mine = dispatch_branches(num_branches, group.size, group.rank)
        self.num_slots = slots_per_rank(num_branches, group.size)
        self.batch_branches = batch_branches
        self._empty_slots: torch.Tensor | None = None  # [K, B, N, C] zeros, known after the first step

    def _forward(self, model: DiffusionModel, state: RolloutState) -> list[torch.Tensor]:
        branches = [state.branches[i] for i in self.mine]
        if self.batch_branches and len(branches) > 1:
            return batched_branch_velocity(model, state, branches)
        # One forward per branch, batch B: exactly what the single-process sampler runs.
        return [branch_velocity(model, state, b) for b in branches]

    @torch.no_grad()
    def velocity(
        self, model: DiffusionModel, state: RolloutState, policy: CFGPolicy, header: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's guided velocity [B, N, C] (identical on every rank) and every rank's header [W, HEADER_LEN]."""
        preds = self._forward(model, state)
        if self._empty_slots is None:
            # An idle rank has no prediction to copy the shape from: one dummy forward, once per request.
            like = preds[0] if preds else branch_velocity(model, state, state.branches[0])
            self._empty_slots = like.new_zeros((self.num_slots, *like.shape))
        slots = self._empty_slots.clone()
        for j, pred in enumerate(preds):
            slots[j] = pred
        headers, gathered = zip(*(unpack(p, slots) for p in self.group.all_gather(pack(header, slots))))
        W = self.group.size
        in_branch_order = [gathered[i % W][i // W] for i in range(self.num_branches)]
        return policy.combine(in_branch_order, state.params.guidance_scale), torch.stack(headers)


def parallel_decode(group: Group, model: DiffusionModel, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Final latents [B, N, C] (the same on every rank) -> images [B, H, W, 3] uint8 on every rank, each rank decoding
    the chunks j % W == rank of `params.decode_batch_size` rows (module docstring)."""
    chunks = decode_chunks(latents.shape[0], params.decode_batch_size)
    rows = chunks[0].stop  # images per chunk; a shorter last chunk is padded with zeros to this many
    W, images = group.size, []
    for first in range(0, len(chunks), W):
        slot = torch.zeros(rows, params.height, params.width, 3, dtype=torch.uint8, device=latents.device)
        if first + group.rank < len(chunks):  # an idle rank (a last round of fewer than W chunks) sends zeros
            mine = model.decode(latents[chunks[first + group.rank]], params.height, params.width)
            slot[: mine.shape[0]] = mine
        gathered = group.all_gather(slot)
        images += [gathered[k][: c.stop - c.start].cpu() for k, c in enumerate(chunks[first:first + W])]
    return torch.cat(images)
