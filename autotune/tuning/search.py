"""The throughput search: an Optuna study over configurations that keep the effective batch exact.

The space is precision × checkpointing × accumulation steps k, and k stands for the fewest-steps
split of the per-device share into micro-batches of at most ``ceil(share / k)`` (all of them sum
exactly to the share). k is an integer on a log scale, so TPE can learn "more steps is slower";
two k with the same split are one configuration, measured once. The distributions depend only
on the share, so a study kept in ``--storage`` stays compatible from run to run even when the
memory budget changes. A configuration predicted not to fit (the
probe's memory model against the budget minus the headroom) is pruned before any step runs; one
that runs out of memory is pruned at its first OOM. Both are Optuna PRUNED trials, never FAIL.

The sampler is a seeded TPESampler. The largest fitting micro-batch of each setting (what a memory
plan would train) is queued first, so the search can only improve on it; a small space (at most
``GRID_LIMIT`` fitting configurations) is queued whole, largest micro-batches first, which is a
grid search in a useful order. (Optuna's GridSampler visits its grid in random order and, in
Optuna 5.0, fails in ``after_trial`` when combined with queued trials.) A rerun of the same study
reuses what was measured: a configuration with a result is not measured again.

Checkpointing is off, on (every block) or K of the model's N repeated blocks (a
``checkpointed_blocks`` integer 1..N, N for every block, asked only when checkpointing is on and
some K was planned, so studies stored before it stay readable; the K a result was measured with is
kept with it). The planner offers the fewest K it proved and, below it, every K whose predicted
micro-batch no setting with fewer blocks reaches; a K-blocks split that fewer blocks already fit is
left out (same split, more recomputation).

The exploration ends at 70% of the budget; in the rest the fastest few are timed side by side
(windows interleaved on one model) and that comparison, not the single measurements taken at
different moments, names the winner.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..errors import ConfigError, given
from ..precision import Precision
from ..planning.types import ConfigurationMeasured, SettingTried
from ..workload.checkpoint_count import Checkpointing
from ..planning.policy import predicted_peak, split_pinned, split_share
from .measure import COMPARE_MIN_ROUNDS, Configuration, Measurement
from ..units import format_bytes
from .. import progress

if TYPE_CHECKING:
    import optuna
else:
    class _Optuna:
        """optuna, imported when the search first uses it: ``import autotune`` does not load it
        (with SQLAlchemy behind it, a large share of the import time); a memory plan never
        does, only ``--optimize throughput``."""

        def __getattr__(self, name):
            import optuna

            return getattr(optuna, name)

    optuna = _Optuna()

DEFAULT_BUDGET_S = 60.0
GRID_LIMIT = 16
"""Spaces with at most this many fitting configurations are queued whole (searched exhaustively)."""

CONFIRM_TOP = 4
"""The fastest few configurations (and the memory plan of each of their settings) are timed
again side by side before the winner is named."""

CONFIRM_SHARE = 0.3
"""Of the budget, kept for that comparison when the exploration would use it all."""

STALE_LIMIT = 30
"""Stop after this many trials in a row proposed nothing new (TPE keeps circling what it knows)."""

# Optuna stores categorical choices as plain strings: the enum's values.
PRECISIONS = tuple(p.value for p in Precision)
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(s|sec|m|min|h)?\s*$", re.IGNORECASE)
_SECONDS = {None: 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}


def parse_duration(value, *, option: str | None = None) -> float:
    """Seconds from "60s", "2m", "1h" or plain seconds ("90", 90)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if match is None:
            raise ConfigError(f"{given(option or 'budget', value)} is not a duration; write e.g. 60s, 2m or 90 (seconds)")
        seconds = float(match.group(1)) * _SECONDS[match.group(2) and match.group(2).lower()]
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"{given(option or 'budget', value)} must be more than 0 seconds; write e.g. 60s or 2m")
    return seconds


def split_choices(share: int) -> list[int]:
    """The largest micro-batch of every fewest-steps split of ``share`` (ascending)."""
    return sorted({math.ceil(share / k) for k in range(1, share + 1)})


