"""The driver-loop simulator against step times worked out by hand, and its input checks."""

import dataclasses
import json
import os

import pytest

from rayflow.planning.simulator import (
    CostBasis, Costs, Shape, SimulationInputError, scaled_costs, simulate, size_cluster,
)
from rayflow.paths import recipe
from tools.simulate import main as simulate_main

ROLL, REWARD, TRAIN, PUSH, BCAST = 1.0, 0.1, 1.5, 0.05, 0.02
COSTS = Costs(rollout_request_s=ROLL, reward_request_s=REWARD, train_batch_s=TRAIN, push_s=PUSH, broadcast_s=BCAST)
# The default recipe's shape: 2 groups of 8 per batch, requests of 8 samples.
SHAPE = Shape(batch_size=16, group_size=8, micro_batch_size=8)


def test_synchronous_step_is_the_sum_of_its_phases():
    # One replica samples the two requests back to back; the first one's reward overlaps the second's
    # rollout, the last one's does not; then train, push, broadcast; the next batch starts after it.
    expected = 2 * ROLL + REWARD + TRAIN + PUSH + BCAST
    assert simulate(COSTS, SHAPE).step_s == pytest.approx(expected, rel=1e-12)
    # Two replicas sample in parallel; their two rewards queue on the one reward worker.
    two = Shape(batch_size=16, group_size=8, micro_batch_size=8, replicas=2)
    assert simulate(COSTS, two).step_s == pytest.approx(ROLL + 2 * REWARD + TRAIN + PUSH + BCAST, rel=1e-12)
    with_workers = Shape(batch_size=16, group_size=8, micro_batch_size=8, replicas=2, reward_workers=2)
    assert simulate(COSTS, with_workers).step_s == pytest.approx(ROLL + REWARD + TRAIN + PUSH + BCAST, rel=1e-12)


@pytest.mark.parametrize("roll, train", [(1.0, 1.5), (1.0, 0.4)])
def test_asynchronous_steady_state_is_the_slower_of_rollout_and_training(roll, train):
    # With one step of staleness allowed, rollout of batch v+1 overlaps training on batch v: the step is
    # bounded by whichever of the two pipelines is slower (the learner also pushes after each batch).
    costs = Costs(rollout_request_s=roll, reward_request_s=0.0, train_batch_s=train, push_s=PUSH,
                  overhead_request_s=0.05, overhead_batch_s=0.1)
    shape = Shape(batch_size=16, group_size=8, micro_batch_size=8, max_staleness=1)
    p = simulate(costs, shape, steps=60)
    # The orchestration's overheads ride on their paths: per request on the replica, per batch on the learner.
    assert p.step_s == pytest.approx(max(2 * (roll + 0.05), train + 0.1 + PUSH), rel=1e-9)
    assert 0 < p.staleness_mean <= 1 and p.regenerated == 0
    idle_side = p.rollout_idle if train + PUSH > 2 * roll else p.learner_idle
    assert idle_side > 0.1  # the faster side waits


def test_idle_shares_and_staleness_are_those_of_the_steady_state_even_in_a_short_run():
    """Rollout of a batch 4 s (two requests of 8 on one replica, 2 s each), training 1 s, staleness 1: in the steady
    state a batch's first group starts as the batch before it is formed (one version behind when it trains) and its
    second group after that batch's push (current): staleness 0.5; the learner idles 1 − 1/4 of each 4-s step, the
    replica never. Over 8 versions the first (the pipeline filling: the learner idle, staleness 0) would drag both
    figures off (0.44 and 0.76); it is left out, as for the step time."""
    costs = Costs(rollout_request_s=2.0, reward_request_s=0.0, train_batch_s=1.0)
    p = simulate(costs, Shape(batch_size=16, group_size=8, micro_batch_size=8, max_staleness=1), steps=8)
    assert p.step_s == pytest.approx(4.0) and p.staleness_mean == pytest.approx(0.5)
    assert p.learner_idle == pytest.approx(0.75) and p.rollout_idle == pytest.approx(0.0, abs=1e-9)


