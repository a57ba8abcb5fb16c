"""rayflow.distributed.tensor_pickle: tensors through Ray's pickling as their raw bytes, rebuilt exactly and in
storage of their own; shared tensors still pickled once."""

import io
import json
import os
import pickle
import sys

import pytest
import torch

from rayflow.distributed.tensor_pickle import install, reduce_tensor


class TensorPickler(pickle.Pickler):
    """A pickler that reduces tensors as Ray does once `install()` ran."""

    dispatch_table = {torch.Tensor: reduce_tensor}


def round_trip(obj):
    """obj through TensorPickler with protocol 5's out-of-band buffers (as Ray's object store moves them)."""
    buffers, out = [], io.BytesIO()
    TensorPickler(out, protocol=5, buffer_callback=buffers.append).dump(obj)
    return pickle.loads(out.getvalue(), buffers=buffers), buffers


def cases() -> dict[str, torch.Tensor]:
    return {
        "float32": torch.randn(7, 4, 16), "bfloat16": torch.randn(3, 5).to(torch.bfloat16),
        "float16": torch.randn(4, dtype=torch.float16), "bool": torch.tensor([True, False, True]),
        "int64": torch.arange(6), "uint8 image": torch.randint(0, 256, (8, 8, 3), dtype=torch.uint8),
        "complex64": torch.randn(3, dtype=torch.complex64), "0-dim": torch.tensor(2.5), "empty": torch.zeros(0, 4, 16),
        "strided view": torch.randn(4, 6)[:, ::2], "row of a batch": torch.randn(8, 5, 3)[2],
        "conjugate view": torch.randn(3, dtype=torch.complex64).conj(), "negative view": torch._neg_view(torch.randn(4)),
        "requires grad": torch.randn(3, requires_grad=True), "sparse": torch.randn(4, 4).relu().to_sparse(),
    }


@pytest.mark.parametrize("name", list(cases()))
def test_every_kind_of_tensor_comes_back_equal_in_storage_of_its_own(name):
    tensor = cases()[name]
    restored, buffers = round_trip(tensor)
    assert restored.dtype == tensor.dtype and restored.shape == tensor.shape and restored.layout == tensor.layout
    assert restored.requires_grad == tensor.requires_grad
    if tensor.is_sparse:
        assert torch.equal(restored.to_dense(), tensor.to_dense()) and not buffers  # torch's own format
        return
    assert torch.equal(restored.detach().resolve_conj().resolve_neg(), tensor.detach().resolve_conj().resolve_neg())
    assert not restored.is_conj() and not restored.is_neg() and restored.is_contiguous()
    # One out-of-band buffer of exactly the tensor's bytes, and the result does not alias it.
    assert [memoryview(b).nbytes for b in buffers] == [tensor.nbytes]
    before = bytes(memoryview(buffers[0]))
    restored.detach().fill_(1)
    assert bytes(memoryview(buffers[0])) == before


def test_a_tensor_shared_by_several_objects_is_pickled_once_and_comes_back_shared():
    shared, own = torch.arange(6, dtype=torch.float32), torch.ones(3)
    (first, second, third), buffers = round_trip([shared, shared, own])
    assert first is second and third is not first and len(buffers) == 2


def test_installed_in_an_actor_its_payloads_name_the_unpacking_and_arrive_exact(ray_session):
    ray = ray_session

    @ray.remote
    class Sender:
        def __init__(self, installed: bool):
            if installed:
                install()

        def send(self):
            import ray.cloudpickle

            shared = torch.arange(5)
            payload = ray.cloudpickle.dumps(shared, protocol=5)
            return b"unpack_tensor" in payload, [shared, shared, torch.randn(7, 4, 16).to(torch.bfloat16)]

    for installed in (False, True):
        sender = Sender.remote(installed)
        try:
            named, (a, b, c) = ray.get(sender.send.remote())
        finally:
            ray.kill(sender)
        assert named == installed  # without install(), torch's own pickling, which receivers read as before
        assert a is b and torch.equal(a, torch.arange(5)) and c.dtype == torch.bfloat16 and c.shape == (7, 4, 16)


def test_the_benchmark_sends_a_request_in_its_own_bytes_where_batch_rows_and_torch_pickling_sent_the_batch(tmp_path):
    """tools/bench.py trajectories on the shapes recipe's sizes: 8 samples, each latents, means and image a row of a
    batch tensor before; pickled by torch, every row carries its whole batch (about 8x the request's bytes)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import bench

    out = tmp_path / "traj.json"
    bench.main(["trajectories", "--shape", "shapes", "--repeats", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    held, ways = result["tensor_bytes"], result["ways"]
    assert ways["rows, torch pickle"]["bytes"] > 6 * held
    for way in ("own, torch pickle", "rows, raw bytes", "own, raw bytes"):
        assert held <= ways[way]["bytes"] <= 1.05 * held, way
    assert ways["own, raw bytes"]["out_of_band_buffers"] == 8 * 4 + 6  # per sample 4; 6 shared by the request, once
