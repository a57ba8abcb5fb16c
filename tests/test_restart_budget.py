"""Restart budgets per time window: transient losses spread over a long run do not add up to an abort,
a replica that keeps dying still runs out of restarts."""

from rayflow.rollout.pool import RolloutPool
from rayflow.distributed.restart_budget import RestartBudget


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_at_most_max_restarts_within_any_window():
    clock = Clock()
    budget = RestartBudget(max_restarts=2, window_s=100.0, clock=clock)
    taken = []
    for t in (0, 10, 50, 99.9, 100, 109.9, 110, 500, 501, 502):
        clock.now = t
        taken.append(budget.take())
    # 0 and 10 fill the window; 50 and 99.9 are refused; at 100 the restart at 0 has left it, at 110 the one at 10.
    assert taken == [True, True, False, False, True, False, True, True, True, False]


def test_window_zero_counts_over_the_whole_run():
    clock = Clock()
    budget = RestartBudget(max_restarts=3, window_s=0.0, clock=clock)
    results = []
    for t in (0, 1e5, 1e6, 1e7):
        clock.now = t
        results.append(budget.take())
    assert results == [True, True, True, False]


class FakeReplica:
    def __init__(self, name: str):
        self.name, self.alive = name, True

    def shutdown(self):
        self.alive = False


def test_a_sole_replica_lost_once_a_day_for_a_week_is_replaced_every_time():
    clock = Clock()
    started = []

    def start(name):
        started.append(FakeReplica(name))
        return started[-1]

    pool = RolloutPool([FakeReplica("rollout-0")], start, max_restarts=3, restart_window_s=3600.0)
    pool.budgets[0].clock = clock
    for day in range(7):
        clock.now = day * 86400.0
        assert pool.replace(pool.replicas[0])
        pool.replicas[0] = pool.starting.pop(0)  # the replacement came up (promote_ready without Ray)
    assert pool.restarts == [7] and len(started) == 7
    # Four deaths within one hour: the fourth is not replaced.
    deaths = []
    for minute in range(4):
        clock.now = 7 * 86400.0 + 60.0 * minute
        deaths.append(pool.replace(pool.replicas[0]))
        if deaths[-1]:
            pool.replicas[0] = pool.starting.pop(0)
    assert deaths == [True, True, True, False] and pool.restarts == [10]
