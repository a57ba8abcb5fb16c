"""Real-size architectures with random weights: meta-device construction, materialisation, saving."""

import dataclasses
import json

import pytest
import torch
from diffusers import QwenImagePipeline

from rayflow.models import load_model
from rayflow.models.published import PUBLISHED, QWEN_IMAGE, published
from rayflow.models.random_init import (
    build_module,
    load_random_init_pipeline,
    materialise,
    parameter_count,
    save_random_pipeline,
    write_random_init_dir,
)


def qwen_image_transformer_parameters(d: int, text_dim: int, in_channels: int, out_channels: int, patch: int,
                                      head_dim: int, layers: int) -> int:
    """Parameter count of QwenImageTransformer2DModel written out from its architecture (d = heads x head_dim)."""
    linear = lambda n_in, n_out: n_in * n_out + n_out  # noqa: E731  (weight + bias)
    attention = 8 * linear(d, d) + 4 * head_dim  # q, k, v, out for image and text; q/k RMSNorm scales
    modulation = 2 * linear(d, 6 * d)  # img_mod, txt_mod (shift, scale, gate for attention and MLP)
    mlp = 2 * (linear(d, 4 * d) + linear(4 * d, d))  # img_mlp, txt_mlp
    block = attention + modulation + mlp
    outer = (
        linear(in_channels, d)  # img_in
        + text_dim + linear(text_dim, d)  # txt_norm (RMSNorm scale), txt_in
        + linear(256, d) + linear(d, d)  # timestep embedding MLP
        + linear(d, 2 * d)  # norm_out (AdaLN continuous)
        + linear(d, patch * patch * out_channels)  # proj_out
    )
    return layers * block + outer


def test_published_qwen_image_sizes_without_allocating():
    transformer = build_module(QWEN_IMAGE.components["transformer"])
    assert {p.device.type for p in transformer.parameters()} == {"meta"}
    expected = qwen_image_transformer_parameters(d=24 * 128, text_dim=3584, in_channels=64, out_channels=16,
                                                 patch=2, head_dim=128, layers=60)
    assert parameter_count(transformer) == expected
    assert round(expected / 1e9, 1) == 20.4  # Qwen-Image is published as a 20B MMDiT
    text_encoder = build_module(QWEN_IMAGE.components["text_encoder"])
    # Qwen2.5-VL-7B-Instruct: 8.29B parameters as its model card lists them (vision tower included).
    assert round(parameter_count(text_encoder) / 1e9, 2) == 8.29


def clip_text_parameters(vocab: int, positions: int, d: int, intermediate: int, layers: int, projection: int) -> int:
    """CLIPTextModel[WithProjection] written out: token and position embeddings, pre-LN blocks, final LN, and a
    bias-free projection when `projection` > 0."""
    linear = lambda n_in, n_out: n_in * n_out + n_out  # noqa: E731
    block = 4 * linear(d, d) + linear(d, intermediate) + linear(intermediate, d) + 2 * 2 * d  # attention, MLP, 2 LNs
    return vocab * d + positions * d + layers * block + 2 * d + projection * d


def t5_encoder_parameters(vocab: int, d: int, inner: int, d_ff: int, layers: int, buckets: int, heads: int) -> int:
    """T5EncoderModel (v1.1: gated-GELU MLP, no biases, RMS norms with scales only) written out; the relative position
    bias lives in the first block only."""
    block = 4 * d * inner + 3 * d * d_ff + 2 * d  # q, k, v, o; wi_0, wi_1, wo; two norms
    return vocab * d + layers * block + buckets * heads + d


