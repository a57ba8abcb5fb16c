"""The `ocr` reward: does the image show the text its prompt quotes?

flow_grpo's OCR task (flow_grpo/ocr.py, `OcrScorer`): the target is the first double-quoted part of
the prompt; the recognised text is every detected line joined; both are lower-cased with spaces
removed; reward = 1 − min(edit_distance(recognised, target), len(target)) / len(target), and 1 when
the target appears inside the recognised text. Unlike the reference, an OCR engine error is raised,
not scored 0.

The engine is RapidOCR (`rapidocr-onnxruntime`): its wheel carries the PP-OCRv4 detection and
recognition ONNX models, so nothing is downloaded; onnxruntime's CUDA provider is used where present.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from rayflow.distributed.placement import gpus_withheld
from rayflow.errors import ConfigError
from rayflow.rewards.registry import register_reward
from rayflow.rewards.validation import check_number

_QUOTED = re.compile(r'"([^"]*)"')


def ocr_target(prompt: str) -> str:
    """The text the prompt asks to be rendered: its first double-quoted part (flow_grpo: prompt.split('"')[1])."""
    match = _QUOTED.search(prompt)
    if match is None or not match.group(1).replace(" ", ""):
        raise ValueError(f'ocr reward: prompt {prompt!r} quotes no text to render; write it as: a sign that says "OPEN"')
    return match.group(1)


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions each cost 1)."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_score(recognised: str, target: str) -> float:
    """flow_grpo's OCR reward of one image, from the recognised text and the target."""
    recognised = recognised.replace(" ", "").lower()
    target = target.replace(" ", "").lower()
    distance = 0 if target in recognised else min(edit_distance(recognised, target), len(target))
    return 1.0 - distance / len(target)


def _cuda_provider_present() -> bool:
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


@register_reward("ocr")
class OcrReward:
    """1 − normalised edit distance between the prompt's quoted text and the text RapidOCR reads."""

    def __init__(self, use_cuda: bool | None = None, min_confidence: float = 0.5):
        """use_cuda: None runs on onnxruntime's CUDA provider where it is present (onnxruntime-gpu);
        min_confidence: recognised lines below this score are ignored (RapidOCR's text_score)."""
        self.check_kwargs({"use_cuda": use_cuda, "min_confidence": min_confidence})
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError:
            raise ImportError('ocr reward needs rapidocr-onnxruntime 1.4.x: pip install "rapidocr-onnxruntime>=1.4,<1.5"') from None
        # A worker without a GPU of its own sees every GPU of its node: onnxruntime's device 0 is another role's.
        cuda = (not gpus_withheld() and _cuda_provider_present()) if use_cuda is None else use_cuda
        # No angle classifier, as flow_grpo reads (PaddleOCR with use_angle_cls=False, ocr(..., cls=False)); onnxruntime
        # on torch's thread count, which RewardWorker sets from reward.cpus_per_worker (its default, -1, took every core).
        self.engine = RapidOCR(text_score=min_confidence, use_cls=False, det_use_cuda=cuda, rec_use_cuda=cuda,
                               intra_op_num_threads=torch.get_num_threads())

    @staticmethod
    def check_kwargs(kwargs: dict, key: str = "reward.functions[ocr].kwargs") -> None:
        use_cuda, confidence = kwargs.get("use_cuda"), kwargs.get("min_confidence", 0.5)
        if use_cuda is not None and not isinstance(use_cuda, bool):
            raise ConfigError(f"{key}.use_cuda", use_cuda, "null (where present), true or false")
        check_number(confidence, f"{key}.min_confidence", "a float in [0, 1)", lambda v: 0 <= v < 1)

    @staticmethod
    def check_prompt(prompt: str) -> None:
        ocr_target(prompt)

    def read(self, image: np.ndarray) -> str:
        """The text RapidOCR recognises in an [H, W, 3] RGB uint8 image, its lines joined in reading order."""
        result, _ = self.engine(np.ascontiguousarray(image[:, :, ::-1]))  # RapidOCR takes OpenCV's BGR order
        return "".join(line[1] for line in result or [])

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        targets = [ocr_target(p) for p in prompts]  # before any OCR: a bad prompt fails at once
        return torch.tensor([ocr_score(self.read(image.numpy()), t) for image, t in zip(images, targets)],
                            dtype=torch.float32)
