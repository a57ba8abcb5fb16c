"""SDE windows (FlowGRPO-Fast, MixGRPO): where the stochastic steps of a version's rollouts lie."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from rayflow.learner.minibatches import minibatch_plan
from rayflow.rng import keyed_generator
from rayflow.sampling.window import window_params
from rayflow.types import SamplingParams


def windowed(schedule, size=3, window_range=(1, 7)):
    return SamplingParams(num_steps=8, sde_window_size=size, sde_window_range=list(window_range), sde_window_schedule=schedule)


def test_random_windows_cover_every_start_in_range_and_are_a_function_of_seed_and_version():
    params = windowed("random")
    starts = [window_params(params, 0, v).sde_step_indices[0] for v in range(200)]
    # flow_grpo's rule: start uniform in [lo, hi - size], window [start, start + size).
    assert set(starts) == {1, 2, 3, 4}
    assert all(window_params(params, 0, v).sde_step_indices == list(range(s, s + 3)) for v, s in enumerate(starts))
    assert starts == [window_params(params, 0, v).sde_step_indices[0] for v in range(200)]  # resumes exactly
    assert starts != [window_params(params, 1, v).sde_step_indices[0] for v in range(200)]  # another run, other windows
    resolved = window_params(params, 0, 5)
    assert resolved.sde_window_size is None and resolved.resolved_sde_steps() == resolved.sde_step_indices


DRAWS = """
import json
from rayflow.learner.minibatches import minibatch_plan, trained_subset
from rayflow.sampling.window import window_params
from rayflow.types import SamplingParams
params = SamplingParams(num_steps=8, sde_window_size=3, sde_window_range=[1, 7])
advantages = [0.0, 1.0, 0.0, -1.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0]  # 3 kept, topped up to 4
print(json.dumps({"windows": [window_params(params, 0, v).sde_step_indices[0] for v in range(50)],
                  "subsets": [trained_subset(advantages, 4, 0, v) for v in range(50)],
                  "plans": [minibatch_plan(8, 0, v, 2, 2) for v in range(5)]}))
"""


def test_draws_keyed_by_run_seed_and_version_are_the_same_in_every_process():
    # Python salts str hashes per process: a key holding a string ("sde-window", "zero-advantage") once
    # drew other windows and other zero-advantage samples in every run, so a run did not repeat, nor did
    # a resumed one continue as it would have. Two processes with different salts must draw the same.
    def draws(hash_seed: str) -> dict:
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", DRAWS], env=env, capture_output=True, text=True, check=True)
        return json.loads(out.stdout)

    first, second = draws("1"), draws("2")
    assert first == second
    assert len(set(first["windows"])) == 4 and len({tuple(s) for s in first["subsets"]}) > 1  # the draws vary by version


def test_the_minibatch_order_and_a_samples_nft_noise_are_drawn_from_different_streams():
    # Both were keyed (run seed, version, n): the epoch-0 order and the NFT draws of the sample of seed 0 came from one
    # stream. The sample's timestep draw is a randperm of its steps from its key's generator, as the order is.
    for version in range(4):
        nft_stream = torch.randperm(8, generator=keyed_generator(0, version, 0)).tolist()  # objective.nft_noise_and_steps' key
        first_half, second_half = minibatch_plan(8, 0, version, 1, 2)
        assert first_half + second_half != nft_stream


def test_fixed_and_sliding_windows():
    assert [window_params(windowed("fixed"), 0, v).sde_step_indices for v in (0, 7)] == [[1, 2, 3]] * 2
    # MixGRPO-style: one step later per version, back to lo after the last position (hi - size).
    assert [window_params(windowed("sliding"), 0, v).sde_step_indices[0] for v in range(6)] == [1, 2, 3, 4, 1, 2]


def test_no_window_keeps_the_parameters_and_an_unresolved_window_is_refused():
    plain = SamplingParams(num_steps=8)
    assert window_params(plain, 0, 3) is plain
    with pytest.raises(ValueError, match="resolve it first"):
        windowed("random").resolved_sde_steps()
    whole = dataclasses.replace(windowed("random", size=8), sde_window_range=None)  # no range: the whole schedule
    assert window_params(whole, 0, 3).sde_step_indices == list(range(8))
