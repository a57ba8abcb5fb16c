"""Predict a run's step time, throughput, idle shares and staleness from measured costs, without running it.

    # shapes of a recipe on this machine, from costs measured here (tools/bench.py costs --json costs.json)
    python tools/simulate.py --costs costs.json --config recipes/flowgrpo_tiny.yaml --replicas 1 2 --staleness 0 1 --cores 2

    # size a GPU cluster: every split of N GPUs into rollout replicas and learner ranks
    python tools/simulate.py --costs cluster/costs/qwen_image_h100_measured.json \
        --config recipes/flowgrpo_qwen_image_8gpu.yaml [overrides, e.g. algorithm.prompts_per_step=32] --gpus 8 64 --staleness 0 1

The model is rayflow/planning/simulator.py (the driver's admission, least-loaded dispatch, round-robin
rewards, staleness bound and weight sync, as an event simulation); a cost file is the JSON that
tools/bench.py costs writes, or one written by hand for GPUs (its "basis" says what its figures are for).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # rayflow, however this is run

from rayflow.config import load_config, split_overrides  # noqa: E402
from rayflow.errors import ConfigError  # noqa: E402
from rayflow.planning.simulator import (  # noqa: E402
    CostBasis, Costs, Shape, SimulationInputError, scaled_costs, simulate, size_cluster,
)


def read_costs(path: str) -> tuple[Costs, CostBasis | None]:
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise SimulationInputError(f"--costs {path!r}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise SimulationInputError(f"--costs {path!r}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise SimulationInputError(f"--costs {path!r}: not a JSON object")
    basis = data.get("basis")
    if basis is not None:
        try:
            basis = CostBasis(**basis)
        except TypeError as e:
            raise SimulationInputError(
                f"--costs {path!r}: basis: {e}; allowed keys: batch_size, micro_batch_size, learner_ranks, gpus_per_replica"
            ) from None
        for key, value in basis.__dict__.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SimulationInputError(f"--costs {path!r}: basis.{key}: got {value!r}; allowed: an integer >= 1")
    known = {"benchmark", "basis", "note", "setup"}
    return Costs.from_dict({k: v for k, v in data.items() if k not in known}, source=f"--costs {path!r}"), basis


def config_costs(costs: Costs, basis: CostBasis, cfg, path: str) -> Costs:
    """A basis' costs at the config's batch, request size and learner.world_size. Replicas of another size than the
    basis' are refused: the model has no rule for a rollout split over more or fewer CFG-parallel GPUs."""
    if cfg.rollout.cfg_parallel_size != basis.gpus_per_replica:
        raise SimulationInputError(
            f"rollout.cfg_parallel_size: got {cfg.rollout.cfg_parallel_size}; allowed: {basis.gpus_per_replica}, the "
            f"GPUs per replica the costs of --costs {path!r} were measured for (basis.gpus_per_replica); or size "
            f"splits of such replicas with --gpus")
    return scaled_costs(costs, basis, cfg.algorithm.batch_size, cfg.rollout.micro_batch_size, cfg.learner.world_size)


def row(label: str, p) -> str:
    return (f"{label:<28} {p.step_s:>9.3f} {p.images_per_s:>9.2f} {p.rollout_idle:>8.0%} {p.learner_idle:>8.0%} "
            f"{p.staleness_mean:>9.2f} {p.regenerated:>6}")


HEADER = f"{'shape':<28} {'step s':>9} {'images/s':>9} {'roll idle':>8} {'lrn idle':>8} {'staleness':>9} {'regen':>6}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--costs", required=True, help="a cost JSON (tools/bench.py costs, or cluster/costs/*.json)")
    parser.add_argument("--config", default=None, help="a recipe YAML: batch, group, request size, reward workers")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the recipe")
    parser.add_argument("--replicas", type=int, nargs="+", default=None, help="rollout replicas (default: the config's)")
    parser.add_argument("--staleness", type=int, nargs="+", default=None, help="async.max_staleness (default: the config's)")
    parser.add_argument("--cores", type=float, default=None, help="CPU cores the actors share (default: a device per actor)")
    parser.add_argument("--gpus", type=int, nargs="+", default=None, help="size clusters of these GPU counts instead")
    parser.add_argument("--steps", type=int, default=60, help="versions simulated (the first 5 are left out)")
    parser.add_argument("--top", type=int, default=3, help="splits shown per GPU count and staleness")
    rest, overrides = split_overrides(sys.argv[1:] if argv is None else argv)  # after `--staleness 0 1` too
    args = parser.parse_args(rest)
    args.overrides = overrides
    if args.top < 1:
        parser.error(f"--top: got {args.top}; allowed: an integer >= 1")
    try:
        cfg = load_config(args.config, args.overrides)
        costs, basis = read_costs(args.costs)
        base = Shape(
            batch_size=cfg.algorithm.batch_size, group_size=cfg.algorithm.group_size,
            micro_batch_size=cfg.rollout.micro_batch_size, replicas=cfg.rollout.num_replicas,
            reward_workers=cfg.reward.num_workers, max_staleness=cfg.async_.max_staleness, cores=args.cores,
        )
        staleness = args.staleness or [base.max_staleness]
        lines = [HEADER]
        if args.gpus:
            if basis is None:
                raise SimulationInputError(f"--costs {args.costs!r}: --gpus needs a \"basis\" (what the costs were measured for)")
            for gpus in args.gpus:
                for s in staleness:
                    shape = Shape(**{**base.__dict__, "max_staleness": s})
                    splits = size_cluster(costs, basis, shape, gpus, cfg.learner.micro_batch_size, args.steps,
                                          cfg.algorithm.num_minibatches)
                    for split in splits[: args.top]:
                        label = f"{gpus} GPUs: {split.replicas}x{basis.gpus_per_replica} roll + {split.learner_ranks} lrn, s={s}"
                        lines.append(row(label, split.prediction))
        else:
            if basis is not None:  # the costs are for the basis' shape: at the config's, as --gpus scales them
                costs = config_costs(costs, basis, cfg, args.costs)
            for r in args.replicas or [base.replicas]:
                for s in staleness:
                    shape = Shape(**{**base.__dict__, "replicas": r, "max_staleness": s})
                    lines.append(row(f"replicas={r} max_staleness={s}", simulate(costs, shape, steps=args.steps)))
    except (ConfigError, SimulationInputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
