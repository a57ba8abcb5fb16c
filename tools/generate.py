"""Generate one image with the deterministic (ODE) sampler and the model's CFG.

    python tools/generate.py --model DIR --prompt "a red apple" --seed 0 --steps 8 --guidance 4 \\
        --height 64 --width 64 --out img.png [--negative-prompt " "] [--save-latents x.pt] [--lora DIR [--adapter NAME]] \\
        [--cfg-parallel-size W]

The CFG policy defaults to the model family's own (Qwen-Image: true_cfg, SD3: standard, FLUX.1:
embedded), and then the latents equal what the family's diffusers pipeline (`QwenImagePipeline`,
`StableDiffusion3Pipeline`, `FluxPipeline`.from_pretrained(DIR)) returns for the same prompt, negative
prompt, seed, steps, guidance (true_cfg_scale / guidance_scale) and size.

With --cfg-parallel-size W > 1 the CFG branches run on the W ranks of a RolloutReplica on a local
Ray (started here unless this process is already connected to one); image and latents are the
same as with W = 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
from PIL import Image

from rayflow.cfg.policy import POLICIES, CFGPolicy, make_policy
from rayflow.checkpoint import find_checkpoint, latest_checkpoint, read_meta
from rayflow.export import export_lora
from rayflow.learner.model import model_identity
from rayflow.models import load_model, model_class, pipeline_class_of
from rayflow.models.base import DiffusionModel
from rayflow.models.lora import DIFFUSERS_LORA_FILE, EMA_ADAPTER, EVAL_EMA_ADAPTER, TRAINED_ADAPTER
from rayflow.paths import check_output_dirs
from rayflow.sampling.denoise import generate
from rayflow.types import RolloutRequest, SamplingParams



SEED_RANGE = (-(2**63), 2**64 - 1)
"""What torch.Generator.manual_seed takes (a negative seed wraps modulo 2**64, as in the pipeline's own generator)."""

CONFIG_KEY_FLAGS = {"sampling.num_steps": "--steps", "sampling.guidance_scale": "--guidance", "sampling.height": "--height",
                    "sampling.width": "--width", "model.path": "--model"}
"""Config keys that the checks this tool calls name, as its flags."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a diffusers pipeline directory")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--negative-prompt", default=" ")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--guidance", type=float, default=4.0, help="CFG scale; 1 disables CFG")
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--cfg-policy", default=None, choices=sorted(POLICIES), help="default: the model family's own")
    parser.add_argument("--lora", default=None,
                        help="a LoRA to load first: a diffusers-format LoRA directory, a rayflow checkpoint, or a run's checkpoints directory (its newest)")
    parser.add_argument("--adapter", default=None, choices=(TRAINED_ADAPTER, EMA_ADAPTER, EVAL_EMA_ADAPTER), help="with a checkpoint as --lora: which adapter (default; old, DiffusionNFT's EMA; ema, the EMA of trainer.ema_decay). Unset: ema when the checkpoint holds it, else default, as tools/export_lora.py")
    parser.add_argument("--out", required=True, help="output image (.png)")
    parser.add_argument("--save-latents", default=None, help="also save the final latents [1, N, C] (torch.save)")
    parser.add_argument("--cfg-parallel-size", type=int, default=1, help="W CFG-parallel ranks on a local Ray (1: in process)")
    args = parser.parse_args(argv)
    if args.cfg_parallel_size < 1:
        parser.error("--cfg-parallel-size must be >= 1")
    # Checked before the model loads: these failed only after sampling, a seed torch cannot take without naming
    # --seed ("Overflow when unpacking long long"), an extension PIL cannot write without naming --out.
    if not SEED_RANGE[0] <= args.seed <= SEED_RANGE[1]:
        parser.error(f"--seed: got {args.seed}; allowed: an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}] (a torch "
                     f"generator's seed)")
    Image.init()
    extension = os.path.splitext(args.out)[1].lower()
    if Image.registered_extensions().get(extension) not in Image.SAVE:
        parser.error(f"--out: {args.out!r} has extension {extension!r}, which PIL cannot write; allowed: an image "
                     f"file such as .png")
    if args.cfg_parallel_size > 1 and args.lora:
        parser.error("--lora is not supported with --cfg-parallel-size > 1 yet (the ranks sample under their own LoRA slot)")
    if args.lora and not os.path.isdir(args.lora):
        parser.error(f"--lora: {args.lora!r} is not a directory (a diffusers LoRA directory or a rayflow checkpoint)")
    if args.adapter and not args.lora:
        parser.error(f"--adapter {args.adapter}: needs --lora (a checkpoint whose adapter to load)")
    check_output_dirs(parser, {"--out": args.out, "--save-latents": args.save_latents})
    return args


def diffusers_lora_dir(path: str, adapter: str | None, scratch: str, model: DiffusionModel) -> str:
    """`path` if it is a diffusers-format LoRA; a checkpoint (or a run's checkpoints directory) is checked against
    `model` (check_trained_on) and exported into `scratch` first. Anything else is refused, naming what was
    looked for."""
    if os.path.isfile(os.path.join(path, DIFFUSERS_LORA_FILE)):
        if adapter is not None:  # it holds one adapter: --adapter would be ignored, and the user misled
            raise SystemExit(f"error: --adapter {adapter}: {path!r} is a diffusers LoRA (one adapter); --adapter "
                             f"chooses among a rayflow checkpoint's adapters")
        check_lora_fits(path, model)
        return path
    if os.path.isfile(os.path.join(path, "meta.json")) or latest_checkpoint(path) is not None:
        checkpoint = find_checkpoint(path)
        check_trained_on(checkpoint, model)
        try:
            return export_lora(checkpoint, scratch, adapter)
        except (ValueError, FileNotFoundError) as e:  # a full fine-tuning checkpoint (no LoRA), an adapter it lacks
            raise SystemExit(f"error: --lora: {e}") from None
    raise SystemExit(f"error: --lora: {path!r} holds neither a diffusers LoRA ({DIFFUSERS_LORA_FILE}) nor a rayflow checkpoint (meta.json)")


def check_lora_fits(path: str, model: DiffusionModel) -> None:
    """A diffusers LoRA that would not load into `model` as it is, refused naming the first few of its tensors (it
    carries no record of its base, as a checkpoint does). Read as the pipeline's load_lora_weights reads it: its
    lora_state_dict converts other trainers' layouts (ComfyUI's "diffusion_model." keys, kohya's "lora_unet_" ones),
    which were refused as another model's. Refused: tensors it loads into no component (keys without the
    "transformer." prefix, as peft's own save_pretrained writes them: diffusers left them out with a warning that
    calls it safe to ignore, and the base model's image came out), and layers the transformer lacks or holds at other
    sizes (peft failed with a traceback of every mismatched tensor, or dropped the missing ones with a warning)."""
    pipeline = type(model.pipe)
    loadable = getattr(pipeline, "_lora_loadable_modules", ["transformer"])
    state_dict = pipeline.lora_state_dict(path, weight_name=DIFFUSERS_LORA_FILE)  # the file load_lora reads
    unloaded = sorted(key for key in state_dict if key.partition(".")[0] not in loadable)
    if unloaded:
        raise SystemExit(f"error: --lora: {path!r}: {len(unloaded)} of its {len(state_dict)} tensors would load into "
                         f"nothing ({pipeline.__name__}.load_lora_weights loads keys that start with one of "
                         f"{[f'{name}.' for name in loadable]}), e.g. " + "; ".join(unloaded[:3]))
    modules = dict(model.transformer.named_modules())
    wrong = []
    for key, tensor in state_dict.items():
        component, _, rest = key.partition(".")
        name, dot, kind = rest.rpartition(".lora_")
        if component != "transformer" or not dot:
            continue  # a text encoder's, or not a LoRA factor: left to diffusers
        module, shape = modules.get(name), tuple(tensor.shape)
        if not isinstance(module, torch.nn.Linear):
            wrong.append(f"{name} (no such linear layer)")
        elif (kind.startswith("A") and shape[1] != module.in_features) or (kind.startswith("B") and shape[0] != module.out_features):
            wrong.append(f"{key} {list(shape)} (the layer is {module.in_features} -> {module.out_features})")
    if wrong:
        raise SystemExit(f"error: --lora: {path!r} was trained on another model than --model "
                         f"{type(model.transformer).__name__}: {len(wrong)} of its tensors do not fit, e.g. "
                         + "; ".join(sorted(set(wrong))[:3]))


def check_trained_on(checkpoint: str, model: DiffusionModel) -> None:
    """A checkpoint trained on another architecture is refused, naming every difference (peft would load what
    matches and drop the rest with a warning); one trained on other weights of the same architecture is loaded
    with a warning (a LoRA moved onto another base is sometimes meant)."""
    saved, current = read_meta(checkpoint)["identity"]["model"], model_identity(model)
    differences = [key for key in ("pipeline", "transformer", "transformer_config") if saved.get(key) != current[key]]
    if differences:
        detail = "; ".join(f"{key}: checkpoint {saved.get(key)!r}, --model {current[key]!r}" for key in differences)
        raise SystemExit(f"error: --lora: {checkpoint} was trained on another model than --model: {detail}")
    if saved.get("weights_fingerprint") != current["weights_fingerprint"]:
        print(f"warning: --lora: {checkpoint} was trained on other weights of this architecture (fingerprint "
              f"{saved.get('weights_fingerprint')}, --model's {current['weights_fingerprint']})", file=sys.stderr)


def generate_on_ray(model_path: str, request: RolloutRequest, policy: CFGPolicy, world_size: int):
    """The request on a RolloutReplica of `world_size` ranks; a local Ray is started (and stopped) unless connected."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep a local Ray on loopback; before ray is imported
    import ray

    from rayflow.config import ModelConfig, RolloutConfig
    from rayflow.rollout import RolloutReplica, RolloutRankSpec

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=world_size, include_dashboard=False)
    try:
        spec = RolloutRankSpec(model=ModelConfig(path=model_path), policy=policy)
        with RolloutReplica.create(spec, RolloutConfig(cfg_parallel_size=world_size)) as replica:
            return replica.generate(request)
    finally:
        if started:
            ray.shutdown()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        sample(args)
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:  # a setting or a file to fix: one line
        message = str(e)
        for key, flag in CONFIG_KEY_FLAGS.items():
            message = message.replace(key, flag)
        raise SystemExit(f"error: {message}") from None


def sample(args: argparse.Namespace) -> None:
    params = SamplingParams(
        height=args.height,
        width=args.width,
        num_steps=args.steps,
        guidance_scale=args.guidance,
        negative_prompt=args.negative_prompt,
        sde_type="ode",
        return_step_indices=[args.steps],
    )
    params.validate()
    request = RolloutRequest("generate", [args.prompt], [0], [0], [args.seed], params)
    family = model_class(pipeline_class_of(args.model))
    policy = make_policy(args.cfg_policy or family.default_cfg_policy)
    family.check_cfg_policy(policy.name, key="--cfg-policy")
    if args.cfg_parallel_size > 1:
        (trajectory,) = generate_on_ray(args.model, request, policy, args.cfg_parallel_size)
    else:
        model = load_model(args.model)
        with tempfile.TemporaryDirectory() as scratch:
            if args.lora:
                model.load_lora(diffusers_lora_dir(args.lora, args.adapter, scratch, model))
        (trajectory,) = generate(model, request, policy)
    Image.fromarray(trajectory.image.numpy()).save(args.out)
    if args.save_latents:
        torch.save(trajectory.latent(args.steps).unsqueeze(0), args.save_latents)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
