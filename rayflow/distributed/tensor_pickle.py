"""Tensors through Ray's object store as their raw bytes.

By default a `torch.Tensor` pickles through torch's own storage serializer: every storage is written with
`torch.save` into a bytes object, and read back with `torch.load`, about 40 µs of Python per tensor each way
whatever its size. A rollout request's trajectories hold about ten tensors per sample, and every one crosses
the object store at least twice (rollout rank -> reward worker, -> learner). `install()` makes this process's
Ray pickle a dense tensor as (dtype, shape, a uint8 numpy view of its bytes): pickle protocol 5 moves the view
out of band, with one memcpy, and the receiver copies it into a fresh tensor (so it never writes into the object
store's shared memory, as a zero-copy tensor could). Anything else (sparse, quantized, meta) keeps torch's way.

It changes only how a process sends: whoever receives calls `unpack_tensor`, which the payload names. Rollout
ranks, learner ranks, the weight-sync actor and the driver's Trainer install it as they start (reward workers send
back numbers only); a process that does not still reads what the others send.
"""

from __future__ import annotations

import io

import numpy as np
import torch


def unpack_tensor(packed: tuple) -> torch.Tensor:
    """The tensor `pack_tensor` took apart, in storage of its own."""
    dtype, shape, data, device, requires_grad = packed
    if isinstance(data, bytes):  # torch.save of a tensor pack_tensor does not take apart
        return torch.load(io.BytesIO(data), weights_only=False)
    kind = getattr(torch, dtype)
    if data.size == 0:
        tensor = torch.empty(shape, dtype=kind)
    else:
        tensor = torch.from_numpy(np.array(data, copy=True)).view(kind).reshape(shape)
    if device != "cpu":
        tensor = tensor.to(device)
    return tensor.requires_grad_(requires_grad)


def pack_tensor(tensor: torch.Tensor) -> tuple:
    """(dtype, shape, its bytes as a uint8 numpy array, device, requires_grad); torch.save's bytes in place of the
    array (dtype "") for a tensor that is not dense."""
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.device.type == "meta":
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        return "", (), buffer.getvalue(), "cpu", False
    flat = tensor.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy()
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), data, str(tensor.device), tensor.requires_grad


def reduce_tensor(tensor: torch.Tensor) -> tuple:
    """The pickle reduction `install()` gives Ray for a tensor (for a pickler's dispatch_table outside Ray)."""
    return unpack_tensor, (pack_tensor(tensor),)


def install() -> None:
    """Pickle this process's `torch.Tensor`s (exactly that type, not subclasses such as nn.Parameter) for Ray with
    `pack_tensor`; receivers rebuild them with `unpack_tensor`. Needs a connected Ray worker or driver; idempotent."""
    import ray.util

    ray.util.register_serializer(torch.Tensor, serializer=pack_tensor, deserializer=unpack_tensor)
