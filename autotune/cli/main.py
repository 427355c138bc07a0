"""The ``autotune`` command: parse options, call the public API, print. No logic lives here."""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import warnings
from pathlib import Path

import click

from ..version import __version__
from ..errors import AutotuneError, AutotuneWarning, ConfigError, WorkloadError, cli_words
from ..precision import Precision
from ..units import format_bytes, parse_bytes
from ..planning.export import TARGETS as EXPORT_TARGETS
from ..planning.lr import RULES as LR_RULES
from ..orchestration.request import PRECISION_CHOICES as PLAN_PRECISIONS
from ..workload.checkpoint_count import CheckpointingRequest
from ..orchestration.request import OPTIMIZE_CHOICES as PLAN_GOALS
from ..distributed.layout import PipelineSchedule, parse_layout
from ..distributed.sharding import Sharding

SHARDINGS = [s.value for s in Sharding]


class _Checkpointing(click.ParamType):
    """auto (when allowed), off, on, a block count K or a fraction such as 1/3."""

    name = "auto|off|on|K|FRACTION"

    def __init__(self, allow_auto: bool):
        self.allow_auto = allow_auto
        if not allow_auto:
            self.name = "off|on|K|FRACTION"

    def convert(self, value, param, ctx):
        try:
            return CheckpointingRequest.parse(value, allow_auto=self.allow_auto)
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)


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
            with cli_words(), warnings.catch_warnings():  # the library's messages name --options
                warnings.showwarning = _one_line_warning(warnings.showwarning)
                return command(*args, **kwargs)
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from exc
        except WorkloadError as exc:  # the model file's fault: its own frames under the message
            from ..workload.contract import user_traceback

            frames = user_traceback(exc)
            raise click.ClickException(str(exc) + (f"\n{frames}" if frames else "")) from exc
        except AutotuneError as exc:
            raise click.ClickException(str(exc)) from exc

    return wrapper


def _one_line_warning(show):
    """The library's own warnings (``AutotuneWarning``) as one line each, no source line."""

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, AutotuneWarning):
            click.echo(f"autotune: warning: {message}", err=True)
        else:
            show(message, category, filename, lineno, file, line)

    return showwarning


def _quiet_option(command):
    """--quiet: no progress bars (they show only where stderr is a terminal, on rank 0)."""

    @functools.wraps(command)
    def wrapper(*args, quiet, **kwargs):
        from ..progress import quiet as no_progress

        with no_progress(quiet):
            return command(*args, **kwargs)

    return click.option("-q", "--quiet", is_flag=True,
                        help="No progress bars on stderr (drawn only when it is a terminal).")(wrapper)


def _trial_timeout_option(command):
    """--trial-timeout: a trial past it stops with a message naming it (probing/deadline.py)."""

    @functools.wraps(command)
    def wrapper(*args, trial_timeout, **kwargs):
        from ..probing.deadline import trial_timeout as limit

        with limit(trial_timeout):
            return command(*args, **kwargs)

    return click.option("--trial-timeout", type=float, default=None, metavar="SECONDS",
                        help="Stop a trial (one measured training step) that runs longer than "
                             "this, naming its micro-batch and setting (default: no limit).")(wrapper)


def _scaler_options(command):
    """The fp16 GradScaler's knobs, gathered into ``grad_scaler`` (only those given)."""

    @functools.wraps(command)
    def wrapper(*args, init_scale, growth_factor, backoff_factor, growth_interval, **kwargs):
        given = {"init_scale": init_scale, "growth_factor": growth_factor,
                 "backoff_factor": backoff_factor, "growth_interval": growth_interval}
        return command(*args, grad_scaler={k: v for k, v in given.items() if v is not None}, **kwargs)

    options = [
        click.option("--init-scale", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="fp16 GradScaler: the loss scale to start from (torch: 65536)."),
        click.option("--growth-factor", type=click.FloatRange(min=1, min_open=True), default=None,
                     help="fp16 GradScaler: scale growth after growth-interval clean steps (torch: 2)."),
        click.option("--backoff-factor", type=click.FloatRange(min=0, max=1, min_open=True, max_open=True),
                     default=None, help="fp16 GradScaler: scale factor on inf/NaN (torch: 0.5)."),
        click.option("--growth-interval", type=click.IntRange(min=1), default=None,
                     help="fp16 GradScaler: clean steps before the scale grows (torch: 2000)."),
    ]
    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


def _compile_options(command):
    """--compile / --compile-backend NAME, gathered into ``compile`` (None, or a backend name)."""

    @functools.wraps(command)
    def wrapper(*args, compile_step, compile_backend, **kwargs):
        return command(*args, compile=compile_backend or (True if compile_step else None), **kwargs)

    wrapper = click.option("--compile-backend", default=None, metavar="NAME",
                           help="torch.compile backend for --compile (implies it): inductor "
                                "(the default), aot_eager, eager, ...")(wrapper)
    return click.option("--compile", "compile_step", is_flag=True,
                        help="Run the training step torch.compile'd (batch sizes dynamic); the "
                             "probe's real trials measure the compiled step.")(wrapper)


