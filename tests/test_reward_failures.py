"""Rewards fail loudly: non-finite scores name the reward; the HTTP client has one deadline per request,
retries with backoff within reward.max_outage_s, and reports numbers out of float range clearly."""

import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rayflow.config import RewardFnConfig, from_dict
from rayflow.errors import ConfigError
from rayflow.rewards import RewardOutput, make_reward, register_reward
from rayflow.rewards.http_client import JsonClient
from rayflow.rewards.weighted import WeightedReward
from reward_server import RewardServer

IMAGES = torch.zeros(2, 8, 8, 3, dtype=torch.uint8)


@register_reward("test_nan_second")
def _nan_second():
    return lambda images, prompts, metadata=None: torch.tensor([0.5, float("nan")])


def test_non_finite_score_raises_with_the_reward_name():
    reward = WeightedReward([RewardFnConfig("color"), RewardFnConfig("test_nan_second")])
    with pytest.raises(ValueError, match=r"reward 'test_nan_second' returned non-finite values \[0.5, nan\]"):
        reward(IMAGES, ["a red x", "a red y"])
    with RewardServer(lambda i, body: (200, {"rewards": [0.1, float("inf")]})) as server:
        with pytest.raises(RuntimeError, match=r"value 1 \(inf\) is outside float32 range"):
            make_reward("http", url=server.url)(IMAGES, ["a", "b"])


@pytest.mark.parametrize("metric", ["color", "mean", "std", "reward_mean", "color/normalized"])
def test_a_metric_that_would_be_logged_over_the_rewards_own_scalars_is_refused(metric):
    # reward/mean, reward/std, eval/reward_mean and reward/<component>/normalized are the trainer's: a metric of that
    # name overwrote them. A reward may not be registered under those names either.
    @register_reward(f"test_metric_{metric}")
    def _reporting():
        return lambda images, prompts, metadata=None: RewardOutput(torch.zeros(len(prompts)), {metric: torch.ones(len(prompts))})

    reward = WeightedReward([RewardFnConfig("color"), RewardFnConfig(f"test_metric_{metric}")])
    with pytest.raises(ValueError, match=rf"reward metrics \['{metric}'\] would be logged over the reward's own scalars"):
        reward(IMAGES, ["a red x", "a red y"])
    if metric != "color" and "/" not in metric:
        with pytest.raises(ValueError, match=rf"register_reward: got '{metric}'"):
            register_reward(metric)


def test_a_metric_two_rewards_report_with_other_values_is_refused_naming_both():
    @register_reward("test_metric_twice")
    def _reporting(hits: float = 1.0):
        return lambda images, prompts, metadata=None: RewardOutput(torch.zeros(len(prompts)),
                                                                    {"hits": torch.full((len(prompts),), hits)})

    same = WeightedReward([RewardFnConfig("test_metric_twice"), RewardFnConfig("test_metric_twice")])
    assert same(IMAGES, ["a red x", "a red y"])[1]["hits"].tolist() == [1.0, 1.0]  # e.g. shapes with two scores
    other = WeightedReward([RewardFnConfig("test_metric_twice"), RewardFnConfig("test_metric_twice", kwargs={"hits": 0.0})])
    with pytest.raises(ValueError, match=r"reward metric 'hits' is reported by 'test_metric_twice#0' and by "
                                         r"'test_metric_twice#1' with other values"):
        other(IMAGES, ["a red x", "a red y"])


def test_huge_integer_from_a_server_is_a_clear_error():
    with RewardServer(lambda i, body: (200, {"rewards": [10**400, 0.5]})) as server:
        with pytest.raises(RuntimeError, match=re.escape(f"http reward {server.url}: value 0 (1000000000")):
            make_reward("http", url=server.url)(IMAGES, ["a", "b"])


def test_retries_with_backoff_until_the_server_is_back():
    with RewardServer(lambda i, body: (503, {"error": "warming up"}) if i < 2 else (200, {"ok": i})) as server:
        client = JsonClient(server.url, timeout_s=5, max_outage_s=10, backoff_s=0.05)
        assert client.post({}) == {"ok": 2}
        assert len(server.requests) == 3


def test_outage_longer_than_the_budget_fails_with_the_last_error():
    with RewardServer(lambda i, body: (503, {"error": "down"})) as server:
        reward = WeightedReward([RewardFnConfig("http", kwargs={"url": server.url})], max_outage_s=1.0)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"HTTP 503: down \(after \d+ attempt\(s\) in .*max_outage_s=1.0\)"):
            reward(IMAGES, ["a", "b"])
        assert time.monotonic() - start < 2.5
        assert len(server.requests) >= 2  # retried: 0.5 s backoff first
    with RewardServer(lambda i, body: (400, {"error": "bad prompt"})) as server:  # the server's verdict: not retried
        with pytest.raises(RuntimeError, match="HTTP 400: bad prompt"):
            make_reward("http", url=server.url, max_outage_s=10)(IMAGES, ["a", "b"])
        assert len(server.requests) == 1


def test_deadline_covers_the_whole_reply_not_each_read():
    stop = threading.Event()

    class Trickle(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            while not stop.is_set():  # a byte every 0.1 s: no single read ever waits timeout_s
                try:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.1)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = JsonClient(f"http://127.0.0.1:{httpd.server_address[1]}/score", timeout_s=0.5)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"no reply within timeout_s=0.5s"):
            client.post({})
        assert time.monotonic() - start < 1.5
        # Its reading thread ends with the next byte past the deadline: it lived as long as the server trickled.
        time.sleep(0.5)
        assert not [t for t in threading.enumerate() if t.name == "rayflow-http-request"]
    finally:
        stop.set()
        httpd.shutdown()
        httpd.server_close()


def test_http_kwargs_checked_at_config_time():
    with pytest.raises(ConfigError, match=r"reward.functions\[0\].kwargs.url: got 'localhost:8000'"):
        from_dict({"reward": {"functions": [{"name": "http", "kwargs": {"url": "localhost:8000"}}]}})
    with pytest.raises(ConfigError, match=r"reward.functions\[0\].kwargs.timeout_s: got -1"):
        from_dict({"reward": {"functions": [{"name": "http", "kwargs": {"url": "http://h/s", "timeout_s": -1}}]}})
    with pytest.raises(ConfigError, match=r"reward.max_outage_s: got -1"):
        from_dict({"reward": {"max_outage_s": -1}})
