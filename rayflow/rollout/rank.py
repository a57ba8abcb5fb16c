"""One CFG-parallel rollout rank as a plain class: the model, its LoRA slot, its policy version, the loop.

The Ray actor (worker.py) only holds one of these and forwards calls; tests also run several in
threads of one process over an in-process group. Per request every rank of a replica runs

    start_rollout (validates: a bad request fails on every rank alike, before any collective)
    wait until the request's min_version is staged (RolloutRequest.min_version)
    agree on the newest version staged on all ranks -> apply it (a wait abandoned on any rank: VersionAbandoned on all)
    per step: CFG-parallel velocity (one all_gather, carrying each rank's newest staged version)
              -> advance(state, v, version) -> at the boundary, apply the newly agreed version
    decode: rank 0 alone, or every rank its share of the chunks (sampling.decode_batch_size, parallel_decode)
    rank 0: the trajectories; other ranks return None

so all ranks hold identical latents and record identical per-step versions. Weights (receive, verify,
stage, agree, load) are the rank's WeightReceiver's (rayflow.sync.receiver), whose docstring states the rules.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass

import torch
from diffusers.utils import logging as diffusers_logging
from transformers.utils import logging as transformers_logging

from rayflow.cfg.parallel import CFGParallel, Group, all_gather_header, parallel_decode
from rayflow.cfg.policy import CFGPolicy
from rayflow.models.lora import TRAINED_ADAPTER, adapter_parameters, target_weight_names
from rayflow.models.weight_sets import named_weights
from rayflow.models import DiffusionModel, load_configured
from rayflow.models.speed import apply_speed_options
from rayflow.distributed.placement import uses_cuda
from rayflow.distributed.process_group import CollectiveError, LeftGroup
from rayflow.rollout.spec import RolloutRankSpec
from rayflow.sync.receiver import VersionAbandoned, WeightReceiver
from rayflow.sampling.denoise import advance, finish_rollout, split_trajectories, start_rollout
from rayflow.types import RolloutRequest, Trajectory


@dataclass(frozen=True)
class SharedModel:
    """A model a rollout rank samples with but does not own: in colocated placement, the learner's, trained in place."""

    model: DiffusionModel
    slot: str
    """The weight set (rayflow.models.weight_sets) whose tensors the rollout samples with, which its owner makes the one
    the forward uses: the rollout adapter (LoRA), or "default", the parameters, holding the rollout weights (full)."""


class TimedGroup:
    """A group that adds up the seconds its all_gathers take (waiting for the slowest rank included).

    A replica of one rank gathers its own tensor without the backend. The backend's wait blocks the sampling thread
    at every step, however short the gather, and the forwards after it ran slower: on a 2-core VM a one-rank replica
    sampled 20-25% slower than the same denoising loop without the gather (README, Pipeline)."""

    def __init__(self, group: Group):
        self.group, self.rank, self.size = group, group.rank, group.size
        self.seconds = 0.0

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if self.size == 1:
            return [tensor.clone()]  # what the backend returns: a new tensor, equal to this one
        start = time.perf_counter()
        try:
            return self.group.all_gather(tensor)
        finally:
            self.seconds += time.perf_counter() - start


def request_tag(request: RolloutRequest) -> int:
    """A number every rank derives from the request alone, to check that all ranks run the same one."""
    return zlib.crc32(request.request_id.encode())