class _Degree(click.ParamType):
    """A positive number of ranks, or "auto" (the plan's layout search)."""

    name = "N|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value.lower() == "auto":
            return "auto"
        return click.IntRange(min=1).convert(value, param, ctx)


def _layout_options(command=None, *, search: bool = False):
    """--tp / --cp / --pp / --pp-schedule / --stages-per-rank, gathered into ``parallel``: the
    keyword arguments of ``plan()`` and ``parse_layout`` (checked there, inside the command, so
    a bad combination exits as the other option errors do). ``search``: the degrees also take
    "auto" (``autotune plan``)."""
    if command is None:
        return functools.partial(_layout_options, search=search)

    @functools.wraps(command)
    def wrapper(*args, tp, cp, pp, pp_schedule, stages_per_rank, **kwargs):
        return command(*args, parallel=dict(tp=tp, cp=cp, pp=pp, pp_schedule=pp_schedule,
                                            stages_per_rank=stages_per_rank), **kwargs)

    degree = _Degree() if search else click.IntRange(min=1)
    auto = " 'auto' (plan only) searches the layouts that fit; see plan.reasons['layout']." if search else ""
    options = [
        click.option("--tp", type=degree, default=1, show_default=True,
                     help="Tensor parallel: ranks that split each layer's weight matrices (with "
                          "sequence parallel norms); a divisor of the attention heads." + auto),
        click.option("--cp", type=degree, default=1, show_default=True,
                     help="Context parallel: ranks that split each sample's sequence (ring "
                          "attention over SDPA)." + auto),
        click.option("--pp", type=degree, default=1, show_default=True,
                     help="Pipeline parallel: ranks the repeated blocks are split over." + auto),
        click.option("--pp-schedule", type=click.Choice([s.value for s in PipelineSchedule]),
                     default=None, help="The pipeline's schedule (default 1f1b)."),
        click.option("--stages-per-rank", type=click.IntRange(min=1), default=None,
                     help="Pipeline stages per rank (interleaved schedules; default 2 for them)."),
    ]
    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


def _stdout_to_stderr(active: bool):
    """While the model file is imported and run, its prints go to stderr: stdout carries --json."""
    return contextlib.redirect_stdout(sys.stderr) if active else contextlib.nullcontext()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="autotune")
def cli():
    """OOM-aware auto-tuner for PyTorch training."""


class _SeqLen(click.ParamType):
    """auto, or a sequence length of at least 1."""

    name = "auto|N"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or value == "auto":
            return value
        try:
            length = int(value)
        except ValueError:
            length = 0
        if length < 1:
            self.fail(f"{value!r} is not a sequence length: use auto or a whole number of at least 1",
                      param, ctx)
        return length


def _model_file(function):
    return click.argument("model_file", type=click.Path(exists=True, dir_okay=False))(function)


@cli.command()
@_model_file
@click.option("--device", default=None, help="cpu, cuda or cuda:N (default: CUDA when available).")
@click.option("--precision", type=PRECISIONS, default="fp32", show_default=True,
              help="fp32; bf16 autocast; fp16 autocast with GradScaler.")
@click.option("--checkpointing", type=_Checkpointing(allow_auto=False), default="off", show_default=True,
              help="Activation checkpointing around the model's repeated blocks: off, on (all), "
                   "K of them spread evenly, or a fraction such as 1/3.")
@click.option("--memory-limit", type=MEMORY_SIZE, default=None,
              help="Memory budget to emulate a smaller device, e.g. 8GiB, 512MiB or bytes.")
@click.option("--max-micro-batch", type=click.IntRange(min=1), default=None,
              help="Largest micro-batch worth finding (default: the true maximum).")
@click.option("--max-seq-len", "max_seq_len", is_flag=True,
              help="Find the longest sequence length that fits at --micro-batch instead (needs "
                   "make_batch(batch_size, seq_len) in the model file).")
@click.option("--micro-batch", type=click.IntRange(min=1), default=None,
              help="With --max-seq-len: the micro-batch to fit (default 1).")
@click.option("--seq-multiple", type=click.IntRange(min=1), default=None,
              help="With --max-seq-len: only lengths that are multiples of this (default 1; 8 or "
                   "64 suit tensor cores and flash attention).")
