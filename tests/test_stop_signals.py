"""A SIGTERM that reaches a failing `autotune train` while it tears down (torchrun signals every
rank as soon as one fails) waits until the rank has printed why it stopped."""

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from autotune.planning.planfile import save_plan
from train_helpers import make_plan

TESTS = Path(__file__).resolve().parent

_CHILD = """
import os, signal
from autotune.distributed import process_group as distributed

real_teardown = distributed.teardown

def teardown(ctx):
    os.kill(os.getpid(), signal.SIGTERM)  # torchrun's signal, after the loop failed
    real_teardown(ctx)

distributed.teardown = teardown
from autotune.cli import main
main(["train", {model!r}, "--plan", {plan!r}, "--steps", "2"])
"""


def test_sigterm_during_teardown_after_an_error_comes_after_the_error_is_printed(examples_dir, tmp_path):
    model = tmp_path / "failing_mlp.py"
    model.write_text((examples_dir / "mlp.py").read_text() + textwrap.dedent("""

        def loss_fn(model, batch):
            raise RuntimeError("the loss broke on purpose")
        """))
    plan = save_plan(make_plan([4]), tmp_path / "plan.json")
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(model=str(model), plan=str(plan)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert "the loss broke on purpose" in done.stderr, done.stderr[-3000:]
    assert done.returncode == -signal.SIGTERM  # delivered once the error was out


def test_sigterm_mid_step_still_stops_at_the_step_boundary_under_the_cli(examples_dir, tmp_path):
    # hold_termination only defers signals after a failure: a run the signal reaches mid-step
    # (here in its loss) checkpoints and stops cleanly, as without the CLI's hold.
    model = tmp_path / "signalled_mlp.py"
    model.write_text((examples_dir / "mlp.py").read_text() + textwrap.dedent("""

        def loss_fn(model, batch):
            import os, signal
            x, y = batch
            if not getattr(loss_fn, "signalled", False):
                loss_fn.signalled = True
                os.kill(os.getpid(), signal.SIGTERM)
            return nn.functional.cross_entropy(model(x), y)
        """))
    plan = save_plan(make_plan([4]), tmp_path / "plan.json")
    done = subprocess.run([sys.executable, "-m", "autotune", "train", str(model), "--plan", str(plan),
                           "--steps", "5", "--checkpoint-dir", str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 130, done.stderr[-3000:]  # the CLI's exit code for a stopped run
    assert "stopped by SIGTERM after step" in done.stderr