def test_processor_sharing_conserves_work_on_one_core():
    # On one core nothing truly overlaps: a step costs the sum of all its work, whatever the staleness.
    costs = Costs(rollout_request_s=ROLL, reward_request_s=REWARD, train_batch_s=TRAIN, push_s=PUSH)
    for staleness in (0, 1):
        shape = Shape(batch_size=16, group_size=8, micro_batch_size=8, max_staleness=staleness, cores=1)
        assert simulate(costs, shape, steps=60).step_s == pytest.approx(2 * (ROLL + REWARD) + TRAIN + PUSH, rel=1e-6)
    # Two cores and two replicas: the rollouts overlap fully again.
    two = Shape(batch_size=16, group_size=8, micro_batch_size=8, replicas=2, reward_workers=2, cores=2)
    assert simulate(costs, two).step_s == pytest.approx(ROLL + REWARD + TRAIN + PUSH, rel=1e-9)


def test_a_request_smaller_than_micro_batch_costs_its_share():
    # Groups of 6 in requests of 4: a request of 4 and one of 2 (half the cost).
    shape = Shape(batch_size=6, group_size=6, micro_batch_size=4)
    costs = Costs(rollout_request_s=1.0, reward_request_s=0.0, train_batch_s=1.0)
    assert simulate(costs, shape).step_s == pytest.approx(1.0 + 0.5 + 1.0, rel=1e-12)


def test_sizing_scales_costs_and_lists_every_valid_split_fastest_first():
    basis = CostBasis(batch_size=64, micro_batch_size=8, learner_ranks=4, gpus_per_replica=2)
    scaled = scaled_costs(COSTS, basis, batch_size=128, micro_batch_size=4, learner_ranks=8)
    assert scaled.rollout_request_s == ROLL / 2 and scaled.reward_request_s == REWARD / 2
    assert scaled.train_batch_s == pytest.approx(TRAIN * 2 * 4 / 8)
    shape = Shape(batch_size=64, group_size=16, micro_batch_size=8, max_staleness=1)
    splits = size_cluster(COSTS, basis, shape, gpus=8, learner_micro_batch=4)
    # 8 GPUs: 1, 2 or 3 replicas of 2 leave 6, 4 or 2 learner ranks; 6 does not divide 64 / 4.
    assert sorted((s.replicas, s.learner_ranks) for s in splits) == [(2, 4), (3, 2)]
    assert [s.prediction.step_s for s in splits] == sorted(s.prediction.step_s for s in splits)
    with pytest.raises(SimulationInputError, match="gpus: got 2; allowed: at least 3"):
        size_cluster(COSTS, basis, shape, gpus=2)


def test_cluster_sizing_lists_only_the_learner_ranks_the_config_takes_with_several_minibatches(capsys):
    """algorithm.num_minibatches = 8 cuts the 8-GPU recipe's batch of 64 into mini-batches of 8: the config refuses
    4 ranks (2 samples a rank, not a multiple of learner.micro_batch_size = 4), which sizing listed first."""
    from rayflow.config import load_config
    from rayflow.errors import ConfigError
    from rayflow.paths import REPO_ROOT

    big = recipe("flowgrpo_qwen_image_8gpu.yaml")
    assert simulate_main(["--costs", f"{REPO_ROOT}/cluster/costs/qwen_image_h100_measured.json", "--config", big,
                          "--gpus", "8", "--staleness", "0", "--top", "10", "algorithm.num_minibatches=8",
                          "learner.world_size=2"]) == 0
    listed = [line.split(":")[1].split(",")[0].strip() for line in capsys.readouterr().out.splitlines()[1:]]
    assert listed == ["6x1 roll + 2 lrn", "7x1 roll + 1 lrn"]
    for ranks in (1, 2):
        load_config(big, ["algorithm.num_minibatches=8", f"learner.world_size={ranks}"])
    with pytest.raises(ConfigError, match="learner.micro_batch_size"):
        load_config(big, ["algorithm.num_minibatches=8", "learner.world_size=4"])