@click.option("--seq-len-limit", type=click.IntRange(min=1), default=None,
              help="With --max-seq-len: the longest length worth trying (default: the model's "
                   "max_position_embeddings or n_positions, else no limit).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@_compile_options
@_quiet_option
@_errors_to_exit_codes
@_trial_timeout_option
def probe(model_file, device, precision, checkpointing, memory_limit, max_micro_batch, max_seq_len,
          micro_batch, seq_multiple, seq_len_limit, as_json, compile):
    """Find the exact largest micro-batch whose full training step fits (--max-seq-len: the
    longest sequence at a micro-batch)."""
    from ..probing.api import probe as run_probe
    from .format import format_probe, format_seq_len

    seq_options = {"--micro-batch": micro_batch, "--seq-multiple": seq_multiple,
                   "--seq-len-limit": seq_len_limit}
    if max_seq_len:
        if max_micro_batch is not None:
            raise click.UsageError("--max-micro-batch finds a micro-batch; --max-seq-len a sequence "
                                   "length at --micro-batch N: use one of them")
        from ..probing.seq_len import probe_seq_len

        with _stdout_to_stderr(as_json):
            found = probe_seq_len(model_file, micro_batch=micro_batch or 1,
                                  seq_multiple=seq_multiple or 1, max_seq_len=seq_len_limit,
                                  device=device, precision=precision, checkpointing=checkpointing,
                                  memory_limit=memory_limit)
        click.echo(json.dumps(found.to_dict(), indent=2) if as_json else format_seq_len(found, model_file))
        return
    for name, value in seq_options.items():
        if value is not None:
            raise click.UsageError(f"{name} applies to --max-seq-len only; add --max-seq-len or "
                                   f"drop {name}")
    with _stdout_to_stderr(as_json):
        result = run_probe(model_file, device=device, precision=precision,
                           checkpointing=checkpointing, memory_limit=memory_limit,
                           max_micro_batch=max_micro_batch, compile=compile)
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else format_probe(result, model_file))


@cli.command()
@click.option("--memory-limit", type=MEMORY_SIZE, default=None, help="CPU budget to report.")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@_errors_to_exit_codes
def devices(memory_limit, as_json):
    """List CUDA devices (name, total, free) and the CPU budget."""
    from ..memory import CPUMemoryBackend, describe_cuda_devices
    from .format import format_devices

    cuda = describe_cuda_devices()
    cpu = CPUMemoryBackend(memory_limit=memory_limit).info()
    if as_json:
        click.echo(json.dumps({"cuda": cuda, "cpu": cpu.to_dict()}, indent=2))
    else:
        click.echo(format_devices(cuda, cpu))


@cli.command("plan")
@_model_file
@click.option("--target-batch", type=click.IntRange(min=1), default=None,
              help="Effective batch per optimizer step, over all devices (or --target-tokens).")
@click.option("--target-tokens", type=click.IntRange(min=1), default=None,
              help="Tokens per optimizer step over all devices: micro-batch × --seq-len × "
                   "accumulation × world size, exactly (instead of --target-batch).")
@click.option("--seq-len", type=_SeqLen(), default=None,
              help="Sequence length to plan at (make_batch(batch_size, seq_len)), or auto: the "
                   "longest that fits at micro-batch 1 (default with --target-tokens: auto).")
@click.option("--seq-multiple", type=click.IntRange(min=1), default=1, show_default=True,
              help="--seq-len auto takes a multiple of this (8 or 64 suit tensor cores).")
@click.option("--world-size", type=click.IntRange(min=1), default=None,
              help="Number of processes (default: WORLD_SIZE, else 1).")
@click.option("--device", default=None, help="cpu, cuda or cuda:N (default: CUDA when available).")
@click.option("--precision", type=click.Choice(PLAN_PRECISIONS, case_sensitive=False),
              default="auto", show_default=True,
              help="auto: bf16 on CUDA where supported, fp16 on CUDA without bf16; on the CPU "
                   "fp32 unless bf16 needs fewer accumulation steps.")
@click.option("--checkpointing", type=_Checkpointing(allow_auto=True), default="auto",
              show_default=True, help="auto: the fewest repeated blocks that buy the fewest "
                                      "accumulation steps; off; on (all); K blocks spread evenly; "
                                      "or a fraction such as 1/3.")
