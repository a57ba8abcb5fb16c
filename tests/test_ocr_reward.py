"""The `ocr` reward with the real PP-OCRv4 models of rapidocr-onnxruntime, on words rendered with Pillow;
flow_grpo's scoring rule written out; prompts without a quoted target fail before anything starts."""

import re

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from rayflow.config import from_dict
from rayflow.errors import ConfigError
from rayflow.rewards import make_reward
from rayflow.rewards.ocr import edit_distance, ocr_score, ocr_target
from rayflow.rewards.validation import check_prompt_file


def render(text: str, height: int = 64) -> torch.Tensor:
    """Black text on white, [height, 2·height, 3] uint8."""
    image = Image.new("RGB", (2 * height, height), "white")
    ImageDraw.Draw(image).text((height, height // 2), text, fill="black",
                               font=ImageFont.load_default(size=height // 3), anchor="mm")
    return torch.from_numpy(np.asarray(image).copy())


def test_flow_grpo_rule_written_out():
    assert ocr_target('a sign that says "Night Cafe" at dusk') == "Night Cafe"
    assert edit_distance("kitten", "sitting") == 3 and edit_distance("", "abc") == 3
    assert ocr_score("NIGHT CAFE", "Night Cafe") == 1.0  # lower-cased, spaces removed
    assert ocr_score("the nightcafe is open", "Night Cafe") == 1.0  # target inside the recognised text
    assert ocr_score("nightcafx", "Night Cafe") == pytest.approx(1 - 1 / 9)
    assert ocr_score("", "Night Cafe") == 0.0
    assert ocr_score("a very long unrelated recognised sentence", "Cafe") == 0.0  # distance clipped at len(target)


def test_real_ocr_right_word_high_wrong_word_lower_blank_zero():
    reward = make_reward("ocr")
    blank = torch.full((64, 128, 3), 255, dtype=torch.uint8)
    images = torch.stack([render("OPEN"), render("OPFN"), render("SHUT"), blank])
    scores = reward(images, ['a sign that says "OPEN"'] * 4)
    assert scores.dtype == torch.float32
    assert scores[0] == 1.0
    assert scores[1] == pytest.approx(0.75)  # one letter of four wrong
    assert scores[2] < scores[1]
    assert scores[3] == 0.0  # nothing read


def test_the_engine_reads_as_flow_grpo_does_on_the_workers_threads():
    """No text-angle classifier (flow_grpo: use_angle_cls=False, ocr(..., cls=False)); onnxruntime on torch's thread
    count, which RewardWorker sets from reward.cpus_per_worker (RapidOCR's default took every core)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = make_reward("ocr").engine
    finally:
        torch.set_num_threads(threads)
    assert engine.use_cls is False
    assert engine.text_det.infer.session.get_session_options().intra_op_num_threads == 1
    assert engine.text_rec.session.session.get_session_options().intra_op_num_threads == 1  # recognition too


def test_prompt_without_quoted_target():
    with pytest.raises(ValueError, match="quotes no text"):
        ocr_target("a sign on a door")
    with pytest.raises(ValueError, match="quotes no text"):
        ocr_target('an empty sign "  "')


def test_prompt_file_without_target_fails_with_file_and_line(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text('# header\na sign that says "OPEN"\n\na blank sign\n')
    with pytest.raises(ValueError, match=rf"{path}:4: ocr reward: prompt 'a blank sign' quotes no text"):
        check_prompt_file(["jpeg_compressibility", "ocr"], str(path))
    check_prompt_file(["jpeg_compressibility"], str(path))  # rewards without a prompt rule accept it
    with pytest.raises(ValueError, match=rf"{path}:2: color reward: prompt .* names no colour"):
        check_prompt_file(["color"], str(path))  # the color reward's rule: a colour named


def test_ocr_kwargs_checked_at_config_time():
    with pytest.raises(ConfigError, match=r"reward.functions\[0\].kwargs.min_confidence: got 2"):
        from_dict({"reward": {"functions": [{"name": "ocr", "kwargs": {"min_confidence": 2}}]}})
    with pytest.raises(ConfigError, match=r"reward.functions\[0\].kwargs: .*unexpected keyword argument 'lang'"):
        from_dict({"reward": {"functions": [{"name": "ocr", "kwargs": {"lang": "en"}}]}})


def test_recipe_with_unquoted_ocr_prompt_exits_before_ray_starts(tmp_path, monkeypatch):
    from rayflow.driver import launch

    monkeypatch.setattr(launch, "start_ray", lambda cfg: pytest.fail("Ray started despite a bad prompt file"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('a sign that says "OPEN"\na red apple\n')
    with pytest.raises(SystemExit, match=re.escape(f"error: {prompts}:2: ocr reward: prompt 'a red apple' quotes no text")):
        launch.run_recipe("recipes/flowgrpo_qwen_image.yaml", [f"data.prompts={prompts}", "reward.functions=[{name: ocr}]"])
