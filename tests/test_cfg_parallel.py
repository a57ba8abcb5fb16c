"""CFG parallelism without Ray: W ranks as threads over an in-process group, a cheap fake model,
and the single-process sampler as the oracle, for many (W, N) including idle ranks (W > N)."""

import threading
import zlib
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from rayflow.cfg.parallel import (
    HEADER_LEN,
    CFGParallel,
    all_gather_header,
    dispatch_branches,
    pack,
    parallel_decode,
    slots_per_rank,
    unpack,
)
from rayflow.cfg.policy import CFGBranch, CFGPolicy, DualNegativeCFG, NoCFG
from rayflow.models.base import DiffusionModel, PromptEmbeds, Schedule
from rayflow.sampling.denoise import advance, decode_chunks, finish_rollout, generate, start_rollout
from rayflow.types import RolloutRequest, SamplingParams


class ThreadGroup:
    """`size` ranks as threads of this process; all_gather through shared slots and a barrier.
    Records what each rank sent."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots: list[torch.Tensor | None] = [None] * size
        self.sent: list[list[torch.Tensor]] = [[] for _ in range(size)]

    def rank(self, rank: int) -> "ThreadRank":
        return ThreadRank(self, rank)


class ThreadRank:
    def __init__(self, shared: ThreadGroup, rank: int):
        self.shared, self.rank, self.size = shared, rank, shared.size

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        s = self.shared
        s.slots[self.rank] = tensor.clone()
        s.sent[self.rank].append(tensor.clone())
        s.barrier.wait()
        out = [t.clone() for t in s.slots]
        s.barrier.wait()  # nobody overwrites a slot before every rank has read it
        return out


def run_ranks(size: int, fn) -> list:
    """fn(rank) on `size` threads; results in rank order; the first exception is re-raised."""
    results, errors = [None] * size, []

    def target(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001  (re-raised in the test thread)
            errors.append(e)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


class FakeModel(DiffusionModel):
    """A DiffusionModel of a few tensor ops: prompt-dependent, nonlinear, masks honoured. Counts forwards."""

    pipeline_class = "Fake"
    lora_target_modules = ()

    def __init__(self):
        self.device, self.dtype, self.transformer = torch.device("cpu"), torch.float32, None
        self.forward_batches: list[int] = []
        self.decode_batches: list[int] = []

    @classmethod
    def load(cls, path, device="cpu", dtype=torch.float32):
        return cls()

    @classmethod
    def size_multiple(cls):
        return 16

    def encode_prompt(self, prompts):
        embeds = []
        for p in prompts:
            g = torch.Generator().manual_seed(zlib.crc32(p.encode()))
            embeds.append(torch.randn(2 + len(p) % 5, 8, generator=g))
        return PromptEmbeds.pad(embeds)

    def prepare_latents(self, seeds, height, width):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        noise = torch.cat([torch.randn(1, (height // 16) * (width // 16), 4, generator=g) for g in gens])
        return noise, gens

    def schedule(self, num_steps, height, width, shift=None):
        sigmas = torch.linspace(1.0, 0.0, num_steps + 1)
        return Schedule(sigmas=sigmas, timesteps=sigmas[:-1] * 1000)

    def predict_velocity(self, latents, timestep, cond, height, width):
        self.forward_batches.append(latents.shape[0])
        mask = torch.ones(cond.embeds.shape[:2]) if cond.mask is None else cond.mask.float()
        c = (cond.embeds * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)  # [B, D]
        return torch.tanh(latents * (1 + c[:, None, :4]) + c[:, None, 4:] * timestep / 1000)

    def decode(self, latents, height, width):
        """Each image a function of its own latents (so a misplaced one shows). Counts images per decode."""
        self.decode_batches.append(latents.shape[0])
        value = (latents.abs().sum(dim=(1, 2)) * 997).floor() % 256  # [B]
        return value.to(torch.uint8)[:, None, None, None].expand(-1, height, width, 3).clone()

    def load_lora(self, path):
        raise NotImplementedError


@dataclass(frozen=True)
class MultiNegativeCFG(CFGPolicy):
    """2 + len(avoid) branches: v = u + s·(p − u) − Σ_j a_j·(q_j − u), to test N beyond 3."""

    name: ClassVar[str] = "multi_negative"
    avoid: tuple[str, ...] = ("blurry", "dark")

    def uses_guidance(self, scale):
        return True

    def conditioning_prompts(self, prompts, negative_prompt, scale):
        texts = super().conditioning_prompts(prompts, negative_prompt, scale)
        texts.update({f"avoid{j}": [q] * len(prompts) for j, q in enumerate(self.avoid)})
        return texts

    def build(self, conds, scale):
        return super().build(conds, scale) + [
            CFGBranch(f"avoid{j}", False, {"cond": conds[f"avoid{j}"]}) for j in range(len(self.avoid))
        ]

    def combine(self, preds, scale):
        p, u, *qs = preds
        weights = [0.5 + 0.25 * j for j in range(len(qs))]
        if self.parallel_arithmetic:
            out = scale * p + (1 - scale + sum(weights)) * u
            for a, q in zip(weights, qs):
                out = out - a * q
            return out
        out = u + scale * (p - u)
        for a, q in zip(weights, qs):
            out = out - a * (q - u)
        return out


def policy_with(num_branches: int, parallel_arithmetic: bool = False) -> CFGPolicy:
    if num_branches == 1:
        return NoCFG(parallel_arithmetic=parallel_arithmetic)
    if num_branches == 2:
        return CFGPolicy(parallel_arithmetic=parallel_arithmetic)
    if num_branches == 3:
        return DualNegativeCFG(parallel_arithmetic=parallel_arithmetic, avoid_prompt="ugly")
    avoid = tuple(f"avoid {j}" for j in range(num_branches - 2))
    return MultiNegativeCFG(parallel_arithmetic=parallel_arithmetic, avoid=avoid)


REQUEST = RolloutRequest(
    "r", ["a red apple", "a cat"], [0, 1], [0, 1], [3, 4], SamplingParams(height=32, width=48, num_steps=4)
)


def parallel_generate(model, request, policy, group, batch_branches=False):
    """The denoising loop of a CFG-parallel rank (as RolloutRank runs it, without weights)."""
    state = start_rollout(model, request, policy)
    guidance = CFGParallel(group, len(state.branches), batch_branches)
    while not state.done:
        velocity, _ = guidance.velocity(model, state, policy)
        advance(state, velocity, 0)
    return finish_rollout(model, state)


def run_parallel(world_size, policy, batch_branches=False):
    group = ThreadGroup(world_size)
    models = [FakeModel() for _ in range(world_size)]
    results = run_ranks(world_size, lambda r: parallel_generate(models[r], REQUEST, policy, group.rank(r), batch_branches))
    return results, models, group


@pytest.mark.parametrize("world_size", range(1, 7))
@pytest.mark.parametrize("num_branches", range(1, 7))
def test_dispatch_is_round_robin_and_covers_every_branch_once(world_size, num_branches):
    per_rank = [dispatch_branches(num_branches, world_size, r) for r in range(world_size)]
    assert sorted(i for mine in per_rank for i in mine) == list(range(num_branches))
    for r, mine in enumerate(per_rank):
        assert all(i % world_size == r for i in mine)
        assert len(mine) <= slots_per_rank(num_branches, world_size)
        assert (mine == []) == (r >= num_branches)


def test_dispatch_rejects_impossible_layouts():
    for args in [(0, 2, 0), (2, 0, 0), (2, 2, 2), (2, 2, -1)]:
        with pytest.raises(ValueError):
            dispatch_branches(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_unpack_is_bit_exact(dtype):
    slots = torch.randn(2, 3, 5, 7).to(dtype)
    header, back = unpack(pack([2**40 + 3, -5], slots), slots)
    assert header.tolist() == [2**40 + 3, -5] + [0] * (HEADER_LEN - 2)
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8), slots.view(torch.uint8))


def test_every_rank_gets_every_header_in_rank_order():
    group = ThreadGroup(3)
    headers = run_ranks(3, lambda r: all_gather_header(group.rank(r), [10 * r, 7]))
    for h in headers:
        assert h[:, :2].tolist() == [[0, 7], [10, 7], [20, 7]]


@pytest.mark.parametrize("parallel_arithmetic", [False, True])
@pytest.mark.parametrize("num_branches", range(1, 6))
@pytest.mark.parametrize("world_size", range(1, 6))
def test_equals_single_process_sampler(world_size, num_branches, parallel_arithmetic):
    policy = policy_with(num_branches, parallel_arithmetic)
    results, _, _ = run_parallel(world_size, policy)
    expected = generate(FakeModel(), REQUEST, policy)
    serial = generate(FakeModel(), REQUEST, policy_with(num_branches))
    assert len(expected) == 2 and (expected[0].log_probs != 0).any()
    for trajectories in results:  # every rank holds identical latents, not only rank 0
        for got, want, ref in zip(trajectories, expected, serial):
            # Same arithmetic as the oracle: bit for bit, whatever W.
            assert torch.equal(got.latents, want.latents) and torch.equal(got.log_probs, want.log_probs)
            # Parallel arithmetic against the serial order: equal to rounding.
            torch.testing.assert_close(got.latents, ref.latents, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(got.log_probs, ref.log_probs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("world_size,num_branches", [(2, 1), (4, 2), (5, 3)])
def test_idle_ranks_learn_the_shape_once_and_send_zeros(world_size, num_branches):
    _, models, group = run_parallel(world_size, policy_with(num_branches))
    steps = REQUEST.params.num_steps
    for r in range(world_size):
        if r < num_branches:
            assert len(models[r].forward_batches) == steps * len(dispatch_branches(num_branches, world_size, r))
            continue
        assert len(models[r].forward_batches) == 1  # one dummy forward for the whole request
        like = torch.zeros(1, 2, 6, 4)
        for payload in group.sent[r]:
            assert not unpack(payload, like)[1].any()


@pytest.mark.parametrize("world_size", [1, 2])
def test_batched_branches_run_one_forward_per_step_and_agree_to_rounding(world_size):
    policy = policy_with(3)
    results, models, _ = run_parallel(world_size, policy, batch_branches=True)
    # Rank 0 holds branches [0, 1, 2] (W=1) or [0, 2] (W=2): one forward of 3B or 2B per step.
    assert models[0].forward_batches == [2 * len(dispatch_branches(3, world_size, 0))] * REQUEST.params.num_steps
    for got, want in zip(results[0], generate(FakeModel(), REQUEST, policy)):
        torch.testing.assert_close(got.latents, want.latents, rtol=0, atol=1e-5)


@pytest.mark.parametrize("batch, size, expected", [
    (5, 0, [(0, 5)]), (5, 2, [(0, 2), (2, 4), (4, 5)]), (4, 2, [(0, 2), (2, 4)]), (3, 8, [(0, 3)]), (1, 1, [(0, 1)]),
])
def test_decode_chunks_are_consecutive_rows_of_the_given_size(batch, size, expected):
    assert [(c.start, c.stop) for c in decode_chunks(batch, size)] == expected


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("decode_batch_size", [1, 2, 3])
def test_ranks_share_the_decode_chunk_by_chunk_and_all_hold_the_single_process_images(world_size, decode_batch_size):
    """5 images: chunk j of decode_batch_size rows on rank j % W (idle ranks in the last round send zeros); every rank
    ends with the images one process decoding the same chunks in turn makes (`generate` with the same params)."""
    params = SamplingParams(height=16, width=32, num_steps=2, decode_batch_size=decode_batch_size)
    req = RolloutRequest("d", ["a red apple", "a cat", "a dog", "two suns", "a"], list(range(5)), list(range(5)),
                         [3, 4, 5, 6, 7], params)
    oracle_model = FakeModel()
    trajectories = generate(oracle_model, req, CFGPolicy())
    expected = torch.stack([t.image for t in trajectories])
    assert oracle_model.decode_batches == [c.stop - c.start for c in decode_chunks(5, decode_batch_size)]

    final = torch.stack([t.latents[-1] for t in trajectories])  # x_T of every sample: what every rank holds
    group, models = ThreadGroup(world_size), [FakeModel() for _ in range(world_size)]
    images = run_ranks(world_size, lambda r: parallel_decode(group.rank(r), models[r], final, params))
    chunks = decode_chunks(5, decode_batch_size)
    for r in range(world_size):
        assert torch.equal(images[r], expected)
        mine = [c for j, c in enumerate(chunks) if j % world_size == r]
        assert models[r].decode_batches == [c.stop - c.start for c in mine]