@click.option("--base-lr", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Reference LR (default: BASE_LR in the model file).")
@click.option("--base-batch", type=click.IntRange(min=1), default=None,
              help="Batch the reference LR was tuned at (default: BASE_BATCH in the model file).")
@click.option("--lr-rule", type=click.Choice(LR_RULES), default="auto",
              show_default=True, help="auto: linear for SGD-like, sqrt for Adam-family optimizers.")
@click.option("--memory-limit", type=MEMORY_SIZE, default=None,
              help="Memory budget to emulate a smaller device, e.g. 8GiB, 512MiB or bytes.")
@click.option("--headroom", type=click.FloatRange(min=0, max=1, max_open=True), default=0.1,
              show_default=True, help="Fraction of the budget kept free.")
@click.option("--micro-batch", type=click.IntRange(min=1), default=None,
              help="Pin the micro-batch; the plan checks it fits and derives the rest.")
@click.option("--even", is_flag=True,
              help="Equal micro-batches (the fewest that fit), for runners that take one size "
                   "(HF Trainer, DeepSpeed, Lightning, Accelerate).")
@click.option("--optimize", type=click.Choice(PLAN_GOALS), default="memory", show_default=True,
              help="memory: the largest micro-batch that fits; throughput: the fastest measured "
                   "configuration (precision, checkpointing, split), or with --gpu the fastest "
                   "predicted (layout, checkpointing, split).")
@click.option("--budget", default=None,
              help="Time for --optimize throughput's measurements, e.g. 60s (the default), 2m or seconds.")
@click.option("--storage", default=None,
              help="Optuna storage URL that keeps the throughput study, e.g. sqlite:///autotune.db "
                   "(a rerun resumes; optuna-dashboard can read it).")
@click.option("--gpu", default=None,
              help="Plan for this GPU without it: a profile name (autotune profiles lists them) or "
                   "a profile .toml path; memory is estimated on fake tensors.")
@click.option("--sharding", type=click.Choice(["auto", *SHARDINGS]), default="auto", show_default=True,
              help="ddp: a replica per rank; fsdp: FSDP2 shards per rank; auto: ddp unless "
                   "sharding saves accumulation steps or a replica fits nowhere.")
@click.option("--shard-group", type=click.IntRange(min=1), default=None,
              help="Hybrid sharding: shard within groups of N ranks, replicate across groups "
                   "(default: the world size).")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=None,
              help="With --gpu: GPUs per host, where communication leaves NVLink for the network "
                   "(default: the profile's reference host).")
@click.option("--network-gbps", type=click.FloatRange(min=0, min_open=True), default=None,
              help="With --gpu: each GPU's share of the network between hosts, Gb/s (default: the "
                   "profile's, e.g. 400 for the H100's NDR InfiniBand).")
@click.option("--eval-batch/--no-eval-batch", default=True, show_default=True,
              help="Also plan the largest eval micro-batch (forward only under no_grad), proved "
                   "with real forwards.")
@click.option("--max-eval-batch", type=click.IntRange(min=1), default=None,
              help="The largest eval micro-batch to plan (a cap on that search).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default="plan.json",
              show_default=True, help="Where to write the plan (a plan there is replaced, and the "
                                      "summary says which; a file that is no plan is left and refused).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON instead of a summary.")
@_scaler_options
@_compile_options
@_layout_options(search=True)
@_quiet_option
@_errors_to_exit_codes
@_trial_timeout_option
def plan_command(model_file, target_batch, target_tokens, seq_len, seq_multiple, world_size, device, precision, checkpointing, base_lr,
                 base_batch, lr_rule, memory_limit, headroom, micro_batch, optimize, budget, storage,
                 gpu, even, sharding, shard_group, gpus_per_node, network_gbps, output, as_json,
                 grad_scaler, eval_batch, max_eval_batch, compile, parallel):
    """Plan micro-batch × accumulation × world size = --target-batch (or × --seq-len =
    --target-tokens), and write the plan file."""
    from ..files.outputs import check_outputs
    from ..planning.planfile import plan_to_json, save_plan
    from ..orchestration.planner import plan as make_plan
    from .format import format_plan

    for option, value in (("--budget", budget), ("--storage", storage)):
        if value is not None and optimize != "throughput":
            raise click.UsageError(f"{option} applies to --optimize throughput only; add "
                                   f"--optimize throughput or drop {option}")
    check_outputs({"-o": output}, inputs={"MODEL_FILE": model_file})
    replaced = _plan_replaced(output)  # before the work: a file there that is no plan is refused
    with _stdout_to_stderr(as_json):
        result = make_plan(model_file, target_batch=target_batch, world_size=world_size, device=device,
                           precision=precision.lower(), checkpointing=checkpointing,
                           memory_limit=memory_limit, headroom=headroom, micro_batch=micro_batch,
                           base_lr=base_lr, base_batch=base_batch, lr_rule=lr_rule, optimize=optimize,
                           **({} if budget is None else {"budget": budget}), storage=storage, gpu=gpu,
                           grad_scaler=grad_scaler, even=even, sharding=sharding,
                           shard_group=shard_group, target_tokens=target_tokens,
                           seq_len="auto" if seq_len is None and target_tokens is not None else seq_len,
                           seq_multiple=seq_multiple, gpus_per_node=gpus_per_node,
                           network_gbps=network_gbps, eval_batch=eval_batch,
                           max_eval_batch=max_eval_batch, compile=compile, **parallel)
    save_plan(result, output)
    if as_json:
        click.echo(plan_to_json(result), nl=False)
    else:
        click.echo(format_plan(result))
        click.echo(f"\nplan written to {output}" + (f" (it replaced {replaced})" if replaced else ""))


