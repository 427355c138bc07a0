"""GPU profiles: the bundled set, loading by name or path, and clear errors for bad files."""

import shutil
import subprocess
import sys
import zipfile

import pytest
from click.testing import CliRunner

from autotune.cli.main import cli
from autotune.errors import ConfigError
from autotune.gpus.catalog import GPUProfile, bundled_profiles_dir, list_profiles, load_profile

from conftest import ROOT

REQUIRED = ("t4", "v100-16gb", "v100-32gb", "a10g", "l4", "a100-40gb", "a100-80gb", "h100-80gb",
            "h200-141gb", "rtx-3090", "rtx-4090")

GOOD = """\
name = "Test GPU"
memory_bytes = 8_589_934_592
bf16 = true
fp16 = true
peak_tflops_fp32 = 10
peak_tflops_fp16 = 80
peak_tflops_bf16 = 80.5
memory_bandwidth_gb_per_s = 500
cuda_context_bytes = 536_870_912
allocator_reserve_bytes = 536_870_912
"""


def write(tmp_path, text, name="my-gpu.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def replace_line(field, line):
    return "\n".join(line if row.startswith(f"{field} ") else row for row in GOOD.splitlines()) + "\n"


def test_every_required_gpu_is_bundled_and_valid():
    profiles = {p.id: p for p in list_profiles()}
    assert set(REQUIRED) <= set(profiles)
    for profile in profiles.values():
        assert 0 < profile.budget_bytes < profile.memory_bytes
        assert profile.peak_tflops_fp32 > 0 and profile.memory_bandwidth_gb_per_s > 0
        assert profile.source, f"{profile.id} says where its figures come from"


def test_known_datasheet_facts():
    assert load_profile("a100-40gb").memory_bytes == 40 * 2**30
    assert load_profile("h100-80gb").peak_tflops("bf16") == pytest.approx(989.5)
    for name in ("t4", "v100-16gb", "v100-32gb"):
        assert not load_profile(name).supports("bf16") and load_profile(name).supports("fp16")
    assert load_profile("a100-80gb").supports("bf16")
    assert load_profile("l4").supports("fp32")


def test_load_by_name_is_case_insensitive():
    assert load_profile("H100-80GB") == load_profile("h100-80gb")


def test_load_user_profile_by_path(tmp_path):
    profile = load_profile(write(tmp_path, GOOD))
    assert isinstance(profile, GPUProfile)
    assert profile.id == "my-gpu" and profile.name == "Test GPU"
    assert profile.budget_bytes == 8 * 2**30 - 2**29  # less the context alone, as a plan's
    assert load_profile(str(tmp_path / "my-gpu.toml")) == profile


def test_unknown_name_lists_the_bundled_profiles():
    with pytest.raises(ConfigError, match="'b300'.*not bundled.*a100-40gb.*h200-141gb"):
        load_profile("b300")


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="nope.toml does not exist"):
        load_profile(tmp_path / "nope.toml")


def test_missing_field_names_file_and_field(tmp_path):
    text = "\n".join(r for r in GOOD.splitlines() if not r.startswith("memory_bandwidth"))
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=r"my-gpu\.toml: missing field\(s\) memory_bandwidth_gb_per_s"):
        load_profile(path)


@pytest.mark.parametrize("field, line, message", [
    ("memory_bytes", 'memory_bytes = "lots"', "field memory_bytes = 'lots' is invalid"),
    ("memory_bytes", "memory_bytes = 0", "memory_bytes = 0 is invalid"),
    ("bf16", 'bf16 = "yes"', "field bf16 = 'yes' is invalid; it must be true or false"),
    ("peak_tflops_fp32", "peak_tflops_fp32 = true", "peak_tflops_fp32 = True is invalid"),
    ("peak_tflops_fp16", "peak_tflops_fp16 = -1", "peak_tflops_fp16 = -1 is invalid"),
    ("name", 'name = " "', "field name = ' ' is invalid"),
    ("cuda_context_bytes", "cuda_context_bytes = 1.5", "cuda_context_bytes = 1.5 is invalid"),
    ("bf16", "bf16 = false", "bf16 = false, so peak_tflops_bf16 must be 0"),
    ("allocator_reserve_bytes", "allocator_reserve_bytes = 9_000_000_000",
     "must be less than memory_bytes"),
])
def test_bad_field_names_file_and_field(tmp_path, field, line, message):
    path = write(tmp_path, replace_line(field, line))
    with pytest.raises(ConfigError, match="my-gpu.toml") as info:
        load_profile(path)
    assert message in str(info.value)


def test_supported_precision_needs_throughput(tmp_path):
    path = write(tmp_path, replace_line("peak_tflops_bf16", "peak_tflops_bf16 = 0"))
    with pytest.raises(ConfigError, match="bf16 = true needs peak_tflops_bf16 more than 0"):
        load_profile(path)


def test_unknown_field_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="unknown field\\(s\\) memory_gb"):
        load_profile(write(tmp_path, GOOD + "memory_gb = 8\n"))
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_profile(write(tmp_path, GOOD + "oops =\n"))


def test_cli_lists_every_profile():
    result = CliRunner().invoke(cli, ["profiles"])
    assert result.exit_code == 0, result.output
    for name in REQUIRED:
        assert name in result.output


def test_cli_checks_a_user_file(tmp_path):
    result = CliRunner().invoke(cli, ["profiles", str(write(tmp_path, GOOD)), "--json"])
    assert result.exit_code == 0, result.output
    assert '"name": "Test GPU"' in result.output and '"budget_bytes": 8053063680' in result.output
    bad = CliRunner().invoke(cli, ["profiles", str(write(tmp_path, "name = 1\n", "bad.toml"))])
    assert bad.exit_code == 2 and "bad.toml" in bad.output


def test_profiles_live_in_one_place_with_their_field_guide():
    assert not (ROOT / "autotune" / "gpus" / "profiles").exists(), "profiles live in profiles/ only"
    assert not (ROOT / "autotune" / "profiles").exists(), "profiles live in profiles/ only"
    assert {p.stem for p in (ROOT / "profiles").glob("*.toml")} == set(REQUIRED)
    assert bundled_profiles_dir().joinpath("a100-40gb.toml").is_file()
    assert "memory_bytes" in bundled_profiles_dir().joinpath("README.md").read_text()


def test_built_wheel_ships_the_profiles(tmp_path):
    # About 3 s, so not marked slow. Build from a copy: an in-tree build would write build/ and *.egg-info into the shared tree.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src)
    for name in ("autotune", "profiles"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(out), str(src)], check=True, timeout=300)
    (wheel,) = out.glob("autotune-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in REQUIRED:
        assert f"autotune/profiles/{name}.toml" in names
    assert "autotune/profiles/README.md" in names
    assert "autotune/gpus/catalog.py" in names
    assert "autotune/planning/schemas/plan.schema.json" in names


def test_the_profiles_budget_is_the_one_a_one_rank_plan_uses():
    # The table took the allocator reserve off too (t4: 13.75 GiB), which plans no longer do (14.75).
    from autotune.gpus.target import profile_target

    for name in ("t4", "h100-80gb", "a100-40gb"):
        profile = load_profile(name)
        assert profile_target(name, world_size=1).backend.info().budget_bytes == profile.budget_bytes
