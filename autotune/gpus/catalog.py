"""GPU profiles: what a GPU offers, as data (TOML), for planning on a device you do not have.

The bundled profiles are the repository's top-level ``profiles/*.toml``, installed as the package
``autotune.profiles`` (package data, so a wheel ships them; an editable install reads the folder).
A profile is named by its file's stem (``a100-40gb``); a user's own profile is passed by path.
"""

from __future__ import annotations

import importlib.resources
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 reads TOML with the tomli backport
    import tomli as tomllib

from ..errors import ConfigError
from ..precision import Precision


@dataclass(frozen=True, kw_only=True)
class GPUProfile:
    """One GPU: memory, precision support, peak throughput and what to keep free."""

    id: str
    """The file's stem, e.g. "a100-40gb"; what ``--gpu`` takes."""
    name: str
    memory_bytes: int
    """Memory on the datasheet."""
    bf16: bool
    fp16: bool
    peak_tflops_fp32: float
    peak_tflops_fp16: float
    """Dense tensor-core peak (FP32 accumulate); 0 where unsupported."""
    peak_tflops_bf16: float
    memory_bandwidth_gb_per_s: float
    cuda_context_bytes: int
    """CUDA context and driver reservations, invisible to torch's counters."""
    allocator_reserve_bytes: int
    """Kept free for allocator fragmentation and cuBLAS/cuDNN workspaces."""
    source: str = ""
    notes: str = ""
    path: str = ""
    # Links, for timing communication (autotune.timing.comm); optional, so older profiles load.
    gpu_link_gb_per_s: float | None = None
    """GPU-to-GPU bandwidth within a host, one direction, GB/s (NVLink, else PCIe)."""
    gpu_link_latency_us: float = 0.0
    network_gbps: float | None = None
    """Each GPU's share of the network between hosts, Gb/s (the NIC per GPU)."""
    network_latency_us: float = 0.0
    gpus_per_node: int = 8
    """GPUs in the reference host the link figures come from."""

    @property
    def budget_bytes(self) -> int:
        """What one rank's training step may use, as a ``--gpu`` plan for one rank counts it
        (``gpus.target``): memory less the CUDA context. The caching allocator is modelled, so the
        allocator reserve is not taken off; several ranks also leave NCCL's buffers outside."""
        return self.memory_bytes - self.cuda_context_bytes

    def require(self, precision: str) -> None:
        """Refuse a precision this GPU does not support ("auto" is always taken)."""
        if precision == "auto" or self.supports(precision):
            return
        usable = ", ".join(x.value for x in Precision if self.supports(x))
        raise ConfigError(f"--precision {precision}: the {self.name} (--gpu {self.id}) does not "
                          f"support {precision}; use auto or one of {usable}")

    def supports(self, precision) -> bool:
        precision = Precision.parse(precision)
        return precision is Precision.FP32 or getattr(self, precision.value)

    def peak_tflops(self, precision) -> float:
        return getattr(self, f"peak_tflops_{Precision.parse(precision).value}")

    def to_dict(self) -> dict:
        return {**asdict(self), "budget_bytes": self.budget_bytes}


MAX_DEVICE_BYTES = 2**50
"""1 PiB: a bound far above any accelerator's memory, so a typo'd exponent is caught."""

# field -> (kind, required); kinds are checked by _check_field.
_FIELDS = {
    "name": ("text", True),
    "memory_bytes": ("bytes", True),
    "bf16": ("bool", True),
    "fp16": ("bool", True),
    "peak_tflops_fp32": ("tflops", True),
    "peak_tflops_fp16": ("tflops", True),
    "peak_tflops_bf16": ("tflops", True),
    "memory_bandwidth_gb_per_s": ("positive", True),
    "cuda_context_bytes": ("reserve", True),
    "allocator_reserve_bytes": ("reserve", True),
    "source": ("text", False),
    "notes": ("text", False),
    "gpu_link_gb_per_s": ("positive", False),
    "gpu_link_latency_us": ("latency", False),
    "network_gbps": ("positive", False),
    "network_latency_us": ("latency", False),
    "gpus_per_node": ("count", False),
}


def bundled_profiles_dir():
    """The folder of bundled profiles, wherever the package is installed."""
    try:
        return importlib.resources.files("autotune.profiles")
    except ModuleNotFoundError:
        # An editable install made before profiles/ moved to the top level maps only autotune/;
        # the folder is then the checkout's own (reinstalling maps it as the package).
        return Path(__file__).resolve().parents[2] / "profiles"


