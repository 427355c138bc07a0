import pytest
import torch

from autotune import is_oom_error
from autotune.errors import ConfigError
from autotune.units import format_bytes, parse_bytes


@pytest.mark.parametrize("text, expected", [
    ("8GiB", 8 * 1024**3), ("512MiB", 512 * 1024**2), ("1.5GB", 1_500_000_000),
    ("1000000", 1_000_000), (4096, 4096), ("2 kib", 2048), ("1e3", 1000),
])
def test_parse_bytes_accepts_si_and_iec_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "12xx", "GiB", "-5MiB", "0", 0, True, "1.2.3GB"])
def test_parse_bytes_rejects_bad_sizes_naming_the_option(text):
    with pytest.raises(ConfigError) as info:
        parse_bytes(text, option="--memory-limit")
    assert "--memory-limit" in str(info.value)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 1024**3) == "3.00 GiB"
    assert format_bytes(None) == "-"


@pytest.mark.parametrize("exc", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    torch.cuda.OutOfMemoryError("x"),
    MemoryError(),
    RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 123 bytes"),
    RuntimeError("CUDA error: out of memory"),
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
])
def test_out_of_memory_errors_are_recognised(exc):
    assert is_oom_error(exc)


@pytest.mark.parametrize("exc", [
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"),
    ValueError("out of memory"),  # only RuntimeErrors carry allocator failures
    TypeError("forward() missing 1 required positional argument"),
    KeyboardInterrupt(),
])
def test_other_errors_are_not_out_of_memory(exc):
    assert not is_oom_error(exc)