def build_candidates(settings: list[SettingTried], *, share: int, usable: int, extra_bytes: int = 0,
                     pinned_micro_batch: int | None = None) -> list[Candidate]:
    """Every probed setting × every split up to one past the largest that any setting fits.

    A split fits a setting when its largest micro-batch is within what the planner allows there
    (measured or predicted peak, with DDP buckets, within the budget minus the headroom).
    """
    if pinned_micro_batch is not None:
        splits = [tuple(split_pinned(share, pinned_micro_batch))]
    else:
        choices = split_choices(share)
        largest = max((s.allowed_micro_batch for s in settings), default=0)
        fitting = [m for m in choices if m <= largest]
        beyond = [m for m in choices if m > largest][:1]  # shown pruned: where memory ends
        splits = [tuple(split_share(share, m)) for m in fitting + beyond]
    found = []
    for setting in settings:
        some_blocks = setting.checkpointing and not setting.checkpointing.all_blocks
        for split in splits:
            if some_blocks and _fewer_blocks_fit(setting, max(split), settings):
                continue
            config = Configuration(precision=setting.precision, checkpointing=setting.checkpointing,
                                   micro_batches=split)
            found.append(_candidate(setting, config, usable, extra_bytes,
                                    setting.probe.total_blocks if setting.probe else None))
    return found


def _fewer_blocks_fit(setting: SettingTried, micro_batch: int, settings: list[SettingTried]) -> bool:
    """Whether a setting of the same precision with fewer checkpointed blocks (or none) allows
    ``micro_batch``: then K blocks there only add recomputation."""
    return any(other.precision == setting.precision and other.allowed_micro_batch >= micro_batch
               and other.blocks is not None and other.blocks < setting.blocks for other in settings)


def setting_key(setting: SettingTried) -> tuple:
    """(precision, checkpointing) of a probed setting, as its configurations have them."""
    return (setting.precision, setting.checkpointing)


def _candidate(setting: SettingTried, config: Configuration, usable: int, extra: int,
               total_blocks: int | None) -> Candidate:
    if setting.probe is None:
        return Candidate(config=config, predicted_peak_bytes=None, predicted_fits=False,
                         why_not=f"the probe found nothing that fits: {setting.error}")
    peak = int(predicted_peak(setting.probe, config.micro_batch, extra))
    if config.micro_batch <= setting.allowed_micro_batch:
        return Candidate(config=config, predicted_peak_bytes=peak, predicted_fits=True,
                         total_blocks=total_blocks, warm_up_s=_warm_up_s(setting, config.share))
    return Candidate(config=config, predicted_peak_bytes=peak, predicted_fits=False,
                     total_blocks=total_blocks,
                     why_not=f"predicted {format_bytes(peak)} > {format_bytes(usable)} usable "
                             f"(probe max {setting.raw_max_micro_batch}); not run")


def _warm_up_s(setting: SettingTried, share: int) -> float | None:
    """``share`` samples at the fastest rate per sample of ``setting``'s fitting probe trials (each
    a whole step or window, timed with its bytes counted, as a warm-up window is): the per-sample
    rate rises at smaller micro-batches and a first window does one-time work, so the warm-up takes
    about this or more."""
    rates = [t.seconds / sum(t.micro_steps or [t.micro_batch]) for t in setting.probe.trials
             if t.fits and t.seconds > 0]
    return share * min(rates) if rates else None


def study_name(*, workload_key: str, target_batch: int, world_size: int, device: str,
               pinned_micro_batch: int | None = None) -> str:
    """Stable per workload file, target, world size and device, so a rerun finds its study."""
    digest = hashlib.sha256(workload_key.encode()).hexdigest()[:12]
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    pinned = f"-mb{pinned_micro_batch}" if pinned_micro_batch else ""
    return f"autotune-{digest}-b{target_batch}-w{world_size}-{slug}{pinned}"


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """A configuration and what the memory model says about it."""

    config: Configuration
    predicted_peak_bytes: int | None
    predicted_fits: bool
    why_not: str = ""
    """For a configuration predicted not to fit: why."""
    total_blocks: int | None = None
    """The model's repeated blocks, N (None: not known)."""
    warm_up_s: float | None = None
    """About the least its warm-up window can take: its samples at the fastest rate per sample of
    its setting's probe trials (real steps, bytes counted as the warm-up counts them; None: no
    real trial)."""


