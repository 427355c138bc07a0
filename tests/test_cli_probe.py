import json
import subprocess
import sys

from click.testing import CliRunner

from autotune.cli.main import cli

from conftest import EXAMPLES

MLP = str(EXAMPLES / "mlp.py")


def run(*args):
    return CliRunner().invoke(cli, list(args))


def test_probe_prints_the_trials_and_the_answer():
    result = run("probe", MLP, "--memory-limit", "52MiB", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "largest micro-batch that fits:" in result.output
    assert "trial" in result.output and "OOM" in result.output


def test_probe_json_is_the_probe_result():
    result = run("probe", MLP, "--memory-limit", "52MiB", "--max-micro-batch", "8", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # stderr logs the trials
    assert data["max_micro_batch"] == 8 and data["capped"] is True
    assert data["device"]["budget_bytes"] == 52 * 1024**2
    assert {"micro_batch", "fits", "peak_bytes", "seconds"} <= set(data["trials"][0])


def test_a_model_that_does_not_fit_exits_1_with_a_message_and_no_traceback():
    result = run("probe", MLP, "--memory-limit", "1MiB")
    assert result.exit_code == 1
    assert "does not fit" in result.output and "Traceback" not in result.output


def test_usage_errors_exit_2_and_name_the_option(tmp_path):
    bad_limit = run("probe", MLP, "--memory-limit", "lots")
    assert bad_limit.exit_code == 2 and "--memory-limit" in bad_limit.output
    missing = run("probe", str(tmp_path / "missing.py"))
    assert missing.exit_code == 2 and "missing.py" in missing.output
    zero = run("probe", MLP, "--max-micro-batch", "0")
    assert zero.exit_code == 2 and "--max-micro-batch" in zero.output
    precision = run("probe", MLP, "--precision", "fp8")
    assert precision.exit_code == 2 and "--precision" in precision.output


def test_a_broken_model_file_exits_1_naming_the_file(tmp_path):
    path = tmp_path / "model.py"
    path.write_text("def build_model():\n    pass\n")
    result = run("probe", str(path), "--memory-limit", "8MiB")
    assert result.exit_code == 1
    assert "make_batch()" in result.output and "model.py" in result.output


def test_devices_lists_the_cpu_budget():
    result = run("devices", "--memory-limit", "2GiB")
    assert result.exit_code == 0
    assert "probe budget 2.00 GiB" in result.output


def test_python_dash_m_autotune_works_like_the_console_script():
    proc = subprocess.run([sys.executable, "-m", "autotune", "devices", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "cpu" in json.loads(proc.stdout)