def test_published_sd3_and_flux_sizes_without_allocating():
    """Stable Diffusion 3.5 Medium and FLUX.1-dev as published, counted on meta, each against an independent figure."""
    def count(arch, name, **overrides):
        spec = PUBLISHED[arch]
        with torch.device("meta"):  # buffers too (SD3.5's positional table takes seconds to compute)
            return parameter_count(build_module(spec.components[name], {**spec.config(name), **overrides}))

    # SD3 Medium's transformer (no dual attention, no QK norm, 192 positions a side): 2,028,328,000, as its released
    # weights count. SD3.5 Medium's MMDiT-X adds to each of its first 13 blocks a second attention (q, k, v, out: four
    # linears of width d = 1536, and its q/k RMSNorm scales) and three more AdaLN-Zero chunks, and q/k RMSNorm scales
    # to the joint attention of all 24 blocks (image and context sides).
    sd3_medium = count("sd3", "transformer", dual_attention_layers=(), qk_norm=None, pos_embed_max_size=192)
    assert sd3_medium == 2_028_328_000
    d, head = 1536, 64
    linear = d * d + d
    assert count("sd3", "transformer") == sd3_medium + 13 * (4 * linear + 2 * head) + 13 * 3 * linear + 24 * 4 * head
    # FLUX.1-dev: 11,901,408,320, its released transformer's count (the "12B" of its model card).
    assert count("flux", "transformer") == 11_901_408_320
    # The text encoders, each against its architecture written out: CLIP ViT-L/14 (123.65M with SD3's projection,
    # without it for FLUX.1), OpenCLIP ViT-bigG/14 (694.66M), T5 v1.1 XXL's encoder (4.76B).
    assert count("sd3", "text_encoder") == clip_text_parameters(49408, 77, 768, 3072, 12, 768) == 123_650_304
    assert count("flux", "text_encoder") == clip_text_parameters(49408, 77, 768, 3072, 12, 0)
    assert count("sd3", "text_encoder_2") == clip_text_parameters(49408, 77, 1280, 5120, 32, 1280) == 694_659_840
    t5 = t5_encoder_parameters(32128, 4096, 64 * 64, 10240, 24, 32, 64)
    assert count("sd3", "text_encoder_3") == count("flux", "text_encoder_2") == t5 == 4_762_310_656
    # One VAE layout, each family's own latent normalisation.
    assert count("sd3", "vae") == count("flux", "vae")
    assert (PUBLISHED["sd3"].config("vae")["scaling_factor"], PUBLISHED["flux"].config("vae")["scaling_factor"]) == \
        (1.5305, 0.3611)


def test_full_width_block_materialises_and_runs_in_bf16():
    """One block at the published width (the full model is 60 of them), built on meta then materialised."""
    meta = build_module(QWEN_IMAGE.components["transformer"], QWEN_IMAGE.config("transformer", depth=1))
    transformer = materialise(meta, "cpu", torch.bfloat16, seed=0)
    assert {(p.device.type, p.dtype) for p in transformer.parameters()} == {("cpu", torch.bfloat16)}
    assert parameter_count(transformer) == qwen_image_transformer_parameters(3072, 3584, 64, 16, 2, 128, 1)
    norm = transformer.transformer_blocks[0].attn.norm_q.weight
    assert torch.equal(norm, torch.ones_like(norm))
    with torch.no_grad():
        v = transformer(
            hidden_states=torch.randn(1, 4, 64, dtype=torch.bfloat16),
            encoder_hidden_states=torch.randn(1, 8, 3584, dtype=torch.bfloat16),
            encoder_hidden_states_mask=None,
            timestep=torch.tensor([0.5], dtype=torch.bfloat16),
            img_shapes=[[(1, 2, 2)]],
            return_dict=False,
        )[0]
    assert v.shape == (1, 4, 64) and torch.isfinite(v).all()
    # N(0, 1/fan_in) weights keep the output at the scale of its input, not 0 and not exploding.
    assert 0.2 < v.float().std().item() < 5


def _narrow(entry, overrides):
    components = {}
    for name, component in entry.components.items():
        config = entry.config(name)
        for key, value in overrides.get(name, {}).items():
            *parents, leaf = key.split(".")
            node = config
            for parent in parents:
                node = node[parent]
            node[leaf] = value
        components[name] = dataclasses.replace(component, config=config)
    return dataclasses.replace(entry, components=components)


# Qwen-Image's published structure at test widths (the loading mechanics do not depend on the widths).
NARROW = {
    "transformer": {"num_layers": 1, "attention_head_dim": 32, "num_attention_heads": 2, "joint_attention_dim": 64,
                    "axes_dims_rope": (8, 12, 12)},
    "vae": {"base_dim": 8, "num_res_blocks": 1},
    "text_encoder": {"text_config.hidden_size": 64, "text_config.intermediate_size": 128, "text_config.vocab_size": 1024,
                     "text_config.num_hidden_layers": 1, "text_config.num_attention_heads": 4,
                     "text_config.num_key_value_heads": 2, "text_config.pad_token_id": 0, "text_config.bos_token_id": 0,
                     "text_config.eos_token_id": 2,
                     "text_config.rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
                     "vision_config.depth": 1, "vision_config.hidden_size": 32, "vision_config.intermediate_size": 64,
                     "vision_config.num_heads": 2, "vision_config.out_hidden_size": 64},
}


@pytest.fixture
def narrow_qwen_image(monkeypatch):
    monkeypatch.setitem(PUBLISHED, "qwen_image_narrow", _narrow(QWEN_IMAGE, NARROW))
    return "qwen_image_narrow"