@dataclass(kw_only=True)
class SearchResult:
    records: list[ConfigurationMeasured]
    """One per configuration with a result (this run or reused), fastest first."""
    winner: ConfigurationMeasured | None
    measured: int
    """Configurations measured with real steps by this run."""
    reused: int
    sampler: str
    seconds: float
    budget_s: float
    study_name: str


def search_throughput(candidates: list[Candidate], measure: Callable[[Configuration, float], Measurement],
                      compare: Callable[[list[Configuration], float], list[Measurement]], *,
                      budget_s: float, usable_bytes: int, study_name: str, storage: str | None = None,
                      seed: int = 0, verbose: bool = False, confirm_top: int = CONFIRM_TOP,
                      clock: Callable[[], float] = time.perf_counter) -> SearchResult:
    """Measure candidates under ``budget_s`` seconds and return every result and the fastest.

    ``measure(config, seconds)`` measures one configuration (its peak and samples/s) in about
    the ``seconds`` the exploration has left; ``compare(configs, seconds)`` times several side by
    side (``throughput.compare_configurations``). The search explores with ``measure``; then the
    ``confirm_top`` fastest, and the memory plan (largest micro-batch) of each of their settings,
    are compared window by window in what is left of the budget, and the fastest of that
    comparison wins. Measured one after the other,
    configurations meet different moments of a machine whose speed drifts, and one pass crowns
    whichever was luckiest (the winner's curse); side by side they meet the same.
    ``clock`` reads seconds (tests pass a fake one).
    """
    if not candidates:
        raise ConfigError("the throughput search has no configuration to try")
    started = clock()
    share = candidates[0].config.share
    by_key = {_key(c.config): c for c in candidates}
    # K is asked (1..N) only where some K of N is a candidate: without one, "on" is every block.
    total = max((c.total_blocks or 0 for c in candidates
                 if c.config.checkpointing and not c.config.checkpointing.all_blocks), default=0)
    with _quiet(verbose):
        study = _open_study(study_name, storage,
                            sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=5))
        known = _known_results(study, by_key, usable_bytes, total)
        for candidate in _to_enqueue(candidates, known, _tried_before(study, total)):
            study.enqueue_trial(_params(candidate.config, total))
        explore_s = budget_s * (1 - CONFIRM_SHARE) if confirm_top > 1 else budget_s
        run = _Run(by_key=by_key, known=known, measure=measure, compare=compare, usable=usable_bytes,
                   share=share, budget_s=explore_s, clock=clock, total_blocks=total)
        with progress.bar("throughput search", total=round(budget_s), unit="s") as run.progress:
            if not run.done():
                study.optimize(run.objective, timeout=explore_s, callbacks=[run.stop_when_done],
                               catch=())
            run.progress.set_postfix_str("timing the fastest side by side", refresh=True)
            run.confirm(confirm_top, deadline=started + budget_s)
    records = sorted(run.results.values(), key=_speed, reverse=True)
    fitting = [r for r in records if r.fits and r.samples_per_s is not None]
    return SearchResult(records=records, winner=fitting[0] if fitting else None,
                        measured=run.measured, reused=sum(r.reused for r in records),
                        sampler=type(study.sampler).__name__, seconds=clock() - started,
                        budget_s=budget_s, study_name=study_name)


# --- the objective ---------------------------------------------------------------------------------

