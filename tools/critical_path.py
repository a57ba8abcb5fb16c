"""Where a synchronous step's wall time goes, hop by hop, from Ray's own task events (`ray.timeline()`).

A synchronous step is one chain: the learners train, the next batch's requests roll out under the new weights, the
last request is scored, and the learners train again. Ray records every actor call's execution (chrome-trace "X"
events, "cat" = "task::Class.method", `ts` and `dur` in microseconds of the node's wall clock), so the chain's links
and the gaps between them (the driver's turn and Ray's hops) can be read off without instrumenting rayflow:

    step = learner + learner_to_rollout + rollout + rollout_to_reward + reward + reward_to_learner

from the end of one train step to the end of the next. `bench.py pipeline` reports the medians per synchronous
configuration (`critical_path` in its JSON). One node only: the events carry each node's own clock. Asynchronous
steps overlap and have no such chain.
"""

from __future__ import annotations

import dataclasses
import statistics

TRAIN, GENERATE, SCORE, RECEIVE = ("LearnerWorker.train_step", "RolloutWorker.generate", "RewardWorker.score",
                                   "RolloutWorker.receive_weights")
LINKS = ("learner", "learner_to_rollout", "rollout", "rollout_to_reward", "reward", "reward_to_learner")
"""The chain's parts, in order; they sum to `step`."""


@dataclasses.dataclass(frozen=True)
class Span:
    start: float
    end: float
    """Seconds of the node's wall clock (time.time())."""


def task_spans(events: list[dict], start_s: float, end_s: float) -> dict[str, list[Span]]:
    """Each actor method's executions ("Class.method", as `TRAIN`) that started within [start_s, end_s], in start
    order. `events`: `ray.timeline()`'s list."""
    spans: dict[str, list[Span]] = {}
    for e in events:
        cat = e.get("cat", "")
        if not cat.startswith("task::") or e.get("ph") != "X":
            continue
        start = e["ts"] / 1e6
        if start_s <= start <= end_s:
            spans.setdefault(cat[len("task::"):], []).append(Span(start, start + e["dur"] / 1e6))
    return {name: sorted(s, key=lambda span: span.start) for name, s in spans.items()}


def merge_overlapping(spans: list[Span]) -> list[Span]:
    """Spans that overlap (one train step on several learner ranks) as one, from the first start to the last end."""
    merged: list[Span] = []
    for span in sorted(spans, key=lambda s: s.start):
        if merged and span.start <= merged[-1].end:
            merged[-1] = Span(merged[-1].start, max(merged[-1].end, span.end))
        else:
            merged.append(span)
    return merged


def synchronous_steps(spans: dict[str, list[Span]]) -> list[dict[str, float]]:
    """One entry per train step after the first (entry i: the (i + 2)-th): its chain's links (`LINKS`, seconds),
    `step` (their sum: from the train step before's end to this one's) and `weights_staged` (from the train step
    before's end to the end of the last rank's receipt of the new version, off the chain while the rollout encodes its
    prompts). A step whose rollout or scoring is missing from the events (an evaluation between, events dropped) is
    left out."""
    trains = merge_overlapping(spans.get(TRAIN, []))
    steps = []
    for before, train in zip(trains, trains[1:]):
        requests, scores, receipts = (
            [s for s in spans.get(name, []) if before.end <= s.start and s.end <= train.start]
            for name in (GENERATE, SCORE, RECEIVE))
        if not requests or not scores:
            continue
        rollout_start, rollout_end = requests[0].start, max(s.end for s in requests)
        last_scores = [s for s in scores if s.start >= rollout_end]
        if not last_scores:
            continue
        reward = Span(last_scores[0].start, max(s.end for s in last_scores))
        links = {
            "learner": train.end - train.start,
            "learner_to_rollout": rollout_start - before.end,
            "rollout": rollout_end - rollout_start,
            "rollout_to_reward": reward.start - rollout_end,
            "reward": reward.end - reward.start,
            "reward_to_learner": train.start - reward.end,
        }
        steps.append({**links, "step": train.end - before.end,
                      "weights_staged": max(s.end for s in receipts) - before.end if receipts else float("nan")})
    return steps


def summarize(steps: list[dict[str, float]]) -> dict[str, float]:
    """Medians of every field over `steps`, and how many there were; the links' medians need not sum to `step`'s."""
    if not steps:
        return {"steps": 0}
    return {"steps": len(steps), **{key: statistics.median(s[key] for s in steps) for key in steps[0]}}