def list_profiles() -> list[GPUProfile]:
    """Every bundled profile, smallest memory first."""
    folder = bundled_profiles_dir()
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".toml")), key=lambda f: f.name)
    profiles = [_parse(f.read_text(encoding="utf-8"), id=f.name[: -len(".toml")], where=str(f))
                for f in files]
    return sorted(profiles, key=lambda p: (p.memory_bytes, p.id))


def load_profile(name_or_path) -> GPUProfile:
    """A bundled profile by name (``"h100-80gb"``, case-insensitive) or a profile file by path."""
    if isinstance(name_or_path, GPUProfile):
        return name_or_path
    text = str(name_or_path)
    path = Path(text)
    if path.suffix == ".toml" or path.is_file() or any(sep in text for sep in ("/", "\\")):
        return _load_file(path)
    bundled = bundled_profiles_dir().joinpath(f"{text.lower()}.toml")
    if not bundled.is_file():
        names = ", ".join(p.id for p in list_profiles())
        raise ConfigError(
            f"GPU profile {text!r} (--gpu) is not bundled; use one of {names}, "
            f"or the path to your own profile .toml file"
        )
    return _parse(bundled.read_text(encoding="utf-8"), id=text.lower(), where=str(bundled))


def _load_file(path: Path) -> GPUProfile:
    if not path.is_file():
        raise ConfigError(f"GPU profile file {path} does not exist; give a bundled profile name "
                          f"(autotune profiles lists them) or the path to a .toml file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"GPU profile file {path} cannot be read: {exc}") from exc
    return _parse(text, id=path.stem, where=str(path))


def _parse(text: str, *, id: str, where: str) -> GPUProfile:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"GPU profile {where} is not valid TOML: {exc}") from exc
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"GPU profile {where}: unknown field(s) {', '.join(unknown)}; "
                          f"the fields are {', '.join(_FIELDS)}")
    missing = [name for name, (_, required) in _FIELDS.items() if required and name not in data]
    if missing:
        raise ConfigError(f"GPU profile {where}: missing field(s) {', '.join(missing)}")
    for name, value in data.items():
        _check_field(where, name, _FIELDS[name][0], value)
    profile = GPUProfile(id=id, path=where, **data)
    _check_consistency(profile, where)
    return profile


def _check_field(where: str, name: str, kind: str, value) -> None:
    # bool is an int in Python; a `true` in a number field is a mistake, not 1.
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    is_int = is_number and isinstance(value, int)
    checks = {
        "text": (isinstance(value, str) and (name != "name" or bool(value.strip())),
                 "a non-empty string"),
        "bool": (isinstance(value, bool), "true or false"),
        "bytes": (is_int and 0 < value <= MAX_DEVICE_BYTES,
                  f"a positive integer number of bytes, at most {MAX_DEVICE_BYTES} (1 PiB)"),
        "reserve": (is_int and 0 <= value <= MAX_DEVICE_BYTES,
                    f"an integer number of bytes, 0 to {MAX_DEVICE_BYTES} (1 PiB)"),
        "tflops": (is_number and math.isfinite(value) and 0 <= value <= 1e9,
                   "a number of TFLOP/s, 0 to 1e9"),
        "positive": (is_number and math.isfinite(value) and 0 < value <= 1e12, "a positive number up to 1e12"),
        "latency": (is_number and math.isfinite(value) and 0 <= value <= 1e6,
                    "a number of microseconds, 0 to 1e6"),
        "count": (is_int and 1 <= value <= 1_000_000, "a whole number, at least 1"),
    }
    ok, want = checks[kind]
    if not ok:
        raise ConfigError(f"GPU profile {where}: field {name} = {value!r} is invalid; it must be {want}")


def _check_consistency(profile: GPUProfile, where: str) -> None:
    if profile.peak_tflops_fp32 <= 0:
        raise ConfigError(f"GPU profile {where}: field peak_tflops_fp32 must be more than 0")
    for precision in ("bf16", "fp16"):
        supported, tflops = getattr(profile, precision), getattr(profile, f"peak_tflops_{precision}")
        if supported and tflops <= 0:
            raise ConfigError(f"GPU profile {where}: {precision} = true needs peak_tflops_{precision} "
                              f"more than 0")
        if not supported and tflops != 0:
            raise ConfigError(f"GPU profile {where}: {precision} = false, so peak_tflops_{precision} "
                              f"must be 0 (got {tflops})")
    if profile.cuda_context_bytes + profile.allocator_reserve_bytes >= profile.memory_bytes:
        raise ConfigError(
            f"GPU profile {where}: cuda_context_bytes + allocator_reserve_bytes "
            f"({profile.cuda_context_bytes + profile.allocator_reserve_bytes}) must be less than "
            f"memory_bytes ({profile.memory_bytes})"
        )


__all__ = ["GPUProfile", "bundled_profiles_dir", "list_profiles", "load_profile"]