def _plan_replaced(output) -> str | None:
    """What the plan file about to be written over held ("the plan for MODEL, target N"); None
    where there is none. A file there that is no plan (another tool's plan.json) is refused: -o
    defaults to plan.json, and that file is the user's."""
    from ..errors import OutputError, PlanFileError
    from ..planning.planfile import load_plan

    path = Path(output)
    if not path.exists():
        return None
    try:
        previous = load_plan(path)
    except PlanFileError as exc:
        raise OutputError(f"-o {output}: the file there is not an autotune plan ({str(exc).splitlines()[0]}), "
                          f"so it is left as it is; give another -o") from exc
    return (f"the plan for {previous.workload.source}, target batch {previous.target_batch}, "
            f"{previous.split_text} per rank")


@cli.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Draw it to this .svg/.png/.pdf: a plan's memory picture (and throughput), or "
                   "the loss, LR and gradient norm of one or more metrics files on one plot. "
                   "Needs matplotlib: pip install 'autotune[plot]'.")
@_errors_to_exit_codes
def show(files, as_json, plot_path):
    """Print the summary of a saved plan, or plot it or metrics files (autotune train --metrics)."""
    from ..planning.planfile import load_plan, plan_to_json
    from ..files.outputs import check_outputs
    from ..report.plots import load_metrics, plot_metrics, plot_plan
    from .format import format_metrics, format_plan

    inputs = {f"input {i + 1}" if len(files) > 1 else "input": f for i, f in enumerate(files)}
    if all(f.endswith(".jsonl") for f in files):
        check_outputs({"--plot": plot_path}, inputs=inputs)
        if plot_path is not None:
            plot_metrics(files, plot_path)
            click.echo(f"plot written to {plot_path}", err=True)
        elif as_json:  # the records as read, checked, by file (it printed the table)
            click.echo(json.dumps({f: load_metrics(f) for f in files}, indent=2))
        else:
            click.echo(format_metrics({f: load_metrics(f) for f in files}))
        return
    if len(files) > 1:
        raise click.UsageError("show takes one plan file, or one or more metrics files (.jsonl)")
    result = load_plan(files[0])
    check_outputs({"--plot": plot_path}, inputs=_plan_inputs(result, files[0], "input"))
    if plot_path is not None:
        plot_plan(result, plot_path)
        click.echo(f"plot written to {plot_path}", err=True)
    click.echo(plan_to_json(result) if as_json else format_plan(result), nl=not as_json)


def _plan_inputs(plan, plan_file, name: str = "PLAN_FILE") -> dict:
    """A plan file and the model file it names: what no output of a command reading it may replace."""
    from ..planning.planfile import planned_model_file

    return {name: plan_file, "model file (the plan's)": planned_model_file(plan, plan_file)}


@cli.command()
@click.argument("plan_file", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), default="report.html",
              show_default=True, help="Where to write the page.")
@_errors_to_exit_codes
def report(plan_file, output):
    """Write a self-contained HTML page of a plan: summary, settings, memory plot, throughput,
    warnings (inline SVG; opens without a network)."""
    from ..files.outputs import check_outputs
    from ..planning.planfile import load_plan
    from ..report.html import write_report

    plan = load_plan(plan_file)
    check_outputs({"-o": output}, inputs=_plan_inputs(plan, plan_file))
    write_report(plan, output)
    click.echo(f"report written to {output}", err=True)


@cli.command()
@click.argument("plan_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--to", "target", type=click.Choice(EXPORT_TARGETS),
              required=True, help="The runner to export for.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Write to this file (default: stdout).")
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=None,
              help="Processes (GPUs) per node for torchrun, slurm, submitit, kubernetes and "
                   "kubernetes-trainjob: the plan's world is nodes × this (default: up to 8 GPUs "
                   "per node; a CPU plan on one node).")
@_errors_to_exit_codes
def export(plan_file, target, output, nproc_per_node):
    """Export a plan as another runner's configuration, the torchrun command line, or a cluster
    job (an sbatch script, submitit, Kubeflow PyTorchJob/TrainJob YAML, a Ray Train driver)."""
    from ..files.outputs import write_atomic
    from ..files.outputs import check_outputs
    from ..planning.export import export_plan
    from ..planning.planfile import load_plan, planned_model_file

    plan = load_plan(plan_file)
    check_outputs({"-o": output}, inputs=_plan_inputs(plan, plan_file))
    # The model file as this folder reaches it (the plan names it from where it was planned): the
    # launch command then runs from here, as the plan path it names does.
    found = planned_model_file(plan, plan_file)
    exported = export_plan(plan, target, plan_path=plan_file, nproc_per_node=nproc_per_node,
                           model_file=str(found) if found is not None else None)
    for note in exported.notes:
        click.echo(f"note: {note}", err=True)
    if output is None:
        click.echo(exported.render(), nl=False)
    else:
        text = exported.render().encode("utf-8")
        write_atomic(output, lambda handle: handle.write(text))
        click.echo(f"{target} export written to {output}", err=True)

