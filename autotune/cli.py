"""The ``autotune`` command: parse options, call the public API, print. No logic lives here."""

from __future__ import annotations

import functools
import json
import sys

import click

from . import __version__
from .errors import AutotuneError, ConfigError
from .precision import Precision
from .units import format_bytes, parse_bytes


class _MemorySize(click.ParamType):
    name = "SIZE"

    def convert(self, value, param, ctx):
        try:
            return parse_bytes(value, option=f"--{param.name.replace('_', '-')}" if param else "size")
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)


MEMORY_SIZE = _MemorySize()
PRECISIONS = click.Choice([p.value for p in Precision], case_sensitive=False)


def _errors_to_exit_codes(command):
    """AutotuneError -> message on stderr, exit 1; click handles usage errors (exit 2)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from exc
        except AutotuneError as exc:
            raise click.ClickException(str(exc)) from exc

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="autotune")
def cli():
    """OOM-aware auto-tuner for PyTorch training."""


def _model_file(function):
    return click.argument("model_file", type=click.Path(exists=True, dir_okay=False))(function)


@cli.command()
@_model_file
@click.option("--device", default=None, help="cpu, cuda or cuda:N (default: CUDA when available).")
@click.option("--precision", type=PRECISIONS, default="fp32", show_default=True,
              help="fp32; bf16 autocast; fp16 autocast with GradScaler.")
@click.option("--checkpointing", type=click.Choice(["off", "on"]), default="off", show_default=True,
              help="Activation checkpointing around the model's repeated blocks.")
@click.option("--memory-limit", type=MEMORY_SIZE, default=None,
              help="Memory budget to emulate a smaller device, e.g. 8GiB, 512MiB or bytes.")
@click.option("--max-micro-batch", type=click.IntRange(min=1), default=None,
              help="Largest micro-batch worth finding (default: the true maximum).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@_errors_to_exit_codes
def probe(model_file, device, precision, checkpointing, memory_limit, max_micro_batch, as_json):
    """Find the exact largest micro-batch whose full training step fits."""
    from .probe import probe as run_probe
    from .report import format_probe

    result = run_probe(model_file, device=device, precision=precision,
                       checkpointing=checkpointing == "on", memory_limit=memory_limit,
                       max_micro_batch=max_micro_batch)
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else format_probe(result, model_file))


@cli.command()
@click.option("--memory-limit", type=MEMORY_SIZE, default=None, help="CPU budget to report.")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@_errors_to_exit_codes
def devices(memory_limit, as_json):
    """List CUDA devices (name, total, free) and the CPU budget."""
    from .memory import CPUMemoryBackend, describe_cuda_devices
    from .report import format_devices

    cuda = describe_cuda_devices()
    cpu = CPUMemoryBackend(memory_limit=memory_limit).info()
    if as_json:
        click.echo(json.dumps({"cuda": cuda, "cpu": cpu.to_dict()}, indent=2))
    else:
        click.echo(format_devices(cuda, cpu))


def main(argv=None):
    cli.main(args=argv, prog_name="autotune")


if __name__ == "__main__":
    main(sys.argv[1:])
