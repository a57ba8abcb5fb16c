"""SDE windows: which denoising steps of a batch's rollouts sample stochastically (and are trained).

FlowGRPO-Fast places a window of `sde_window_size` consecutive stochastic steps at a random start in
`sde_window_range` per sampling batch (its pipelines: start uniform in [lo, hi − size], window
[start, start + size)); MixGRPO slides the window over training. Here the start is a pure function of
(run seed, policy version), so the reference trainer and the distributed driver place the same window
and a resumed run places it again.
"""

from __future__ import annotations

import dataclasses

import torch

from rayflow.rng import keyed_generator
from rayflow.types import SamplingParams


def window_bounds(params: SamplingParams) -> tuple[int, int]:
    """[lo, hi] the window lies in: sde_window_range, or the whole schedule [0, num_steps]."""
    if params.sde_window_range is None:
        return 0, params.num_steps
    lo, hi = params.sde_window_range
    return lo, hi


def window_start(params: SamplingParams, run_seed: int, version: int) -> int:
    """The window's first step at this version: "fixed" lo; "random" uniform in [lo, hi − size], drawn
    from (run seed, version); "sliding" lo + version mod (hi − size − lo + 1), one step further per version."""
    lo, hi = window_bounds(params)
    positions = hi - params.sde_window_size - lo + 1
    if params.sde_window_schedule == "fixed":
        return lo
    if params.sde_window_schedule == "sliding":
        return lo + version % positions
    g = keyed_generator(run_seed, version, "sde-window")
    return lo + int(torch.randint(positions, (1,), generator=g))


def window_params(params: SamplingParams, run_seed: int, version: int) -> SamplingParams:
    """The sampling parameters of rollouts started at `version`: with a window, its steps as
    sde_step_indices (and the window settings cleared, so the rollout carries the resolved steps);
    without one, `params` unchanged."""
    if params.sde_window_size is None:
        return params
    start = window_start(params, run_seed, version)
    return dataclasses.replace(params, sde_step_indices=list(range(start, start + params.sde_window_size)),
                               sde_window_size=None, sde_window_range=None)