@cli.command("train")
@_model_file
@click.option("--plan", "plan_file", type=click.Path(exists=True, dir_okay=False), required=True,
              help="The plan file written by autotune plan.")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Optimizer steps to train.")
@click.option("--epochs", type=click.IntRange(min=1), default=None,
              help="Epochs over build_dataset() (default: 1 when there is a dataset).")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False), default=None,
              help="Folder for checkpoints (written at the end, every --checkpoint-every steps "
                   "and on SIGINT/SIGTERM): checkpoint.pt, or one shard per rank for FSDP plans. "
                   "One run at a time (autotune.lock); under torchrun --max-restarts a restarted "
                   "run continues from the checkpoint it wrote.")
@click.option("--checkpoint-every", type=click.IntRange(min=1), default=None,
              help="Checkpoint every K optimizer steps.")
@click.option("--resume", is_flag=True, help="Continue from --checkpoint-dir's checkpoint.")
@click.option("--overwrite", is_flag=True,
              help="Start over in a --checkpoint-dir that already holds a checkpoint (replacing it).")
@click.option("--save", "save_path", type=click.Path(dir_okay=False), default=None,
              help='Write {"model": state_dict, "steps": n} here (torch.save): the trained model\'s '
                   'full (unsharded) state dict and its optimizer steps; load with torch.load(PATH, '
                   'weights_only=True)["model"].')
@click.option("--metrics", "metrics_path", type=click.Path(dir_okay=False), default=None,
              help="Write one JSON line of metrics per optimizer step here.")
@click.option("--clip-grad-norm", type=click.FloatRange(min=0), default=None,
              help="Gradient-norm clipping (default: the plan's; 0 turns it off).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seeds the initial weights and the data order.")
@click.option("--device", default=None, help="cpu, cuda or cuda:N (default: CUDA when available).")
@click.option("-q", "--quiet", is_flag=True,
              help="No progress (bar or log lines) on stderr; warnings are still printed.")
@_scaler_options
@_compile_options
@_errors_to_exit_codes
def train_command(model_file, plan_file, steps, epochs, checkpoint_dir, checkpoint_every, resume,
                  overwrite, save_path, metrics_path, clip_grad_norm, seed, device, quiet, grad_scaler,
                  compile):
    """Train MODEL_FILE as the plan says, with exact accumulation (under torchrun: DDP or FSDP2)."""
    from ..training import train

    clip = {} if clip_grad_norm is None else {"clip_grad_norm": clip_grad_norm or None}
    result = train(plan_file, model_file, steps=steps, epochs=epochs, checkpoint_dir=checkpoint_dir,
                   checkpoint_every=checkpoint_every, resume=resume, overwrite=overwrite,
                   metrics_path=metrics_path, seed=seed, device=device, save_path=save_path,
                   progress=not quiet, grad_scaler=grad_scaler, compile=compile, **clip)
    if result.rank != 0:
        return
    if result.metrics or result.interrupted:
        last = f"; last loss {result.metrics[-1]['loss']:.4f}" if result.metrics else ""
        click.echo(f"trained {result.steps} optimizer steps (skipped {result.skipped_steps}, "
                   f"out-of-memory recoveries {result.oom_recoveries}){last}"
                   + (f"; model saved to {save_path}" if save_path else ""))
    else:  # resumed at or past the steps asked for: the loop said why on stderr
        click.echo(f"trained 0 optimizer steps (the checkpoint is at step {result.steps})"
                   + (f"; its model saved to {save_path}" if save_path else ""))
    if result.interrupted:
        click.echo(f"interrupted at step {result.steps}; continue with --resume", err=True)
        click.get_current_context().exit(130)


@cli.command()
@_model_file
@click.option("--micro-batch", "micro_batches", type=click.IntRange(min=1), multiple=True,
              required=True, help="Micro-batch to estimate; repeat for several (--micro-batch 8 --micro-batch 64).")
@click.option("--precision", type=PRECISIONS, default="fp32", show_default=True,
              help="fp32; bf16 autocast; fp16 autocast with GradScaler.")
@click.option("--checkpointing", type=_Checkpointing(allow_auto=False), default="off", show_default=True,
              help="Activation checkpointing around the model's repeated blocks: off, on (all), "
                   "K of them spread evenly, or a fraction such as 1/3.")
@click.option("--sharding", type=click.Choice(SHARDINGS), default="ddp", show_default=True,
              help="ddp: one full replica; fsdp: one rank of --world-size under FSDP2; "
                   "fsdp-offload: that rank's device, its shards and optimizer in host memory.")
