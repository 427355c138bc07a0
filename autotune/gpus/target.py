"""Planning for a GPU you do not have (``--gpu NAME``): the target comes from a GPU profile.

The probe's search runs unchanged, on the estimate backend: fake CPU tensors, the optimizer on
its foreach path as on CUDA, and every allocation replayed on a model of torch's CUDA caching
allocator, so that the peaks are reserved memory (what ``torch.cuda.max_memory_reserved()``
would show, cuBLAS workspaces included). The budget is the profile's memory less what lives
outside torch's allocator (the CUDA context; NCCL's buffers for more than one rank, see
``fixed_costs``). The profile's ``allocator_reserve_bytes`` (kept for fragmentation and
workspaces when only tensor bytes were counted) is no longer subtracted: both are modelled now,
and the plan's headroom guards what the model leaves out. Nothing is allocated and no device is
needed; the plan is marked ``estimated`` so that ``autotune verify`` can check it on the real
device.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, EstimateUnavailable
from ..memory.base import DeviceInfo
from ..memory.fake import EstimateMemoryBackend
from ..probing.estimate import estimate_peak
from ..precision import Precision
from .catalog import GPUProfile, load_profile
from .fixed_costs import nccl_buffer_bytes, outside_torch_bytes
from ..units import format_bytes, option_bytes


@dataclass(frozen=True)
class ProfileTarget:
    profile: GPUProfile
    backend: EstimateMemoryBackend

    def choose_precision(self, requested: str) -> tuple[Precision, str]:
        """Resolve "auto" from the profile (bf16, else fp16 with GradScaler, else fp32); refuse a
        precision the GPU does not support."""
        p = self.profile
        if requested != "auto":
            p.require(requested)
            return Precision.parse(requested), f"{requested} as requested"
        if p.bf16:
            return Precision.BF16, f"auto: the {p.name} profile supports bf16 (no loss scaling needed)"
        if p.fp16:
            return Precision.FP16, f"auto: the {p.name} profile lacks bf16, so fp16 autocast with a GradScaler"
        return Precision.FP32, f"auto: the {p.name} profile supports neither bf16 nor fp16"

    def check_estimable(self, workload, precision: str) -> None:
        """One step on fake tensors, so a model they cannot run fails here, with the way out."""
        try:
            estimate_peak(workload, 1, precision=precision)
        except EstimateUnavailable as exc:
            raise EstimateUnavailable(
                f"--gpu {self.profile.id} plans from memory estimates, and {exc} Plan on the device "
                f"instead: autotune plan {workload.source} --target-batch N on a machine with the "
                f"{self.profile.name} (then autotune verify checks the plan there)") from exc



def profile_target(gpu, *, device=None, memory_limit=None, world_size: int | None = 1) -> ProfileTarget:
    """The target for ``--gpu`` (a bundled profile name or a .toml path); ``world_size`` ranks
    (more than one: NCCL's buffers are kept out of the budget)."""
    for option, value in (("--device", device), ("--memory-limit", memory_limit)):
        if value is not None:
            if option == "--memory-limit" and isinstance(value, int) and not isinstance(value, bool):
                # The CLI hands the limit on in bytes: say it as it was likely typed.
                value = option_bytes(value)
            raise ConfigError(f"{option} {value} and --gpu {gpu} both name the device to plan for; "
                              f"drop {option} (--gpu plans for the profile, without the device)")
    profile = load_profile(gpu)
    nccl = nccl_buffer_bytes(world_size or 1)
    budget = profile.memory_bytes - outside_torch_bytes(profile, world_size or 1)
    outside = f"{format_bytes(profile.cuda_context_bytes)} CUDA context" + (
        f" and {format_bytes(nccl)} of NCCL buffers" if nccl else "")
    if budget <= 0:
        raise ConfigError(
            f"--gpu {gpu}: {profile.name}'s {format_bytes(profile.memory_bytes)} less {outside} "
            f"(for {world_size} ranks) leaves nothing for training; plan for a GPU with more "
            f"memory" + (", or give NCCL less (NCCL_BUFFSIZE, NCCL_MAX_NCHANNELS)" if nccl else ""))
    info = DeviceInfo(
        kind="cuda", name=profile.name, total_bytes=profile.memory_bytes, budget_bytes=budget,
        budget_source=(f"GPU profile {profile.id}: {format_bytes(profile.memory_bytes)} less "
                       f"{outside}, outside torch's allocator; peaks are its reserved memory "
                       f"(caching allocator modelled: fragmentation and cuBLAS workspaces "
                       f"counted, so no {format_bytes(profile.allocator_reserve_bytes)} allocator "
                       f"reserve); estimated"),
    )
    return ProfileTarget(profile, EstimateMemoryBackend(budget, for_cuda=True, target=info))


__all__ = ["ProfileTarget", "profile_target"]