@pytest.mark.parametrize("data, message", [
    ({"rollout_request_s": 1.0, "reward_request_s": 0.1}, "missing cost 'train_batch_s'"),
    ({"rollout_request_s": 1.0, "reward_request_s": 0.1, "train_batch_s": -1}, "train_batch_s: got -1"),
    ({"rollout_request_s": 0, "reward_request_s": 0.1, "train_batch_s": 1}, "rollout_request_s: got 0; allowed: seconds > 0"),
    ({"rollout_request_s": 1, "reward_request_s": 0.1, "train_batch_s": 1, "learner_s": 2}, "unknown cost 'learner_s'"),
])
def test_bad_costs_are_named(data, message):
    with pytest.raises(SimulationInputError, match=message):
        Costs.from_dict(data)


def test_bad_shapes_are_named():
    with pytest.raises(SimulationInputError, match="replicas: got 0; allowed: an integer >= 1"):
        Shape(batch_size=16, group_size=8, micro_batch_size=8, replicas=0)
    with pytest.raises(SimulationInputError, match="batch_size: got 12; allowed: a multiple of group_size"):
        Shape(batch_size=12, group_size=8, micro_batch_size=8)


def test_cli_predicts_from_a_cost_file_and_names_a_missing_basis(tmp_path, capsys):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"benchmark": "costs", "rollout_request_s": ROLL, "reward_request_s": REWARD,
                                 "train_batch_s": TRAIN, "setup": {}}))
    args = ["--costs", str(costs), "--config", recipe("flowgrpo_tiny.yaml")]
    assert simulate_main([*args, "--replicas", "1", "2", "--staleness", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out[1:]] == ["replicas=1", "replicas=2"]
    # The default recipe: 2 requests of 8 per batch on one replica.
    assert float(out[1].split()[2]) == pytest.approx(2 * ROLL + REWARD + TRAIN, abs=1e-3)
    assert simulate_main([*args, "--gpus", "8"]) == 2
    assert "--gpus needs a \"basis\"" in capsys.readouterr().err


def test_the_measured_h100_costs_size_the_8_gpu_recipe_as_worked_out_by_hand(capsys):
    """cluster/costs/qwen_image_h100_measured.json (README, Simulator) on the 8-GPU recipe, synchronous: 4 W = 1
    replicas take the batch's 8 requests of 8 two at a time; 4 learner ranks train 64 samples at the measured
    19.49 s per 4 samples on one rank."""
    from rayflow.paths import REPO_ROOT

    path = f"{REPO_ROOT}/cluster/costs/qwen_image_h100_measured.json"
    with open(path) as f:
        c = json.load(f)
    assert simulate_main(["--costs", path, "--config", recipe("flowgrpo_qwen_image_8gpu.yaml"), "--gpus", "8",
                          "--staleness", "0", "--top", "1"]) == 0
    (line,) = capsys.readouterr().out.splitlines()[1:]
    assert line.startswith("8 GPUs: 4x1 roll + 4 lrn, s=0")
    train = c["train_batch_s"] * 64 / 4 / 4
    by_hand = 2 * (c["rollout_request_s"] + c["overhead_request_s"]) + c["reward_request_s"] + train + c["push_s"] + c["broadcast_s"]
    assert float(line.split()[-6]) == pytest.approx(by_hand, rel=0.01)


def test_without_gpus_a_cost_files_basis_is_scaled_to_the_configs_shape(capsys):
    """Without --gpus the basis was ignored: the H100 file's 19.49 s for 4 samples on one learner rank was taken as the
    8-GPU recipe's whole batch of 64 on 4 ranks (33 s a step at staleness 1, rollout-bound), where --gpus predicts the
    same split at 78 s (learner-bound). A replica of another size than the basis' has no rule: refused."""
    from rayflow.paths import REPO_ROOT

    measured = f"{REPO_ROOT}/cluster/costs/qwen_image_h100_measured.json"
    big = recipe("flowgrpo_qwen_image_8gpu.yaml")
    assert simulate_main(["--costs", measured, "--config", big, "--gpus", "6", "--staleness", "1", "--top", "1"]) == 0
    (split,) = capsys.readouterr().out.splitlines()[1:]
    assert split.startswith("6 GPUs: 2x1 roll + 4 lrn, s=1")  # the recipe's 2 replicas and 4 learner ranks
    assert simulate_main(["--costs", measured, "--config", big, "--staleness", "1", "rollout.cfg_parallel_size=1"]) == 0
    (line,) = capsys.readouterr().out.splitlines()[1:]
    assert line.split()[2:] == split.split()[-6:]
    assert simulate_main(["--costs", measured, "--config", big]) == 2
    assert ("rollout.cfg_parallel_size: got 2; allowed: 1, the GPUs per replica the costs of --costs"
            in capsys.readouterr().err)


def test_the_cli_takes_overrides_after_a_list_option_and_names_a_bad_basis(tmp_path, capsys):
    """The README adds `algorithm.prompts_per_step=32 reward.num_workers=8` after `--staleness 0 1`; a basis of 0
    GPUs per replica divided by zero."""
    measured = os.path.join(os.path.dirname(recipe("flowgrpo_tiny.yaml")), "..", "cluster", "costs",
                            "qwen_image_h100_measured.json")
    big = recipe("flowgrpo_qwen_image_8gpu.yaml")
    assert simulate_main(["--costs", measured, "--config", big, "--gpus", "64", "--staleness", "0", "1",
                          "algorithm.prompts_per_step=32", "reward.num_workers=8", "--top", "1"]) == 0
    assert "64 GPUs: 32x1 roll + 32 lrn, s=1    78.460      6.53" in capsys.readouterr().out
    with open(measured) as f:
        data = json.load(f)
    data["basis"]["gpus_per_replica"] = 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    assert simulate_main(["--costs", str(bad), "--config", big, "--gpus", "8"]) == 2
    assert "basis.gpus_per_replica: got 0; allowed: an integer >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        simulate_main(["--costs", measured, "--top", "0"])
    assert "--top: got 0; allowed: an integer >= 1" in capsys.readouterr().err


def test_a_calibration_the_model_cannot_match_is_reported_not_passed_off_as_fitted():
    """bench.py simulator fits each overhead so that the model's step equals a real run's. When the model with no
    overhead is already slower than the real step, the bisection returned about 0 silently, and the JSON showed it as a
    fitted figure: now it says the calibration did not match, with both step times, and the bench prints a warning."""
    from tools.sim_bench import Calibration, _calibrate

    at_zero = simulate(COSTS, SHAPE).step_s
    fitted = _calibrate(COSTS, SHAPE, at_zero + 0.4, "overhead_request_s")
    assert fitted.matched and fitted.warning() is None and fitted.value > 0
    assert simulate(dataclasses.replace(COSTS, overhead_request_s=fitted.value), SHAPE).step_s == pytest.approx(at_zero + 0.4)
    unmatched = _calibrate(COSTS, SHAPE, at_zero / 2, "overhead_request_s")
    assert unmatched == Calibration("overhead_request_s", 0.0, at_zero / 2, at_zero, matched=False)
    assert unmatched.warning() == (f"warning: overhead_request_s could not be calibrated: with no overhead the model's "
                                   f"step is already longer than the real one (model {at_zero:.4f} s, real "
                                   f"{at_zero / 2:.4f} s); it is left at 0.0000 s, and the predictions carry the "
                                   f"difference")