@click.option("--world-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Ranks to shard over (with --sharding fsdp; a fake process group, no ranks run).")
@click.option("--shard-group", type=click.IntRange(min=1), default=None,
              help="Hybrid sharding: shard within groups of N ranks (default: the world size).")
@click.option("--gpu", default=None, metavar="NAME",
              help="For a GPU profile (a name such as h100-80gb, or a .toml path; see autotune "
                   "profiles): the reserved peak, torch's caching allocator modelled "
                   "(PYTORCH_CUDA_ALLOC_CONF honoured), beside the tensors' and with what lives "
                   "outside torch; with --time, the step time on that GPU.")
@click.option("--cuda", "cuda_name", default=None, metavar="NAME",
              help="Deprecated: use --gpu. The reserved peak for a CUDA device named freely "
                   "(H100, A100: Hopper's cuBLAS workspace is larger).")
@click.option("--json", "as_json", is_flag=True, help="Print {micro_batch: peak_bytes} as JSON.")
@click.option("--time", "step_time", is_flag=True,
              help="Predict the compute time of one step instead: FLOPs and bytes per op on the fake "
                   "step, a roofline with this CPU's measured speed (or --gpu's profile).")
@click.option("--accumulation-steps", type=click.IntRange(min=1), default=1, show_default=True,
              help="Estimate a window of N micro-batches (with --pp: the pipeline's micro-batches, "
                   "at least --pp of them).")
@_layout_options
@_errors_to_exit_codes
def estimate(model_file, micro_batches, precision, checkpointing, sharding, world_size, shard_group,
             cuda_name, as_json, step_time, gpu, parallel, accumulation_steps):
    """Estimate the peak memory of one training step without allocating it (fake tensors)."""
    from ..probing.estimate import estimate_cuda_peaks, estimate_peaks
    from .format import format_cuda_estimate

    parallel = parse_layout(**parallel)

    if cuda_name is not None:
        if gpu is not None:
            raise click.UsageError(f"--cuda {cuda_name} and --gpu {gpu} both name the GPU; drop "
                                   f"--cuda (deprecated: --gpu takes a profile name or .toml path)")
        if step_time:
            raise click.UsageError(f"--cuda {cuda_name} does not time a step; use --time --gpu NAME "
                                   f"(a GPU profile, see autotune profiles)")
        warnings.warn(f"--cuda is deprecated; use --gpu NAME (a GPU profile such as h100-80gb, see "
                      f"autotune profiles), which also counts the CUDA context and NCCL buffers",
                      AutotuneWarning)
    if gpu is not None:
        from ..gpus.catalog import load_profile

        load_profile(gpu).require(precision.lower())  # as plan refuses it
    if step_time:
        from ..timing.predict import predict_step_time
        from .format import format_step_times

        with _stdout_to_stderr(as_json):
            # This CPU's speed with the training loop's own cost (measured once, then cached).
            speed = None
            if gpu is None:
                from ..tuning.loop_cost import cpu_speed_with_loop

                speed = cpu_speed_with_loop()
            predictions = predict_step_time(model_file, list(micro_batches), precision=precision.lower(),
                                            checkpointing=checkpointing, sharding=sharding,
                                            world_size=world_size, shard_group=shard_group, gpu=gpu,
                                            speed=speed, parallel=None if parallel.trivial else parallel)
        layout = None if parallel.trivial else parallel.describe(world_size, sharding.upper())
        click.echo(format_step_times(predictions, as_json=as_json, layout=layout))
        return

    if cuda_name is not None or gpu is not None:
        if accumulation_steps > 1:
            raise click.UsageError(f"--accumulation-steps {accumulation_steps} with --gpu: the "
                                   f"reserved peak is estimated for one step; drop one of them")
        from ..gpus.catalog import load_profile
        from ..gpus.fixed_costs import outside_torch_bytes

        profile = load_profile(gpu) if gpu is not None else None
        with _stdout_to_stderr(as_json):
            peaks = estimate_cuda_peaks(model_file, micro_batches,
                                        gpu_name=profile.name if profile else cuda_name,
                                        precision=precision.lower(), checkpointing=checkpointing,
                                        sharding=sharding, world_size=world_size,
                                        shard_group=shard_group, parallel=parallel)
        outside = outside_torch_bytes(profile, world_size) if profile else None
        extra = {"outside_torch_bytes": outside} if profile else {}
        click.echo(json.dumps({str(n): {"allocated_bytes": a, "reserved_bytes": r, **extra}
                               for n, (a, r) in peaks.items()}, indent=2) if as_json
                   else format_cuda_estimate(model_file, profile.name if profile else cuda_name, peaks,
                                             outside=outside,
                                             memory=profile.memory_bytes if profile else None))
        return

    with _stdout_to_stderr(as_json):
        peaks = estimate_peaks(model_file, micro_batches, precision=precision.lower(),
                               checkpointing=checkpointing, sharding=sharding,
                               world_size=world_size, shard_group=shard_group, parallel=parallel,
                               accumulation_steps=accumulation_steps)
    if as_json:
        click.echo(json.dumps({str(n): peak for n, peak in peaks.items()}, indent=2))
        return
    layout = f"; one rank of {world_size} under {sharding}" if sharding != "ddp" else ""
    if not parallel.trivial:
        layout = f"; one rank of {world_size} under {parallel.describe(world_size, sharding.upper())}"
    state = ("the device's, shards and optimizer state in host memory" if Sharding.parse(sharding).offload
             else "optimizer state included")
    click.echo(f"{model_file}: estimated peak of one training step ({precision.lower()}, "
               f"checkpointing {checkpointing}{layout}; {state}, nothing allocated)")
    for n, peak in peaks.items():
        click.echo(f"  micro-batch {n:>6}: {format_bytes(peak):>12}  ({peak} bytes)")
    if Sharding.parse(sharding).offload:
        from ..probing.estimate import estimate_offload_host_peaks

        host = estimate_offload_host_peaks(model_file, micro_batches[:1], precision=precision.lower(),
                                           checkpointing=checkpointing, world_size=world_size,
                                           shard_group=shard_group)[micro_batches[0]]
        click.echo(f"  host memory per rank (shards, gradients, optimizer state and step, at any "
                   f"micro-batch): {format_bytes(host)}")


