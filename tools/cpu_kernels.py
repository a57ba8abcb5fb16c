"""The CPU kernels the shapes base's stages train under (tools/pretrain_shapes.py, tools/order_stage.py).

Each CPU library that picks its kernels by the instruction set is held to AVX2: torch's own ops, oneDNN's
convolutions, MKL's BLAS. A kernel for another instruction set rounds differently, and training turns a last bit into
other weights (unpinned, the AVX-512 machines of 2026-11-28 built a VAE that differs from the shipped one in 36% of
its values). Pinned, the x86 CPUs it was checked on (AVX-512 Xeons of 2026-11-25 and 2026-11-28) rebuild the shipped
weights bit for bit; a Sapphire Rapids-class Xeon (avx512_fp16) still rounds one step another way and builds another
VAE (README, Learning on the shapes world: Base). Torch-free, so that a script can pin before torch loads: each
library reads its variable once.
"""

import os

PINNED_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "AVX2"}
PINNED_CAPABILITY = PINNED_KERNELS["ATEN_CPU_CAPABILITY"].upper()
"""What torch.backends.cpu.get_cpu_capability() reports under the pins (and the shipped manifests' cpu_kernels)."""


def pin_kernels() -> None:
    """Call before torch is imported (child processes inherit the variables)."""
    os.environ.update(PINNED_KERNELS)


def unpinned_warning(script: str) -> str | None:
    """A line to print when torch runs other kernels than the pinned ones (a non-x86 CPU, or the script imported
    after torch), else None."""
    import torch

    kernels = torch.backends.cpu.get_cpu_capability()
    if kernels == PINNED_CAPABILITY:
        return None
    return (f"{script}: torch runs {kernels} kernels, not the {PINNED_CAPABILITY} of {PINNED_KERNELS} that the shipped "
            f"weights were trained with: this base will differ from them (run the script as a program, on an x86 CPU "
            f"with AVX2, to rebuild them)")
