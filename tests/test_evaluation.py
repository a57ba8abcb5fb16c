"""The evaluator's fixed requests: data.eval_seeds samples of each evaluation prompt, the same seeds every time."""

from rayflow.config import RayflowConfig
from rayflow.driver.evaluation import EVAL_GROUP_ID, Evaluator
from rayflow.paths import recipe


def test_each_eval_prompt_gets_eval_seeds_distinct_fixed_seeds():
    cfg = RayflowConfig()
    cfg.data.eval_prompts = recipe("prompts/shapes_eval.txt")
    cfg.data.eval_seeds = 3
    requests = Evaluator(cfg.data, cfg.sampling, [], generate=None, rewards=None).requests
    assert len(requests) == 20
    assert requests[1].prompts == ["a green circle"] * 3 and requests[1].seeds == [3, 4, 5]
    assert {g for r in requests for g in r.group_ids} == {EVAL_GROUP_ID}
    assert sorted(s for r in requests for s in r.seeds) == list(range(60))
    assert all(r.params.sde_type == "ode" for r in requests)