class _Run:
    def __init__(self, *, by_key, known, measure, compare, usable, share, budget_s, clock,
                 total_blocks: int = 0):
        self.clock = clock
        self.by_key = by_key
        self.measure = measure
        self.compare = compare
        self.usable = usable
        self.share = share
        self.results: dict[tuple, ConfigurationMeasured] = dict(known)
        self.measured = 0
        self.measuring_s = 0.0
        self.setup_s = 0.0  # the longest set-up a measurement reported: a comparison pays one
        self.stale = 0
        self.started = clock()
        self.deadline = self.started + budget_s
        self.progress = None
        self.total_blocks = total_blocks

    def done(self) -> bool:
        return all(key in self.results for key in self.by_key)

    def stop_when_done(self, study, _trial) -> None:
        # Optuna's timeout only stops *starting* trials after the budget; stopping when a typical
        # measurement would not finish in time keeps the search within the budget.
        typical = self.measuring_s / self.measured if self.measured else 0.0
        if (self.done() or self.stale >= STALE_LIMIT
                or self.clock() + typical > self.deadline):
            study.stop()

    def objective(self, trial: optuna.Trial) -> float:
        precision = trial.suggest_categorical("precision", list(PRECISIONS))
        checkpointing = Checkpointing.off()
        if trial.suggest_categorical("checkpointing", [False, True]):
            checkpointing = Checkpointing.every_block()
            if self.total_blocks:
                checkpointing = Checkpointing.of(trial.suggest_int("checkpointed_blocks", 1, self.total_blocks),
                                                 self.total_blocks)
        steps = trial.suggest_int("accumulation_steps", 1, self.share, log=True)
        key = (precision, checkpointing, max(split_share(self.share, math.ceil(self.share / steps))))
        candidate = self.by_key.get(key)
        self.stale += 1
        if candidate is None:
            trial.set_user_attr("note", "outside this run's space (precision, checkpointing or "
                                        "micro-batch not searched)")
            raise optuna.TrialPruned()
        known = self.results.get(key)
        if known is not None and known.status == "measured":
            # Sampled again (TPE may repeat itself): the result stands, nothing is re-run.
            return known.samples_per_s
        if known is not None and known.status == "skipped":
            raise optuna.TrialPruned(known.note)  # less time is left now: nothing new
        self.stale = 0
        record = self._evaluate(candidate)
        self.results[key] = record
        for name, value in record.to_dict().items():
            trial.set_user_attr(name, value)
        trial.set_user_attr("usable_bytes", self.usable)
        if record.status == "pruned":
            if candidate.predicted_fits:
                self._queue_next_memory_plan(trial.study, candidate)
            raise optuna.TrialPruned(record.note)
        if record.status == "skipped":  # a rerun measures it (only out-of-memory prunes are kept)
            raise optuna.TrialPruned(record.note)
        return record.samples_per_s

    def _queue_next_memory_plan(self, study: optuna.Study, failed: Candidate) -> None:
        """A setting's memory plan (its largest micro-batch predicted to fit) that ran past the
        budget when measured gives way to the next smaller split, queued next: the search must
        not end without the plan it is meant to improve on."""
        setting = _setting(failed.config)
        fitting = [r for r in self.results.values()
                   if _setting(r) == setting and r.fits and r.status == "measured"]
        smaller = [c for key, c in self.by_key.items()
                   if key[:2] == setting and c.predicted_fits and key not in self.results
                   and c.config.micro_batch < failed.config.micro_batch]
        if not smaller:
            return
        following = max(smaller, key=lambda c: c.config.micro_batch)
        if all(r.micro_batch < following.config.micro_batch for r in fitting):
            study.enqueue_trial(_params(following.config, self.total_blocks))

    def confirm(self, top: int, *, deadline: float) -> None:
        """Time the ``top`` fastest side by side in what is left of the budget. Only when this
        run measured one of them: a rerun that reuses every result of a stored study measures
        nothing. After a set-up (as long as the longest a measurement had), the comparison runs a
        warm-up round and ``COMPARE_MIN_ROUNDS`` rounds whatever time is left, each round a window
        of every contender (its length known from its measurement): the slowest contenders stay
        out until those rounds fit the time left, and with fewer than two left the single
        measurements stand. README's tiny_lm at ``--budget 20s`` compared four contenders, whose
        16 windows took 11 s where 5 were left: 24 s of the 20."""
        measured = [r for r in sorted(self.results.values(), key=_speed, reverse=True)
                    if r.fits and r.status == "measured"]
        contenders = measured[:top]
        # With them, the memory plan of each of their settings (its largest micro-batch), the plan
        # the search must not lose to, even when its own measurement met a slow moment.
        for setting in dict.fromkeys(_setting(r) for r in contenders):
            largest = max((r for r in measured if _setting(r) == setting),
                          key=lambda r: r.micro_batch)
            if largest not in contenders:
                contenders.append(largest)
        if len(contenders) < 2 or all(r.reused for r in contenders):
            return
        contenders = _affordable(contenders, self.share, deadline - self.clock() - self.setup_s)
        if len(contenders) < 2:
            return
        configs = [self.by_key[(*_setting(r), r.micro_batch)].config for r in contenders]
        for record, result in zip(contenders, self.compare(configs, deadline - self.clock())):
            record.compared = True
            if result.out_of_memory or result.samples_per_s is None:
                # Possible on CUDA (fragmentation): a plan that fails now and then is no winner.
                record.fits, record.status = False, "pruned"
                record.note = "out of memory when timed again beside the other fastest"
            else:
                record.samples_per_s = result.samples_per_s

    def _evaluate(self, candidate: Candidate) -> ConfigurationMeasured:
        config = candidate.config
        record = ConfigurationMeasured(precision=config.precision, checkpointing=config.checkpointing,
                                       micro_batches=list(config.micro_batches),
                                       predicted_peak_bytes=candidate.predicted_peak_bytes)
        if not candidate.predicted_fits:
            record.fits, record.status, record.note = False, "pruned", candidate.why_not
            return record
        started = self.clock()
        left = self.deadline - started
        if (candidate.warm_up_s is not None and candidate.warm_up_s > left
                and any(r.fits and r.status == "measured" for r in self.results.values())):
            # Its warm-up window always runs (it gives the peak): one that would end past the
            # budget is not started, once something fits and was measured (a plan needs one).
            record.status = "skipped"
            record.note = (f"its warm-up window would take {candidate.warm_up_s:.1f}s or more (its "
                           f"probe's trials), {left:.1f}s of the budget left")
            return record
        result = self.measure(config, max(0.0, self.deadline - started))
        self.measured += 1
        self.measuring_s += self.clock() - started
        self.setup_s = max(self.setup_s, result.setup_seconds)
        record.peak_bytes = result.peak_bytes
        record.samples_per_s = result.samples_per_s
        record.warm_up_only = result.warm_up_only
        self._show(record)
        if result.out_of_memory or result.samples_per_s is None:
            record.fits, record.status = False, "pruned"
            record.note = f"out of memory at the first window (predicted {format_bytes(candidate.predicted_peak_bytes)})"
        elif not result.within_budget or (result.peak_bytes or 0) > self.usable:
            record.fits, record.status = False, "pruned"
            record.note = (f"measured peak {format_bytes(result.peak_bytes)} > "
                           f"{format_bytes(self.usable)} usable")
        return record


    def _show(self, record: ConfigurationMeasured) -> None:
        if self.progress is None:
            return
        best = max((r.samples_per_s for r in [*self.results.values(), record]
                    if r.fits and r.samples_per_s is not None), default=None)
        speed = f"{record.samples_per_s:.1f}" if record.samples_per_s is not None else "-"
        self.progress.n = min(round(self.clock() - self.started), self.progress.total or 0)
        self.progress.set_postfix_str(
            f"{self.measured} measured; {record.precision} checkpointing "
            f"{'on' if record.checkpointing else 'off'} micro-batch {record.micro_batch}: "
            f"{speed} samples/s" + (f"; best so far {best:.1f}" if best else ""), refresh=True)


