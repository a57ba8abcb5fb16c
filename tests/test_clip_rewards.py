"""clip_score, pickscore and aesthetic on a tiny CLIP built offline from a config, saved, loaded through the
reward, and compared with a direct transformers computation; bad directories fail at config time."""

import json

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import pre_tokenizers
from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

from rayflow.config import from_dict
from rayflow.errors import ConfigError
from rayflow.rewards import make_reward
from rayflow.rewards.clip import AESTHETIC_WEIGHTS

PROMPTS = ["a red apple", "a blue ball on a table", "a green car"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    """A tiny CLIP (character-level BPE tokenizer, 32 px vision tower) with random weights and an aesthetic head."""
    d = tmp_path_factory.mktemp("tiny_clip")
    chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"])}
    (d / "vocab.json").write_text(json.dumps(vocab))
    (d / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(d / "vocab.json"), str(d / "merges.txt"))
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(d)
    torch.manual_seed(0)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), max_position_embeddings=77, bos_token_id=len(vocab) - 2,
                         eos_token_id=len(vocab) - 1, pad_token_id=len(vocab) - 1, **small),
        vision_config=dict(image_size=32, patch_size=8, **small), projection_dim=16,
    )
    CLIPModel(config).save_pretrained(d)
    mlp = {f"layers.{i}.{p}": torch.randn(*shape) * 0.1 for i, (o, n) in
           zip((0, 2, 4, 6, 7), ((1024, 16), (128, 1024), (64, 128), (16, 64), (1, 16)))
           for p, shape in (("weight", (o, n)), ("bias", (o,)))}
    save_file(mlp, str(d / AESTHETIC_WEIGHTS))
    return str(d)


def images(n: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (n, 48, 40, 3), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)


def direct(clip_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits_per_image diagonal, unit image embeddings) straight from transformers."""
    model, processor = CLIPModel.from_pretrained(clip_dir).eval(), CLIPProcessor.from_pretrained(clip_dir)
    inputs = processor(text=PROMPTS, images=list(images().numpy()), padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**inputs)
    return out.logits_per_image.diagonal(), out.image_embeds


def test_clip_score_and_pickscore_equal_transformers_logits(clip_dir):
    logits, _ = direct(clip_dir)
    clip_score = make_reward("clip_score", path=clip_dir)(images(), PROMPTS)
    pickscore = make_reward("pickscore", path=clip_dir)(images(), PROMPTS)
    assert torch.allclose(clip_score, logits / 30, rtol=1e-5, atol=1e-6)  # flow_grpo's ClipScorer scale
    assert torch.allclose(pickscore, logits / 26, rtol=1e-5, atol=1e-6)  # flow_grpo's PickScoreScorer scale
    assert clip_score.dtype == torch.float32 and clip_score.std() > 0


def test_aesthetic_is_laion_mlp_of_the_unit_image_embedding(clip_dir):
    _, embeds = direct(clip_dir)  # CLIPModel returns image_embeds already L2-normalised
    from safetensors.torch import load_file

    w = load_file(f"{clip_dir}/{AESTHETIC_WEIGHTS}")
    x = embeds
    for i in (0, 2, 4, 6, 7):
        x = x @ w[f"layers.{i}.weight"].T + w[f"layers.{i}.bias"]
    score = make_reward("aesthetic", path=clip_dir)(images(), PROMPTS)
    assert torch.allclose(score, x.squeeze(1), rtol=1e-4, atol=1e-6)


def test_missing_or_wrong_directory_fails_at_config_time(tmp_path, clip_dir):
    def config(name, path):
        return {"reward": {"functions": [{"name": name, "kwargs": {"path": path}}]}}

    with pytest.raises(ConfigError, match=r"reward.functions\[0\].kwargs.path: got '/nonexistent'.*huggingface-cli download openai/clip-vit-large-patch14"):
        from_dict(config("clip_score", "/nonexistent"))
    with pytest.raises(ConfigError, match=r"reward.functions\[0\].kwargs: .*missing a required argument: 'path'"):
        from_dict({"reward": {"functions": [{"name": "pickscore"}]}})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "siglip"}))
    with pytest.raises(ConfigError, match=r"model_type 'siglip', not 'clip'"):
        from_dict(config("pickscore", str(tmp_path)))
    for broken in ("{", "[]"):  # not JSON; JSON but not an object
        (tmp_path / "config.json").write_text(broken)
        with pytest.raises(ConfigError, match=r"kwargs.path: .*its config.json is not a JSON object"):
            from_dict(config("clip_score", str(tmp_path)))
    # PickScore_v1's download has the model alone: the CLIP-H processor files are fetched beside it.
    only_clip = tmp_path / "clip_only"
    CLIPModel.from_pretrained(clip_dir).save_pretrained(only_clip)
    with pytest.raises(ConfigError, match=r"CLIP-ViT-H-14.* \(no image processor config there: none of "
                                          r"\['preprocessor_config.json', 'processor_config.json'\]\)"):
        from_dict(config("pickscore", str(only_clip)))
    CLIPProcessor.from_pretrained(clip_dir).save_pretrained(only_clip)
    with pytest.raises(ConfigError, match=rf"no {AESTHETIC_WEIGHTS} there"):
        from_dict(config("aesthetic", str(only_clip)))
