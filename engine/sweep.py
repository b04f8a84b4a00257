"""Hyperparameter sweeps with Optuna: the search space over TrainConfig keys (checked against the schema's
types, bounds and choices), the sweep's settings (objective, direction, sampler, pruner, budget), and the
local sweep `ernie-studio sweep CONFIG.yaml --space SPACE.yaml` that trains its trials one after another.
The studio's sweeps (studio.services.sweeps) read the same space and settings and build the same samplers
and pruners; only who trains a trial differs (the studio's queue there, this process here)."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import signal
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.train.config import TrainConfig
from engine.train.stages import find_stage

if typing.TYPE_CHECKING:
    import optuna

SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "asha", "none")
DIRECTIONS = ("minimize", "maximize")
PARAM_TYPES = ("float", "int", "categorical")
# Keys a trial never varies: where the model, the data and the run directory are (the sweep sets them).
FIXED_KEYS = frozenset(
    {
        "model_name_or_path",
        "output_dir",
        "logging_dir",
        "stage",
        "fine_tuning",
        "train_dataset_path",
        "train_dataset_type",
        "train_dataset_prob",
        "eval_dataset_path",
        "eval_dataset_type",
        "eval_dataset_prob",
    }
)
MAX_TRIALS = 10_000


class SweepError(ValueError):
    """A space or sweep setting the engine cannot use; `problems` lists each one, naming its key."""

    def __init__(self, where: str, problems: list[str]) -> None:
        super().__init__(f"{where}: " + "; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class Param:
    """One searched key: a float range (log or uniform), an int range, or a list of choices."""

    key: str
    type: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: tuple[Any, ...] = ()

    def suggest(self, trial: optuna.trial.BaseTrial) -> Any:
        if self.type == "float":
            return trial.suggest_float(self.key, self.low, self.high, log=self.log, step=self.step)
        if self.type == "int":
            return trial.suggest_int(
                self.key, int(self.low), int(self.high), log=self.log, step=int(self.step or 1)
            )
        return trial.suggest_categorical(self.key, list(self.choices))


@dataclass
class SweepSettings:
    """What a sweep optimises and how long it may go on (the space file's keys besides `parameters`)."""

    objective: str = "eval_loss"
    direction: str = "minimize"
    n_trials: int = 8
    sampler: str = "tpe"
    pruner: str = "median"
    # Pruning starts once this many trials completed, and only after this many steps of a trial.
    prune_after_trials: int = 2
    prune_warmup_steps: int = 0
    seed: int = 0
    # Budget besides n_trials: 0 means no limit.
    max_wall_s: float = 0
    max_total_steps: int = 0
    # Trials to try first, each a {key: value} of the searched keys (Optuna's enqueue_trial).
    enqueue: list[dict[str, Any]] = field(default_factory=list)
    # The forgetting check as a constraint (studio sweeps only, with run.evaluate.general): a trial whose
    # general score fell by more than this (0-1, a fraction of accuracy) is not eligible as best. None: no
    # constraint.
    max_general_drop: float | None = None


def _field_types() -> dict[str, Any]:
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: (hints[f.name], f.metadata) for f in dataclasses.fields(TrainConfig)}


