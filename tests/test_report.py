"""Plots (memory, throughput, metrics), the HTML report and the notebook views of results."""

import builtins
import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest
from click.testing import CliRunner

import autotune
from autotune.cli.main import cli
from autotune.errors import ReportError
from autotune.planning.planfile import save_plan

from autotune.planning.types import ConfigurationMeasured
from autotune.report import plan_html, plot_metrics, plot_plan, probe_html, train_html
from autotune.workload.checkpoint_count import Checkpointing
from plan_helpers import make_plan
import train_helpers

pytest.importorskip("matplotlib")
SVG = "{http://www.w3.org/2000/svg}"


def svg_ids(path) -> dict:
    """Every element with an id (matplotlib writes each artist's gid as one)."""
    return {e.get("id"): e for e in ET.parse(path).getroot().iter() if e.get("id")}


def markers(group) -> int:
    return sum(1 for e in group.iter() if e.tag == f"{SVG}use")


@pytest.fixture
def plan():
    # Trials at 1, 50 (fit) and 51 (out of memory); headroom 10%: 45 allowed.
    return make_plan(90, 50, headroom=0.1)


@pytest.fixture
def throughput_plan(plan):
    plan.optimize = "throughput"
    plan.throughput = [
        ConfigurationMeasured(precision="fp32", checkpointing=False, micro_batches=[45, 45],
                              samples_per_s=120.0, peak_bytes=550 << 20),
        ConfigurationMeasured(precision="fp32", checkpointing=False, micro_batches=[30, 30, 30],
                              samples_per_s=100.0, peak_bytes=400 << 20),
        ConfigurationMeasured(precision="fp32", checkpointing=False, micro_batches=[90], fits=False,
                              status="pruned", note="predicted too big"),
    ]
    return plan


@pytest.fixture(scope="module")
def metrics_files(tmp_path_factory):
    """A large-batch run and the same batch accumulated over two micro-batches."""
    folder = tmp_path_factory.mktemp("metrics")
    paths = []
    for name, split in (("big.jsonl", [8]), ("accumulated.jsonl", [4, 4])):
        autotune.train(train_helpers.make_plan(split), train_helpers.mlp_workload(), steps=4,
                       metrics_path=folder / name, progress=False)
        paths.append(folder / name)
    return paths


def test_memory_plot_draws_peaks_model_budget_headroom_and_the_plan(plan, tmp_path):
    ids = svg_ids(plot_plan(plan, tmp_path / "memory.svg"))
    name = "fp32-checkpointing-off"
    assert markers(ids[f"measured-{name}"]) == 2  # the two trials that fit
    assert markers(ids[f"oom-{name}"]) == 1
    for element in (f"model-{name}", "budget", "headroom", "planned", "planned-peak"):
        assert element in ids, element
    text = ET.tostring(ET.parse(tmp_path / "memory.svg").getroot(), encoding="unicode")
    assert f"planned micro-batch {plan.micro_batch}" in text and "budget − headroom" in text
    assert not any(key.startswith("throughput-") for key in ids)


def test_throughput_plans_add_samples_per_second_of_every_configuration(throughput_plan, tmp_path):
    ids = svg_ids(plot_plan(throughput_plan, tmp_path / "memory.svg"))
    assert {f"throughput-{i}" for i in range(3)} <= set(ids)
    assert "budget" in ids