class RolloutRank:
    """Rank `rank` of a replica of `world_size` CFG-parallel ranks."""

    def __init__(self, spec: RolloutRankSpec, rank: int, world_size: int, shared: SharedModel | None = None):
        """`shared`: sample with a model another component owns and trains (colocated placement) instead of loading
        one; its slot is the adapter rollouts sample under, read as the parameters are now, and nothing is staged."""
        self.spec, self.rank, self.world_size = spec, rank, world_size
        torch.set_num_threads(spec.threads)
        # Loading bars of every rank would be forwarded to the driver's console.
        diffusers_logging.disable_progress_bar()
        transformers_logging.disable_progress_bar()
        self.device = torch.device("cuda" if uses_cuda() else "cpu")
        self.shared = shared
        if shared is not None:
            self.model = shared.model
        else:
            self._load_own_model()
        self.receiver = WeightReceiver(self._synced_weights, where=f"rollout rank {rank}/{world_size}")
        self.group: TimedGroup | None = None
        self.progress: tuple[str, int] | None = None
        """(request id, step) while a request is in flight."""
        self.out_of_step: str | None = None
        """Why this rank's collectives no longer pair with its peers' (it failed between two of a request's
        collectives); it then refuses every request (the host closes its group, so the peers fail theirs now)."""
        self.requests = self.steps = 0
        self.step_seconds = self.step_gather_seconds = 0.0

    def _load_own_model(self) -> None:
        spec, m = self.spec, self.spec.model
        self.model = load_configured(m, self.device)
        targets = spec.lora_targets or self.model.lora_target_modules
        params = dict(self.model.transformer.named_parameters())
        if spec.train_mode == "full":  # the base weights are version 0's
            self._synced = params
        elif spec.sync_mode == "lora":
            torch.manual_seed(spec.seed)  # the learner seeds the same way before add_lora (the A matrices are random)
            spec.add_lora_slot(self.model)
            self._synced = adapter_parameters(self.model.transformer, TRAINED_ADAPTER)
        else:
            # A LoRA starts as the identity (B = 0), so the base weights are version 0's merged weights.
            self._synced = {name: params[name] for name in target_weight_names(self.model.transformer, targets)}
        apply_speed_options(self.model, m.attention_backend, m.compile)

    def join(self, group: Group) -> None:
        if group.size != self.world_size or group.rank != self.rank:
            raise ValueError(f"group rank {group.rank}/{group.size} != this rank {self.rank}/{self.world_size}")
        self.group = TimedGroup(group)

    # --- weights -------------------------------------------------------------------------------

    def _synced_weights(self) -> dict[str, torch.Tensor]:
        """The tensors weight sync replaces: the LoRA slot's, or (merged mode) the adapted linears' weights, or (full
        fine-tuning) every transformer weight; on a shared model, its slot weight set (looked up each time: FSDP2
        swaps parameters when it gathers them)."""
        if self.shared is not None:
            return named_weights(self.model.transformer, self.shared.slot)
        return self._synced

    def get_adapter_weights(self) -> dict[str, torch.Tensor]:
        """The adapter the rank samples under, canonical names, CPU copies."""
        return {name: p.detach().cpu().clone() for name, p in self._synced_weights().items()}

    @property
    def version(self) -> int:
        """The applied weights' version."""
        return self.receiver.version

    def _header(self, tag: int) -> list[int]:
        return [self.receiver.newest(), tag]

    def _agree(self, headers: torch.Tensor, tag: int, apply: bool, held: int | None = None) -> None:
        """Check every rank runs this request, and holds version `held` (its min_version: VersionAbandoned on every
        rank alike if one's wait was abandoned); apply the newest version staged on all ranks if `apply`."""
        tags = headers[:, 1]
        if bool((tags != tag).any()):
            raise RuntimeError(
                f"rollout rank {self.rank}: the ranks of this replica run different requests (tags {tags.tolist()}); "
                f"requests must reach every rank in the same order"
            )
        if held is not None:
            # Decided on the gathered headers, not at the wait: a peer holding the version already is in this
            # collective, and this rank's next request would have paired with it.
            self.receiver.check_held(headers[:, 0].tolist(), held)
        self.receiver.agree(headers[:, 0].tolist(), apply)

    # --- sampling ------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, request: RolloutRequest, policy: CFGPolicy | None = None,
                 weights: dict[str, torch.Tensor] | None = None) -> list[Trajectory] | None:
        """Sample `request` with every rank of the group; rank 0 returns the trajectories, the others None.
        `weights`: tensors of the synced slot to sample this one request under (evaluating the EMA of
        trainer.ema_decay), the applied version's restored after it; no new version is applied meanwhile."""
        if self.out_of_step is not None:
            raise LeftGroup(self.out_of_step)
        if self.group is None:
            raise RuntimeError(f"rollout rank {self.rank} has not joined its group")
        policy = policy or self.spec.policy
        state = start_rollout(self.model, request, policy)  # encodes the prompts: needs none of the synced weights
        if request.min_version is not None:
            self.receiver.wait_for(request.min_version)  # abandoned, it returns unmet: check_held raises on every rank
        tag = request_tag(request)
        try:
            self._agree(all_gather_header(self.group, self._header(tag)), tag, apply=True, held=request.min_version)
            guidance = CFGParallel(self.group, len(state.branches), self.spec.batch_branches)
            with self.receiver.sampling_under(weights):
                return self._denoise(request, state, policy, tag, guidance, apply=weights is None)
        except Exception as e:
            # Raised on this rank alone (a forward, a version not staged here, ranks on different requests): its peers
            # wait in this request's next collective, which this rank's next request would pair with (the size
            # mismatch aborts a gloo process; NCCL does not check). VersionAbandoned is raised by every rank alike.
            if self.world_size > 1 and not isinstance(e, (CollectiveError, VersionAbandoned)):
                self.out_of_step = (f"rollout rank {self.rank}/{self.world_size} left its replica's group: request "
                                    f"{request.request_id!r} failed on it ({type(e).__name__}: {e})")
            raise

    def _denoise(self, request: RolloutRequest, state, policy: CFGPolicy, tag: int, guidance: CFGParallel,
                 apply: bool) -> list[Trajectory] | None:
        try:
            while not state.done:
                self.progress = (request.request_id, state.step)
                start, gathered = time.perf_counter(), self.group.seconds
                velocity, headers = guidance.velocity(self.model, state, policy, self._header(tag))
                self.step_gather_seconds += self.group.seconds - gathered
                advance(state, velocity, self.version)
                self._agree(headers, tag, apply=apply and self.spec.apply_at == "step")
                self.step_seconds += time.perf_counter() - start
                self.steps += 1
        finally:
            self.progress = None
        self.requests += 1
        if self.world_size > 1 and state.params.decode_batch_size:
            images = parallel_decode(self.group, self.model, state.latents, state.params)
            return split_trajectories(state, images) if self.rank == 0 else None
        # Every rank holds the same final latents: one decode is enough.
        return finish_rollout(self.model, state) if self.rank == 0 else None

    def timings(self) -> dict[str, float]:
        """Cumulative: requests, denoising steps, seconds in steps, and seconds of those in the step all_gather."""
        return {
            "requests": self.requests,
            "steps": self.steps,
            "step_s": self.step_seconds,
            "step_all_gather_s": self.step_gather_seconds,
        }
