"""Tiny CLIP and T5 text encoders with offline-trained tokenizers, for the SD3 and FLUX.1 twins.

Built from the real transformers classes (CLIPTextModel[WithProjection], T5EncoderModel,
CLIPTokenizer, T5TokenizerFast), so the pipelines tokenise and encode through their own code.
"""

from __future__ import annotations

import json

import torch

from rayflow.models.tiny import COLOURS, OBJECTS

# CLIP pads every prompt to its 77 positions (the pipelines' tokenizer_max_length).
CLIP_MAX_LENGTH = 77


def _corpus() -> list[str]:
    return [f"a {c} {o}, a photo of a {o} that is {c}" for c in COLOURS for o in OBJECTS]


def build_clip_tokenizer(vocab_size: int = 512):
    """A CLIP BPE (lower-cased words, byte alphabet, `</w>` word ends) trained on the tiny corpus."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import CLIPTokenizer

    specials = ["<|startoftext|>", "<|endoftext|>"]
    tok = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    # CLIP splits words before byte-encoding them, so no word carries a leading-space marker.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, end_of_word_suffix="</w>",
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    return CLIPTokenizer(
        vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]], model_max_length=CLIP_MAX_LENGTH
    )


def build_t5_tokenizer():
    """A T5 unigram vocabulary: whole corpus words, then single letters and digits as the fallback."""
    from transformers import T5TokenizerFast

    words = sorted({w.strip(",.") for line in _corpus() for w in line.split()})
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + w, -1.0) for w in words]
    pieces += [(ch, -5.0) for ch in "\u2581abcdefghijklmnopqrstuvwxyz0123456789,."]
    return T5TokenizerFast(vocab=pieces, extra_ids=0)


def build_clip(tokenizer, hidden: int, layers: int, projection: int | None):
    """CLIPTextModelWithProjection when `projection` is given (SD3's pooled text_embeds), else CLIPTextModel."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, max_position_embeddings=CLIP_MAX_LENGTH, projection_dim=projection or hidden,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    cls = CLIPTextModel if projection is None else CLIPTextModelWithProjection
    return cls(config).eval()


def build_t5(tokenizer, hidden: int, layers: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=len(tokenizer), d_model=hidden, d_kv=hidden // 2, d_ff=2 * hidden, num_layers=layers,
        num_heads=2, relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
    )
    return T5EncoderModel(config).eval()


def seeded(seed: int, build, *args, **kwargs):
    """`build(*args, **kwargs)` with torch seeded first, so each module's weights depend only on its seed."""
    torch.manual_seed(seed)
    return build(*args, **kwargs)