def _affordable(contenders: list[ConfigurationMeasured], share: int, seconds: float) -> list[ConfigurationMeasured]:
    """The fastest of ``contenders`` whose comparison's fixed rounds fit ``seconds`` (in their
    order): each round runs a window of each, ``share`` samples at its measured samples/s."""
    kept, round_s = [], 0.0
    for record in sorted(contenders, key=lambda r: r.samples_per_s, reverse=True):
        round_s += share / record.samples_per_s
        if (COMPARE_MIN_ROUNDS + 1) * round_s > seconds:
            break
        kept.append(record)
    return [r for r in contenders if any(r is k for k in kept)]


def _speed(record: ConfigurationMeasured) -> tuple:
    # Compared side by side, the contenders rank above single measurements taken at other moments.
    return (record.fits, record.compared, record.samples_per_s or 0.0)


# --- the study -------------------------------------------------------------------------------------

def _setting(config) -> tuple:
    """(precision, checkpointing) of a configuration or a record."""
    return (config.precision, config.checkpointing)


def _key(config: Configuration) -> tuple:
    return (*_setting(config), config.micro_batch)


def _params(config: Configuration, total_blocks: int) -> dict:
    params = {"precision": config.precision.value, "checkpointing": config.checkpointing.enabled,
              "accumulation_steps": config.accumulation_steps}
    if config.checkpointing and total_blocks:
        params["checkpointed_blocks"] = config.checkpointing.count or total_blocks
    return params