def _base_type(hint: Any) -> type | None:
    """float, int, bool or str from a field's annotation (`float | None` is float); None for lists etc."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_args(hint) else [hint]
    return args[0] if len(args) == 1 and args[0] in (float, int, bool, str) else None


def searchable_keys() -> dict[str, str]:
    """Every key a space may search, with what it takes: "float" or "int" (a range or choices), "choice"
    (the key's own choices or true / false); the studio's sweep editor lists these."""
    out: dict[str, str] = {}
    for key, (hint, meta) in _field_types().items():
        base = _base_type(hint)
        if key in FIXED_KEYS or base is None:
            continue
        if base in (float, int) and not meta.get("choices"):
            out[key] = "float" if base is float else "int"
        elif base is bool or (base is str and meta.get("choices")):
            out[key] = "choice"
    return out


def parse_space(parameters: Any, where: str = "parameters") -> list[Param]:
    """The search space `{key: {type, low, high, log, step, choices}}`, every problem named by its key."""
    if not isinstance(parameters, dict) or not parameters:
        raise SweepError(where, ["give at least one key to search, e.g. learning_rate: {type: float, ...}"])
    fields = _field_types()
    problems: list[str] = []
    params: list[Param] = []
    for key, spec in parameters.items():
        found = _param(str(key), spec, fields, problems)
        if found is not None:
            params.append(found)
    if problems:
        raise SweepError(where, problems)
    return params


def _param(key: str, spec: Any, fields: dict, problems: list[str]) -> Param | None:
    if key not in fields:
        close = difflib.get_close_matches(key, list(fields), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        problems.append(f"{key}: not a training key{hint}")
        return None
    if key in FIXED_KEYS:
        problems.append(f"{key}: set by the sweep itself (model, data, output), it cannot be searched")
        return None
    if not isinstance(spec, dict):
        problems.append(f"{key}: give a mapping such as {{type: float, low: 1e-5, high: 1e-3, log: true}}")
        return None
    unknown = set(spec) - {"type", "low", "high", "log", "step", "choices"}
    if unknown:
        problems.append(f"{key}: unknown setting(s) {', '.join(sorted(map(str, unknown)))}")
        return None
    kind = spec.get("type", "categorical" if "choices" in spec else "float")
    if kind not in PARAM_TYPES:
        problems.append(f"{key}: type must be one of {', '.join(PARAM_TYPES)}, got {kind!r}")
        return None
    hint, meta = fields[key]
    base = _base_type(hint)
    if kind == "categorical":
        return _categorical(key, spec, base, meta, problems)
    return _range(key, kind, spec, base, meta, problems)


def _range(
    key: str, kind: str, spec: dict, base: type | None, meta: Any, problems: list[str]
) -> Param | None:
    allowed = (float, int) if kind == "float" else (int,)
    if base not in allowed or meta.get("choices"):
        problems.append(f"{key}: a {kind} range needs a numeric key; {key} is {_type_name(base)}")
        return None
    low, high, step = spec.get("low"), spec.get("high"), spec.get("step")
    for name, v in (("low", low), ("high", high)):
        if not _number(v) or (kind == "int" and float(v) != int(v)):
            problems.append(
                f"{key}: {name} must be {'an integer' if kind == 'int' else 'a number'}, got {v!r}"
            )
            return None
    low, high = float(low), float(high)
    if not low < high:
        problems.append(f"{key}: the range is empty (low {low:g} must be below high {high:g})")
        return None
    lo, hi = meta.get("minimum"), meta.get("maximum")
    if lo is not None and low < lo:
        problems.append(f"{key}: low {low:g} is below the key's minimum {lo:g}")
    if hi is not None and high > hi:
        problems.append(f"{key}: high {high:g} is above the key's maximum {hi:g}")
    log = bool(spec.get("log", False))
    if log and low <= 0:
        problems.append(f"{key}: a log range needs low > 0, got {low:g}")
    if step is not None and (not _number(step) or step <= 0 or log):
        problems.append(f"{key}: step must be a positive number and cannot go with log")
    return Param(key, kind, low, high, log, float(step) if step is not None else None)


def _categorical(key: str, spec: dict, base: type | None, meta: Any, problems: list[str]) -> Param | None:
    choices = spec.get("choices")
    if not isinstance(choices, list) or not choices:
        problems.append(f"{key}: choices must be a non-empty list")
        return None
    if base is None:
        problems.append(f"{key}: only number, flag or single-choice keys can be searched")
        return None
    allowed, lo, hi = meta.get("choices"), meta.get("minimum"), meta.get("maximum")
    for c in choices:
        if base is bool and not isinstance(c, bool):
            problems.append(f"{key}: choice {c!r} is not true or false")
        elif base is str and (allowed is None or c not in allowed):
            what = f"one of {', '.join(allowed)}" if allowed else "a key with fixed choices"
            problems.append(f"{key}: choice {c!r} is not {what}")
        elif base in (int, float) and (not _number(c) or (base is int and float(c) != int(c))):
            problems.append(f"{key}: choice {c!r} is not {_type_name(base)}")
        elif base in (int, float) and ((lo is not None and c < lo) or (hi is not None and c > hi)):
            problems.append(f"{key}: choice {c!r} is outside {lo:g} .. {hi if hi is not None else 'inf'}")
    return Param(key, "categorical", choices=tuple(choices))


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _type_name(base: type | None) -> str:
    return {float: "a number", int: "an integer", bool: "a flag", str: "text"}.get(base, "a list or mapping")


def eval_metrics(stage: str) -> tuple[str, ...]:
    """The metrics a stage's evaluation reports (the keys of its eval rows in metrics.jsonl)."""
    info = find_stage(stage)
    if info is not None and info.option_group == "dpo":
        return ("eval_loss", "eval_rewards/accuracy", "eval_rewards/margins")
    return ("eval_loss", "eval_ppl")


def check_settings(s: SweepSettings, stage: str, params: list[Param], where: str = "sweep") -> None:
    """Objective, direction, sampler, pruner, budget and enqueued trials, each problem named by its key."""
    problems: list[str] = []
    metrics = eval_metrics(stage)
    if s.objective not in metrics:
        problems.append(
            f"objective: {s.objective!r} is no metric a {stage} evaluation reports ({', '.join(metrics)})"
        )
    for key, value, allowed in (
        ("direction", s.direction, DIRECTIONS),
        ("sampler", s.sampler, SAMPLERS),
        ("pruner", s.pruner, PRUNERS),
    ):
        if value not in allowed:
            problems.append(f"{key}: must be one of {', '.join(allowed)}, got {value!r}")
    for key in (
        "n_trials",
        "prune_after_trials",
        "prune_warmup_steps",
        "max_total_steps",
        "max_wall_s",
        "seed",
    ):
        v = getattr(s, key)
        if not _number(v) or v < 0 or (key == "n_trials" and not 1 <= v <= MAX_TRIALS):
            problems.append(f"{key}: must be a number >= {1 if key == 'n_trials' else 0}, got {v!r}")
    drop = s.max_general_drop
    if drop is not None and (not _number(drop) or not 0 <= drop <= 1):
        problems.append(f"max_general_drop: must be a fraction of accuracy from 0 to 1, got {drop!r}")
    names = {p.key for p in params}
    for i, trial in enumerate(s.enqueue):
        if not isinstance(trial, dict) or not set(trial) <= names:
            problems.append(
                f"enqueue[{i}]: give values of the searched keys only ({', '.join(sorted(names))})"
            )
    if problems:
        raise SweepError(where, problems)


def check_base(cfg: TrainConfig, objective: str, where: str) -> None:
    """The trials' config must train and evaluate, or no trial reports its objective."""
    problems = []
    if not cfg.eval_dataset_path:
        problems.append(
            f"eval_dataset_path: {objective} comes from the evaluation every eval_steps; give an eval set"
        )
    if not cfg.do_eval:
        problems.append(f"do_eval: false evaluates nothing, so no trial reports {objective}")
    if not cfg.do_train:
        problems.append("do_train: false trains nothing; a sweep compares trainings")
    if problems:
        raise SweepError(where, problems)


def settings_from_dict(values: dict[str, Any], where: str) -> tuple[SweepSettings, list[Param]]:
    """A space file's mapping: `parameters` plus any SweepSettings key."""
    known = {f.name for f in dataclasses.fields(SweepSettings)}
    unknown = set(values) - known - {"parameters"}
    if unknown:
        raise SweepError(
            where,
            [
                f"{k}: not a sweep key (known: parameters, {', '.join(sorted(known))})"
                for k in sorted(unknown)
            ],
        )
    if values.get("max_general_drop") is not None:
        raise SweepError(
            where,
            [
                "max_general_drop: the forgetting check scores general sets after each trial in the studio "
                "(POST /api/v1/sweeps with run.evaluate.general); a local sweep has none to constrain by"
            ],
        )
    params = parse_space(values.get("parameters"), f"{where}: parameters")
    return SweepSettings(**{k: v for k, v in values.items() if k in known}), params


def make_sampler(s: SweepSettings) -> optuna.samplers.BaseSampler:
    import optuna

    if s.sampler == "random":
        return optuna.samplers.RandomSampler(seed=s.seed)
    # few startup trials: sweeps here are short, and enqueued trials already spread the start
    return optuna.samplers.TPESampler(seed=s.seed, n_startup_trials=min(10, max(2, s.n_trials // 3)))


def make_pruner(s: SweepSettings) -> optuna.pruners.BasePruner:
    import optuna

    if s.pruner == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=s.prune_after_trials, n_warmup_steps=s.prune_warmup_steps
        )
    if s.pruner == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource="auto", reduction_factor=3)
    return optuna.pruners.NopPruner()


def create_study(s: SweepSettings, params: list[Param], storage: Any, name: str) -> optuna.Study:
    """The study of a sweep (loaded when it exists: a resumed sweep keeps its trials)."""
    import optuna

    study = optuna.create_study(
        storage=storage,
        study_name=name,
        direction=s.direction,
        sampler=make_sampler(s),
        pruner=make_pruner(s),
        load_if_exists=True,
    )
    if not study.trials:
        for values in s.enqueue:
            study.enqueue_trial(values, skip_if_exists=True)
    return study


def load_study(s: SweepSettings, storage: Any, name: str) -> optuna.Study:
    import optuna

    return optuna.load_study(study_name=name, storage=storage, sampler=make_sampler(s), pruner=make_pruner(s))


def asked(study: optuna.Study) -> int:
    """Trials asked for so far: enqueued trials still waiting for their turn do not count (n_trials counts
    them once `ask` hands them out)."""
    return sum(t.state.name != "WAITING" for t in study.get_trials(deepcopy=False))


def ask(study: optuna.Study, params: list[Param]) -> optuna.trial.Trial:
    """A new trial with every searched key suggested (its values are in `trial.params`)."""
    trial = study.ask()
    for p in params:
        p.suggest(trial)
    return trial


def run_local_sweep(
    cfg: TrainConfig, s: SweepSettings, params: list[Param], storage: Any = None
) -> optuna.Study:
    """Train the sweep's trials one after another in this process, each in `<output_dir>/trial-<n>`; an eval
    below the pruner's bar stops the trial as Ctrl-C does (a checkpoint is written) and it counts as pruned."""
    import time

    import optuna

    from engine.train import run_training

    study = create_study(s, params, storage, name=f"local:{Path(cfg.output_dir).resolve()}")
    started, steps = time.monotonic(), 0
    while asked(study) < s.n_trials:
        if (s.max_wall_s and time.monotonic() - started >= s.max_wall_s) or (
            s.max_total_steps and steps >= s.max_total_steps
        ):
            print(f"sweep budget spent after {asked(study)} trials", flush=True)
            break
        trial = ask(study, params)
        trial_cfg = dataclasses.replace(
            cfg, **trial.params, output_dir=str(Path(cfg.output_dir) / f"trial-{trial.number}")
        )
        reports = _Reports(trial, s.objective)
        summary = run_training(trial_cfg, reports.on_event)
        steps += summary.steps or 0
        if reports.pruned:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        elif summary.status == "succeeded" and reports.last is not None:
            study.tell(trial, reports.last)
        else:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        print(
            f"trial {trial.number}: {study.trials[trial.number].state.name.lower()} {trial.params} "
            f"{s.objective}={reports.last}",
            flush=True,
        )
    return study


class _Reports:
    """The objective of each eval row of a training in progress, reported to its trial."""

    def __init__(self, trial: optuna.trial.Trial, objective: str) -> None:
        self.trial, self.objective = trial, objective
        self.last: float | None = None
        self.pruned = False

    def on_event(self, event: dict) -> None:
        if event.get("type") != "metrics" or self.objective not in event or self.pruned:
            return
        self.last = float(event[self.objective])
        self.trial.report(self.last, int(event["step"]))
        if self.trial.should_prune():
            self.pruned = True
            # the trainer's own stop: it checkpoints at the next step and ends as cancelled
            os.kill(os.getpid(), signal.SIGTERM)
