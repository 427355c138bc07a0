"""FSDP2's chunking of fake parameters, one chunk at a time (distributed.sharding.wrap): the
same views as ``torch.chunk``, and estimates to the byte the same."""

import contextlib
import pathlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autotune.distributed.sharding import wrap
from autotune.memory.fake import EstimateMemoryBackend
from autotune.probing.api import window_trial

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _padded_chunks(tensor, count, dim):
    chunks = list(torch.chunk(tensor, count, dim=dim))
    while len(chunks) < count:
        chunks.append(chunks[0].new_empty(0))
    return chunks


@pytest.mark.parametrize("size", [1, 3, 7, 8, 100, 127, 128, 129, 1000])
@pytest.mark.parametrize("count", [1, 2, 3, 8, 128, 256])
@pytest.mark.parametrize("dim", [0, 1])
def test_narrowed_chunks_are_the_views_torch_chunk_makes(size, count, dim):
    with FakeTensorMode():
        tensor = torch.empty(size, 5) if dim == 0 else torch.empty(5, size)
        expected = _padded_chunks(tensor, count, dim)
        got = wrap._NarrowedChunks(tensor, count, dim)
        assert len(got) == len(expected) == count
        for index in [*range(count), -1]:
            a, b = got[index], expected[index]
            assert (a.shape, a.stride(), a.storage_offset(), a.dtype) == \
                   (b.shape, b.stride(), b.storage_offset(), b.dtype)
            if b.numel():
                assert a.untyped_storage()._cdata == tensor.untyped_storage()._cdata
        assert [c.shape for c in got[1:3]] == [c.shape for c in expected[1:3]]
        with pytest.raises(IndexError):
            got[count]


def test_real_parameters_are_chunked_as_fsdp2_chunks_them():
    chunked = []
    with wrap._few_fake_chunks():
        from torch.distributed.fsdp._fully_shard import _fsdp_param

        real = _fsdp_param._chunk_with_empty(torch.arange(10.0), 4, 0)
        with FakeTensorMode():
            chunked = _fsdp_param._chunk_with_empty(torch.empty(10), 4, 0)
    assert isinstance(real, list) and [c.tolist() for c in real] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert isinstance(chunked, wrap._NarrowedChunks)
    assert _fsdp_param._chunk_with_empty is not None and not isinstance(
        _fsdp_param._chunk_with_empty(torch.arange(4.0), 2, 0), wrap._NarrowedChunks)


@pytest.mark.parametrize("for_cuda", [False, True])
def test_a_sharded_estimate_is_the_same_with_few_fake_chunks(monkeypatch, for_cuda):
    def trial():
        return window_trial(ROOT / "examples" / "tiny_lm.py", EstimateMemoryBackend(None, for_cuda=for_cuda),
                            micro_batch=2, window=2, precision="bf16", checkpointing="on",
                            sharding="fsdp", world_size=64)

    made = []
    original = wrap._NarrowedChunks.__init__
    monkeypatch.setattr(wrap._NarrowedChunks, "__init__",
                        lambda self, *a: made.append(a[1]) or original(self, *a))
    few = trial()
    assert made and set(made) == {64}
    monkeypatch.setattr(wrap, "_few_fake_chunks", contextlib.nullcontext)
    made.clear()
    every = trial()
    assert not made
    fields = ("peak_bytes", "activation_peak_bytes", "step_peak_bytes", "baseline_bytes", "gradient_bytes",
              "held_gradient_bytes", "reserved_peak_bytes", "allocated_peak_bytes")
    assert [getattr(few, f) for f in fields] == [getattr(every, f) for f in fields]