def test_png_too(plan, tmp_path):
    path = plot_plan(plan, tmp_path / "memory.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_two_metrics_files_on_one_plot(metrics_files, tmp_path):
    path = plot_metrics(metrics_files, tmp_path / "loss.svg")
    ids = svg_ids(path)
    for key in ("loss", "lr", "grad_norm"):
        assert {f"{key}-0", f"{key}-1"} <= set(ids), key
    text = path.read_text()
    assert "big.jsonl" in text and "accumulated.jsonl" in text


def test_cli_show_plots_plans_and_metrics(plan, metrics_files, tmp_path):
    save_plan(plan, tmp_path / "plan.json")
    runner = CliRunner()
    shown = runner.invoke(cli, ["show", str(tmp_path / "plan.json"), "--plot", str(tmp_path / "m.svg")])
    assert shown.exit_code == 0, shown.output
    assert "budget" in svg_ids(tmp_path / "m.svg") and "split:" in shown.stdout
    curves = runner.invoke(cli, ["show", *map(str, metrics_files), "--plot", str(tmp_path / "l.svg")])
    assert curves.exit_code == 0, curves.output
    assert "loss-1" in svg_ids(tmp_path / "l.svg")
    table = runner.invoke(cli, ["show", *map(str, metrics_files)])
    assert table.exit_code == 0 and "big.jsonl" in table.stdout and "last loss" in table.stdout
    # --json on metrics files printed the table too.
    shown_json = runner.invoke(cli, ["show", *map(str, metrics_files), "--json"])
    assert shown_json.exit_code == 0, shown_json.output
    records = json.loads(shown_json.stdout)
    assert list(records) == list(map(str, metrics_files))
    assert [r["step"] for r in records[str(metrics_files[0])]] == [1, 2, 3, 4]
    two_plans = runner.invoke(cli, ["show", str(tmp_path / "plan.json"), str(tmp_path / "plan.json")])
    assert two_plans.exit_code == 2 and "one plan file" in two_plans.output
    bad = runner.invoke(cli, ["show", str(tmp_path / "plan.json"), "--plot", str(tmp_path / "m.gif")])
    assert bad.exit_code == 1 and ".svg, .png or .pdf" in bad.output


def test_a_file_that_is_no_metrics_file_is_named(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\nnot json\n')
    result = CliRunner().invoke(cli, ["show", str(path), "--plot", str(tmp_path / "l.svg")])
    assert result.exit_code == 1 and "m.jsonl, line 2: not JSON" in result.output


def test_missing_matplotlib_says_how_to_install_it(plan, tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ReportError, match=r"pip install 'autotune\[plot\]'"):
        plot_plan(plan, tmp_path / "memory.svg")
    save_plan(plan, tmp_path / "plan.json")
    result = CliRunner().invoke(cli, ["show", str(tmp_path / "plan.json"), "--plot",
                                      str(tmp_path / "m.svg")])
    assert result.exit_code == 1 and "autotune[plot]" in result.output
    # The notebook view still works, with the plot replaced by the same advice.
    assert "autotune[plot]" in plan_html(plan) and "<svg" not in plan_html(plan)


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.ids, self.urls, self.text = [], set(), [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        self.urls += [v for k, v in attrs.items() if k in ("src", "href") and v and not v.startswith("#")]

    def handle_data(self, data):
        self.text.append(data)


def parse_page(text) -> _Page:
    page = _Page()
    page.feed(text)
    return page


def test_report_is_one_self_contained_page(throughput_plan, tmp_path):
    throughput_plan.warnings = ["BatchNorm sees only the micro-batch <16>"]
    save_plan(throughput_plan, tmp_path / "plan.json")
    result = CliRunner().invoke(cli, ["report", str(tmp_path / "plan.json"), "-o", str(tmp_path / "r.html")])
    assert result.exit_code == 0, result.output
    page = parse_page((tmp_path / "r.html").read_text())
    assert page.tags[:1] == ["html"] and "svg" in page.tags and "script" not in page.tags
    assert page.urls == []  # nothing to fetch: no src or href outside the page
    assert {"summary", "settings", "throughput", "warnings", "budget", "planned"} <= page.ids
    text = "".join(page.text)
    assert "micro-batch <16>" in text  # escaped, shown as written
    assert f"{throughput_plan.micro_batch}" in text and "predicted peak" in text


def test_the_report_renders_in_a_real_browser_without_the_network(throughput_plan, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no Chromium here (apt-get install chromium); the page is parsed above instead")
    save_plan(throughput_plan, tmp_path / "plan.json")
    assert CliRunner().invoke(cli, ["report", str(tmp_path / "plan.json"), "-o",
                                    str(tmp_path / "r.html")]).exit_code == 0
    common = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
              "--host-resolver-rules=MAP * ~NOTFOUND",  # any request for the network would fail
              f"--user-data-dir={tmp_path / 'profile'}"]
    url = (tmp_path / "r.html").as_uri()
    dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    page = parse_page(dom.stdout)  # the document as the browser built it
    assert {"summary", "settings", "throughput", "budget", "planned"} <= page.ids, dom.stderr[-2000:]
    assert "svg" in page.tags
    shot = tmp_path / "r.png"
    subprocess.run([*common, "--window-size=1200,1600", f"--screenshot={shot}", url],
                   capture_output=True, timeout=120)
    assert shot.is_file() and shot.stat().st_size > 20_000  # drawn, not a blank page


def test_short_reprs_and_notebook_views(plan, metrics_files):
    text = repr(plan)
    assert len(text) < 160 and "Plan(" in text and f"= {plan.effective_batch}" in text
    assert "<svg" in plan_html(plan) and 'id="settings"' in plan_html(plan)
    probe = plan.settings[0].probe
    assert repr(probe).startswith("ProbeResult(max_micro_batch=50") and len(repr(probe)) < 160
    page = parse_page(probe_html(probe))
    assert {"summary", "trials", "largest"} <= page.ids
    trained = autotune.train(train_helpers.make_plan([4, 4]), train_helpers.mlp_workload(), steps=2,
                             progress=False)
    assert repr(trained).startswith("TrainResult(steps=2, last loss") and len(repr(trained)) < 200
    assert {"summary", "loss-0", "lr-0"} <= parse_page(train_html(trained)).ids


def test_jupyter_shows_plans_probes_and_runs_as_html(plan):
    interactiveshell = pytest.importorskip("IPython.core.interactiveshell")
    from autotune.report.notebook import register_display

    shell = interactiveshell.InteractiveShell.instance()
    assert register_display(shell)
    shown, _ = shell.display_formatter.format(plan)
    assert shown["text/html"] == plan_html(plan) and shown["text/plain"] == repr(plan)
    shown, _ = shell.display_formatter.format(plan.settings[0].probe)
    assert 'id="trials"' in shown["text/html"]
    assert register_display() is (sys.modules.get("IPython") is not None
                                  and sys.modules["IPython"].get_ipython() is not None)


def test_outputs_never_replace_the_input_or_a_link(plan, metrics_files, tmp_path):
    save_plan(plan, tmp_path / "plan.json")
    before = (tmp_path / "plan.json").read_bytes()
    runner = CliRunner()
    own = runner.invoke(cli, ["report", str(tmp_path / "plan.json"), "-o", str(tmp_path / "plan.json")])
    assert own.exit_code == 1 and "this command's own PLAN_FILE" in own.output
    metrics_copy = tmp_path / "m.svg.jsonl"
    metrics_copy.write_bytes(metrics_files[0].read_bytes())
    own_plot = runner.invoke(cli, ["show", str(metrics_copy), "--plot", str(metrics_copy)])
    assert own_plot.exit_code == 1 and "--plot" in own_plot.output
    (tmp_path / "link.svg").symlink_to(tmp_path / "plan.json")
    linked = runner.invoke(cli, ["show", str(tmp_path / "plan.json"), "--plot", str(tmp_path / "link.svg")])
    assert linked.exit_code == 1 and "symlink" in linked.output
    assert (tmp_path / "plan.json").read_bytes() == before
    assert metrics_copy.read_bytes() == metrics_files[0].read_bytes()


def test_every_block_and_the_planned_k_of_n_are_two_settings_in_the_plot(tmp_path):
    # Both were labelled "checkpointing on (planned)" (and drawn with one SVG id).
    from plan_helpers import linear_probe, setting

    plan = make_plan(90, 50, headroom=0.1)
    plan.workload.repeated_blocks = 6
    every = linear_probe(80, checkpointing=Checkpointing.every_block(6))
    some = linear_probe(60, checkpointing=Checkpointing.of(2, 6))
    every.total_blocks = some.total_blocks = 6
    plan.settings += [setting(every, checkpointing=every.checkpointing),
                      setting(some, checkpointing=some.checkpointing)]
    plan.checkpointing = Checkpointing.of(2, 6)
    path = plot_plan(plan, tmp_path / "memory.svg")
    ids = svg_ids(path)
    assert "measured-fp32-checkpointing-on" in ids
    assert "measured-fp32-checkpointing-2-of-6-blocks" in ids
    text = ET.tostring(ET.parse(path).getroot(), encoding="unicode")
    assert "fp32, checkpointing 2 of 6 blocks (planned)" in text
    assert "fp32, checkpointing on (planned)" not in text
    rows = [row for row in plan_html(plan).split("<tr>") if "planned" in row and "<td>" in row]
    assert len(rows) == 1 and "2 of 6 blocks" in rows[0]  # the report's settings table too