def test_saved_random_pipeline_loads_with_from_pretrained(narrow_qwen_image, tmp_path):
    out = save_random_pipeline(narrow_qwen_image, str(tmp_path / "full"), dtype=torch.bfloat16, seed=3)
    pipe = QwenImagePipeline.from_pretrained(out, dtype=torch.bfloat16)
    expected = published(narrow_qwen_image).config("transformer")
    as_json = lambda config: json.loads(json.dumps({k: config[k] for k in expected}))  # noqa: E731  (tuples = lists)
    assert as_json(pipe.transformer.config) == as_json(expected)
    assert pipe.vae.config.latents_std == QWEN_IMAGE.config("vae")["latents_std"]
    # The weights-at-load directory of the same seed builds the same weights.
    lazy = load_random_init_pipeline(write_random_init_dir(narrow_qwen_image, str(tmp_path / "lazy"), seed=3),
                                     "cpu", torch.bfloat16)
    for name in ("transformer", "vae", "text_encoder"):
        saved, built = getattr(pipe, name).state_dict(), getattr(lazy, name).state_dict()
        assert saved.keys() == built.keys() and all(torch.equal(saved[k], built[k]) for k in saved), name


# SD3.5 Medium's and FLUX.1-dev's published structure at test widths.
NARROW_TEXT = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
               "projection_dim": 16}
NARROW_T5 = {"d_model": 64, "d_kv": 16, "d_ff": 64, "num_layers": 1, "num_heads": 2}
NARROW_VAE = {"block_out_channels": [8, 8, 8, 8], "norm_num_groups": 4, "layers_per_block": 1}
NARROW_BY_ARCH = {
    "qwen_image": NARROW,
    "sd3": {"transformer": {"num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
                            "joint_attention_dim": 64, "caption_projection_dim": 32, "pooled_projection_dim": 48,
                            "pos_embed_max_size": 16, "dual_attention_layers": [0]},
            "vae": NARROW_VAE, "text_encoder": NARROW_TEXT,
            "text_encoder_2": dict(NARROW_TEXT, hidden_size=32, projection_dim=32), "text_encoder_3": NARROW_T5},
    "flux": {"transformer": {"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
                             "joint_attention_dim": 64, "pooled_projection_dim": 16, "axes_dims_rope": (4, 6, 6)},
             "vae": NARROW_VAE, "text_encoder": NARROW_TEXT, "text_encoder_2": NARROW_T5},
}


@pytest.mark.parametrize("arch", ["qwen_image", "sd3", "flux"])
def test_weights_at_load_directory_runs_through_rayflow(arch, monkeypatch, tmp_path):
    """A weights-at-load directory of each published family (narrowed) loads as its DiffusionModel, learner view
    included, and encodes (every text encoder), denoises and decodes at its published structure."""
    monkeypatch.setitem(PUBLISHED, f"{arch}_narrow", _narrow(PUBLISHED[arch], NARROW_BY_ARCH[arch]))
    path = write_random_init_dir(f"{arch}_narrow", str(tmp_path / "lazy"), seed=0)
    assert sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file()) < 1_000_000  # configs and tokenizers only
    model = load_model(path, dtype=torch.float32)
    assert model.pipeline_class == PUBLISHED[arch].pipeline_class
    cond = model.encode_prompt(["a red apple"])
    if arch != "qwen_image":
        assert cond.embeds.shape[1] == 1 + model.padded_text_tokens()  # the pooled row, then the padded sequence
    latents, _ = model.prepare_latents([0], 32, 32)
    v = model.predict_velocity(latents, torch.tensor(500.0), cond, 32, 32)
    assert v.shape == latents.shape and torch.isfinite(v).all()
    assert model.decode(latents, 32, 32).shape == (1, 32, 32, 3)
    learner_view = load_model(path, transformer_only=True)
    assert learner_view.pipe.text_encoder is None and learner_view.pipe.vae is None
    learnt, rollout = learner_view.transformer.state_dict(), model.transformer.state_dict()
    assert learnt.keys() == rollout.keys() and all(torch.equal(learnt[k], rollout[k]) for k in learnt)


def test_make_tiny_model_full_size_needs_random_init(tmp_path, capsys):
    from tools.make_tiny_model import main

    with pytest.raises(SystemExit, match="--random-init"):
        main(["--size", "full", "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="only with --size full"):
        main(["--size", "tiny", "--depth", "2", "--out", str(tmp_path / "y")])
    main(["--size", "full", "--random-init", "--weights-at-load", "--out", str(tmp_path / "z")])
    with open(tmp_path / "z" / "transformer" / "config.json") as f:
        assert json.load(f)["num_layers"] == 60
    main(["--arch", "flux", "--size", "full", "--random-init", "--weights-at-load", "--out", str(tmp_path / "flux")])
    with open(tmp_path / "flux" / "transformer" / "config.json") as f:
        assert (json.load(f)["num_single_layers"]) == 38
    with open(tmp_path / "flux" / "text_encoder_2" / "config.json") as f:
        assert json.load(f)["d_model"] == 4096
