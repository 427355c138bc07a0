import gc

import pytest
import torch

from autotune.memory import CPUMemoryBackend, backend_for, resolve_device
from autotune.errors import ConfigError


def test_tracker_counts_live_storages_and_forgets_freed_ones():
    backend = CPUMemoryBackend(memory_limit="1GiB")
    with backend.tracking():
        before = backend.current_bytes()
        a = torch.zeros(1000, dtype=torch.float32)
        b = a.view(10, 100)  # a view shares the storage: counted once
        assert backend.current_bytes() - before == 4000
        c = torch.ones(500, dtype=torch.float64)
        assert backend.current_bytes() - before == 8000
        del a, b
        gc.collect()
        assert backend.current_bytes() - before == 4000
        del c
        gc.collect()
        assert backend.current_bytes() == before


def test_peak_is_the_highest_usage_since_reset():
    backend = CPUMemoryBackend(memory_limit="1GiB")
    with backend.tracking():
        backend.reset_peak()
        start = backend.current_bytes()
        x = torch.empty(2500)  # 10 kB
        del x
        gc.collect()
        y = torch.empty(250)
        assert backend.peak_bytes() - start == 10_000
        backend.reset_peak()
        assert backend.peak_bytes() - start == 1000
        del y


def test_passing_the_budget_raises_torch_out_of_memory():
    backend = CPUMemoryBackend(memory_limit=10_000)
    with backend.tracking():
        keep = torch.empty(2000)  # 8 kB fits
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.empty(1000)  # +4 kB does not
    assert "DefaultCPUAllocator: can't allocate memory" in str(info.value)
    assert keep.numel() == 2000


def test_adopt_counts_tensors_allocated_before_tracking():
    model = torch.nn.Linear(100, 100)  # 10100 floats
    backend = CPUMemoryBackend(memory_limit="1GiB")
    backend.adopt(model.parameters())
    backend.adopt(model.parameters())  # adopting twice counts once
    assert backend.current_bytes() == 10100 * 4


def test_backward_and_optimizer_state_are_counted():
    backend = CPUMemoryBackend(memory_limit="1GiB")
    with backend.tracking():
        model = torch.nn.Linear(256, 256, bias=False)
        params = 256 * 256 * 4
        optimizer = torch.optim.Adam(model.parameters(), foreach=False)
        model(torch.randn(4, 256)).sum().backward()
        optimizer.step()
        # parameters + gradient + exp_avg + exp_avg_sq (+ a scalar step counter)
        assert backend.current_bytes() >= 4 * params
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        assert 3 * params <= backend.current_bytes() < 4 * params


def test_default_budget_comes_from_available_ram():
    info = CPUMemoryBackend().info()
    assert 0 < info.budget_bytes < info.total_bytes
    assert "psutil" in info.budget_source


def test_the_device_name_says_how_many_threads_torch_runs_on():
    """A throughput study is keyed by the device's name: under OMP_NUM_THREADS=1 the name read
    "2 threads" as at two, and a study timed at one thread was taken as this one's."""
    import psutil

    saved = torch.get_num_threads()
    try:
        logical = psutil.cpu_count(logical=True)
        torch.set_num_threads(logical)
        everything = CPUMemoryBackend(memory_limit="1GiB").info().name
        assert "torch uses" not in everything
        torch.set_num_threads(logical - 1 if logical > 1 else 2)
        fewer = CPUMemoryBackend(memory_limit="1GiB").info().name
        assert f"torch uses {torch.get_num_threads()})" in fewer and fewer != everything
    finally:
        torch.set_num_threads(saved)


def test_device_resolution():
    assert resolve_device("cpu").type == "cpu"
    assert isinstance(backend_for("cpu", "64MiB"), CPUMemoryBackend)
    with pytest.raises(ConfigError) as info:
        resolve_device("tpu")
    assert "--device" in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_asking_for_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(ConfigError) as info:
        backend_for("cuda")
    assert "--device cpu" in str(info.value)


def test_a_refused_allocation_holds_nothing_so_an_oom_handler_can_allocate_again():
    backend = CPUMemoryBackend(memory_limit=10_000)
    with backend.tracking():
        keep = torch.empty(2000)  # 8 kB of 10 kB
        in_use = backend.current_bytes()
        try:
            torch.empty(1000)  # refused
        except torch.OutOfMemoryError:
            # inside the handler, as Lightning's and Accelerate's run: usage is as before the request
            assert backend.current_bytes() == in_use
            small = torch.empty(100)  # 400 B still fits
            assert backend.current_bytes() == in_use + 400
            del small
    assert keep.numel() == 2000


def test_a_real_runs_tracking_counts_nothing_made_in_a_fake_mode_of_torchs_own():
    # DTensor's sharding propagation runs an op on fake tensors of the global shape in a fake
    # mode of its own: nothing is allocated, and the CPU backend counted it (a context-parallel
    # plan's verify measured 987,208 bytes where the run held 829,256).
    from torch._subclasses.fake_tensor import FakeTensorMode

    backend = CPUMemoryBackend("1GiB")
    with backend.tracking():
        real = torch.ones(1024)
        with FakeTensorMode():
            fake = torch.ones(1 << 20) * 2
        assert fake.shape == (1 << 20,)
        assert backend.current_bytes() == real.untyped_storage().nbytes() == 4096