def _trial_key(trial, total_blocks: int) -> tuple:
    """A stored trial's configuration key (the blocks a result was measured with are in its
    attributes: one checkpointing object, or before that a bool and ``checkpointed_blocks``;
    studies stored before counts only had an "all"/"fewest" parameter)."""
    attrs = trial.user_attrs
    return (trial.params.get("precision"), _stored_checkpointing(attrs, trial.params, total_blocks),
            max(attrs["micro_batches"]))


def _stored_checkpointing(attrs: dict, params: dict, total_blocks: int) -> Checkpointing:
    value = attrs.get("checkpointing", params.get("checkpointing", False))
    if isinstance(value, bool) and value and attrs.get("checkpointed_blocks") is None:
        return Checkpointing.every_block()  # "on": every block, whatever the count
    return Checkpointing.from_file(value, attrs.get("checkpointed_blocks"), total_blocks or None)


def check_storage(storage: str | None) -> None:
    """Open ``storage`` once, before any measuring, so a bad URL fails at once."""
    if storage is not None:
        with _storage_errors(storage):
            optuna.storages.get_storage(storage)


def _database_errors() -> tuple:
    """optuna's relational storage's errors; absent, no database URL can be opened anyway."""
    try:
        from sqlalchemy.exc import SQLAlchemyError
    except ImportError:
        return ()
    return (SQLAlchemyError,)


def _open_study(name: str, storage: str | None, *, sampler) -> optuna.Study:
    with _storage_errors(storage):
        return optuna.create_study(study_name=name, storage=storage, sampler=sampler,
                                   direction="maximize", load_if_exists=True)


@contextlib.contextmanager
def _storage_errors(storage: str | None):
    try:
        yield
    except (ValueError, ImportError, optuna.exceptions.StorageInternalError, *_database_errors()) as exc:
        # Optuna and SQLAlchemy report a malformed URL, an unknown scheme, a missing database
        # driver or a folder that does not exist this way.
        reason = str(exc).splitlines()[0]
        raise ConfigError(f"--storage {storage!r} cannot be opened ({reason}); use e.g. "
                          f"sqlite:///autotune.db in a folder that exists") from None


def _known_results(study: optuna.Study, by_key: dict, usable: int, total_blocks: int) -> dict:
    """Results an earlier run stored that still hold: measured configurations whose peak fits
    this budget, and out-of-memory prunes made with no more memory than this run has."""
    known: dict[tuple, ConfigurationMeasured] = {}
    for trial in study.get_trials(deepcopy=False):
        attrs = trial.user_attrs
        if "micro_batches" not in attrs or "status" not in attrs:
            continue
        key = _trial_key(trial, total_blocks)
        if key not in by_key:
            continue
        record = ConfigurationMeasured.from_dict(
            {k: attrs[k] for k in (*_RECORD_FIELDS, "checkpointed_blocks") if k in attrs},
            total_blocks=total_blocks or None)
        record.reused = True
        if trial.state == optuna.trial.TrialState.COMPLETE:
            if (record.peak_bytes or 0) > usable or record.warm_up_only:
                continue  # measured on a larger budget, or by a warm-up alone: measure it here
            known[key] = record
        elif (trial.state == optuna.trial.TrialState.PRUNED and record.note.startswith("out of memory")
              and attrs.get("usable_bytes", 0) >= usable and key not in known):
            known[key] = record
    return known


