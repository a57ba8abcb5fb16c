"""CLIP-family rewards from a local transformers directory (`kwargs: {path: DIR}`); nothing is downloaded.

    clip_score  logit_scale.exp() · cos(text, image) / 30   flow_grpo's ClipScorer (openai/clip-vit-large-patch14)
    pickscore   logit_scale.exp() · cos(text, image) / 26   flow_grpo's PickScoreScorer (yuvalkirstain/PickScore_v1,
                                                            a CLIP-H checkpoint; put the CLIP-H processor files beside it)
    aesthetic   LAION improved-aesthetic MLP(normalised CLIP ViT-L/14 image embedding)   (flow_grpo's aesthetic_scorer)

The model loads once per reward worker (on its GPU when Ray gave it one) and scores a batch per call.
"""

from __future__ import annotations

import json
import os

import torch

from rayflow.distributed.placement import uses_cuda
from rayflow.errors import ConfigError
from rayflow.rewards.registry import register_reward

AESTHETIC_WEIGHTS = "aesthetic_mlp.safetensors"
_HOW_TO_GET = {
    "clip_score": "huggingface-cli download openai/clip-vit-large-patch14 --local-dir DIR",
    "pickscore": "huggingface-cli download yuvalkirstain/PickScore_v1 --local-dir DIR, then the processor files of "
                 "laion/CLIP-ViT-H-14-laion2B-s32B-b79K into DIR",
    "aesthetic": "huggingface-cli download openai/clip-vit-large-patch14 --local-dir DIR, then LAION's "
                 f"sac+logos+ava1-l14-linearMSE.pth converted to DIR/{AESTHETIC_WEIGHTS} (see the README)",
}


_PROCESSOR_FILES = {
    "image processor config": ("preprocessor_config.json", "processor_config.json"),
    "tokenizer": ("tokenizer.json", "vocab.json"),
}
"""CLIPProcessor's files, as the hub's downloads hold them or as transformers 5's save_pretrained writes them."""


def check_clip_dir(reward: str, path, key: str) -> None:
    """A clear ConfigError unless `path` is a local directory holding a transformers CLIP model and its processor."""
    how = f"a local directory with a transformers CLIPModel and its processor; get one with: {_HOW_TO_GET[reward]}"
    if not isinstance(path, str) or not os.path.isdir(path):
        raise ConfigError(f"{key}.path", path, how)
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ConfigError(f"{key}.path", path, f"{how} (no config.json there)")
    try:
        with open(config_file, encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise ConfigError(f"{key}.path", path, f"{how} (its config.json is not a JSON object: {e})") from None
    if model_type != "clip":
        raise ConfigError(f"{key}.path", path, f"{how} (its config.json has model_type {model_type!r}, not 'clip')")
    for kind, names in _PROCESSOR_FILES.items():
        if not any(os.path.isfile(os.path.join(path, name)) for name in names):
            raise ConfigError(f"{key}.path", path, f"{how} (no {kind} there: none of {list(names)})")
    if reward == "aesthetic" and not os.path.isfile(os.path.join(path, AESTHETIC_WEIGHTS)):
        raise ConfigError(f"{key}.path", path, f"{how} (no {AESTHETIC_WEIGHTS} there)")


def _device(device: str | None) -> torch.device:
    """`device`, or the worker's GPU when Ray gave it one (reward.gpus_per_worker > 0: CUDA_VISIBLE_DEVICES names it),
    else the CPU. A worker without a GPU sees every GPU of its node (gpus_withheld), whose cuda:0 is another role's."""
    if device:
        return torch.device(device)
    return torch.device("cuda" if uses_cuda() else "cpu")


class _ClipModel:
    """A CLIPModel and CLIPProcessor loaded once from a local directory."""

    reward = "clip_score"

    def __init__(self, path: str, device: str | None = None):
        from transformers import CLIPModel, CLIPProcessor

        check_clip_dir(self.reward, path, f"reward.functions[{self.reward}].kwargs")
        self.device = _device(device)
        self.model = CLIPModel.from_pretrained(path).eval().to(self.device)
        self.processor = CLIPProcessor.from_pretrained(path)

    @classmethod
    def check_kwargs(cls, kwargs: dict, key: str) -> None:
        check_clip_dir(cls.reward, kwargs.get("path"), key)

    @torch.no_grad()
    def image_embeds(self, images: torch.Tensor) -> torch.Tensor:
        """[B, H, W, 3] uint8 -> [B, D] unit-norm CLIP image embeddings."""
        pixels = self.processor(images=list(images.numpy()), return_tensors="pt")["pixel_values"].to(self.device)
        # transformers 5 returns the projected embedding as the pooler output.
        embeds = self.model.get_image_features(pixel_values=pixels).pooler_output
        return embeds / embeds.norm(p=2, dim=-1, keepdim=True)


class _ClipSimilarity(_ClipModel):
    divisor = 30.0

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        text = self.processor(text=list(prompts), padding=True, truncation=True, max_length=77, return_tensors="pt")
        text_embeds = self.model.get_text_features(input_ids=text["input_ids"].to(self.device),
                                                   attention_mask=text["attention_mask"].to(self.device)).pooler_output
        text_embeds = text_embeds / text_embeds.norm(p=2, dim=-1, keepdim=True)
        cosine = (self.image_embeds(images) * text_embeds).sum(dim=-1)
        return (self.model.logit_scale.exp() * cosine / self.divisor).float().cpu()


@register_reward("clip_score")
class ClipScore(_ClipSimilarity):
    """CLIP score, flow_grpo's scale: logit_scale.exp() · cos / 30."""


@register_reward("pickscore")
class PickScore(_ClipSimilarity):
    """PickScore, flow_grpo's scale: logit_scale.exp() · cos / 26."""

    reward = "pickscore"
    divisor = 26.0


def aesthetic_mlp(embed_dim: int) -> torch.nn.Sequential:
    """LAION's improved-aesthetic-predictor head (its `layers`; dropout is inactive in eval)."""
    return torch.nn.Sequential(
        torch.nn.Linear(embed_dim, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128), torch.nn.Dropout(0.2),
        torch.nn.Linear(128, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 16), torch.nn.Linear(16, 1),
    )


@register_reward("aesthetic")
class Aesthetic(_ClipModel):
    """LAION improved aesthetic score (about 1–10) of the unit-norm CLIP ViT-L/14 image embedding."""

    reward = "aesthetic"

    def __init__(self, path: str, device: str | None = None):
        from safetensors.torch import load_file

        super().__init__(path, device)
        self.mlp = aesthetic_mlp(self.model.config.projection_dim)
        state = {k.removeprefix("layers."): v for k, v in load_file(os.path.join(path, AESTHETIC_WEIGHTS)).items()}
        try:
            self.mlp.load_state_dict(state)
        except RuntimeError as e:
            raise ConfigError("reward.functions[aesthetic].kwargs.path", path,
                              f"{AESTHETIC_WEIGHTS} with LAION's MLP layers.{{0,2,4,6,7}} ({str(e).splitlines()[0]})") from None
        self.mlp.eval().to(self.device)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        return self.mlp(self.image_embeds(images)).squeeze(1).float().cpu()