@cli.command()
@click.argument("profile", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the profiles as JSON.")
@_errors_to_exit_codes
def profiles(profile, as_json):
    """List the bundled GPU profiles, or check and show one (a name or a .toml path)."""
    from ..gpus.catalog import list_profiles, load_profile

    found = [load_profile(profile)] if profile else list_profiles()
    if as_json:
        click.echo(json.dumps([p.to_dict() for p in found], indent=2))
        return
    click.echo(f"{'profile':<12} {'memory':>10} {'budget':>10} {'bf16':>5} {'fp16':>5} "
               f"{'fp32 TF/s':>9} {'bf16 TF/s':>9} {'fp16 TF/s':>9} {'GB/s':>6}  name")
    for p in found:
        click.echo(f"{p.id:<12} {format_bytes(p.memory_bytes):>10} {format_bytes(p.budget_bytes):>10} "
                   f"{'yes' if p.bf16 else 'no':>5} {'yes' if p.fp16 else 'no':>5} "
                   f"{p.peak_tflops_fp32:>9g} {p.peak_tflops_bf16:>9g} {p.peak_tflops_fp16:>9g} "
                   f"{p.memory_bandwidth_gb_per_s:>6g}  {p.name}")
    if not profile:
        click.echo("\nbudget = memory - CUDA context, what a one-rank --gpu plan uses (more ranks "
                   "also leave NCCL's buffers outside; the caching allocator is modelled, so no "
                   "reserve comes off); TF/s are dense peaks. Pass a profile name or your own .toml "
                   "path to check one.")


@cli.command()
@click.argument("plan_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--model", "model_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="The model file (default: the one the plan records).")
@click.option("--device", default=None, help="cpu, cuda or cuda:N (default: CUDA when available).")
@click.option("--memory-limit", type=MEMORY_SIZE, default=None,
              help="Memory budget to emulate a smaller device, e.g. 8GiB, 512MiB or bytes.")
@click.option("--steps", type=click.IntRange(min=1), default=3, show_default=True,
              help="Real training steps to run at the plan's micro-batch.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Write the re-planned plan here when the plan is not confirmed.")
@_quiet_option
@_errors_to_exit_codes
@_trial_timeout_option
def verify(plan_file, model_file, device, memory_limit, steps, output):
    """Run a plan's micro-batch for a few real steps here: exit 0 when it fits, 1 when re-planned."""
    from ..files.outputs import check_outputs
    from ..planning.planfile import load_plan, save_plan
    from ..orchestration.verify import verify_plan
    from .format import format_verify

    check_outputs({"-o": output}, inputs={**_plan_inputs(load_plan(plan_file), plan_file),
                                          "--model": model_file})
    result = verify_plan(plan_file, workload=model_file, device=device, memory_limit=memory_limit,
                         steps=steps)
    click.echo(format_verify(result))
    if result.confirmed:
        return
    if output is not None and result.new_plan is not None:
        save_plan(result.new_plan, output)
        click.echo(f"new plan written to {output}")
    elif result.new_plan is not None:
        click.echo("the new plan was not written; pass -o FILE to write it")
    click.get_current_context().exit(1)


def main(argv=None):
    from ..training.stop import hold_termination

    with hold_termination():  # a rank torchrun stops after another failed still says why it stopped
        cli.main(args=argv, prog_name="autotune")


if __name__ == "__main__":
    main(sys.argv[1:])