_RECORD_FIELDS = tuple(ConfigurationMeasured.__dataclass_fields__)


def _tried_before(study: optuna.Study, total_blocks: int) -> set[tuple]:
    return {_trial_key(t, total_blocks) for t in study.get_trials(deepcopy=False)
            if t.state.is_finished() and "micro_batches" in t.user_attrs}


def _to_enqueue(candidates: list[Candidate], known: dict, tried: set) -> list[Candidate]:
    """The memory plans first; then what an earlier run tried but whose result no longer holds
    (a sampler treats a tried point as visited and would not come back to it)."""
    fitting = [c for c in candidates if c.predicted_fits]
    if len(fitting) <= GRID_LIMIT:
        rest = sorted(candidates, key=lambda c: (not c.predicted_fits, -c.config.micro_batch,
                                                 c.config.checkpointing.enabled,
                                                 c.config.checkpointing.all_blocks))
    else:
        rest = [c for c in candidates if _key(c.config) in tried]
    queue = []
    for candidate in _first_to_try(candidates) + rest:
        if _key(candidate.config) not in known and candidate not in queue:
            queue.append(candidate)
    return queue


def _first_to_try(candidates: list[Candidate]) -> list[Candidate]:
    """Per setting, the largest micro-batch predicted to fit (what a memory plan would train), the
    shortest predicted warm-up first: the first configuration measured runs whatever its warm-up
    (a plan needs one), so a budget shorter than the others' warm-ups is overrun least, or not at
    all, and the likeliest fastest is measured first (a warm-up is the share at the setting's
    fastest rate per sample)."""
    best: dict[tuple, Candidate] = {}
    for candidate in candidates:
        setting = _setting(candidate.config)
        if candidate.predicted_fits and (setting not in best or
                                         candidate.config.micro_batch > best[setting].config.micro_batch):
            best[setting] = candidate
    return sorted(best.values(), key=lambda c: (c.warm_up_s is None, c.warm_up_s or 0.0,
                                                c.config.checkpointing.enabled,
                                                c.config.checkpointing.all_blocks))


@contextlib.contextmanager
def _quiet(verbose: bool):
    """Optuna logs every trial at INFO; autotune prints its own table instead."""
    previous = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.INFO if verbose else optuna.logging.WARNING)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(previous)


def why_fastest(result: SearchResult) -> str:
    """Why the winner won, in one line for the plan's reasons."""
    winner = result.winner
    measured = [r for r in result.records if r.status == "measured" and r.fits]
    pruned = [r for r in result.records if r.status == "pruned"]
    skipped = sum(r.status == "skipped" for r in result.records)
    text = (f"fastest measured: {winner.label()} at {winner.samples_per_s:.1f} samples/s over full "
            f"windows")
    compared = [r for r in result.records if r.compared and r.fits]
    if winner.compared:
        text += f" (timed side by side with {len(compared) - 1} other(s), window by window)"
    runner_up = next((r for r in measured if r is not winner), None)
    if runner_up is not None:
        ratio = winner.samples_per_s / runner_up.samples_per_s
        text += f", {ratio:.2f}x the runner-up ({runner_up.label()}, {runner_up.samples_per_s:.1f}/s)"
        if ratio < 1.03:
            text += " (within timing noise: either is as good)"
    warm_up_only = sum(r.warm_up_only for r in measured)
    text += (f"; {len(measured)} configuration(s) fit and were measured ({result.reused} reused from "
             f"the study"
             + (f", {warm_up_only} by their warm-up window alone: the budget left no timed window"
                if warm_up_only else "")
             + f"), {len(pruned)} pruned for memory"
             + (f", {skipped} not measured: their warm-up window alone would end past the budget"
                if skipped else "")
             + f"; {result.sampler}, {result.seconds:.0f}s "
             f"of a {result.budget_s:.0f}s budget, study {result.study_name}")
    return text
