"""Import an ERNIEKit training YAML (a person's upload or pasted text) as a run's choices.

The YAML is user data: it is checked as text first (size, one document, a mapping, no tags, no anchors or
aliases, shallow nesting), then read by the engine exactly as ``ernie-studio train`` reads a file
(``engine.train.config_load.read_yaml_text`` and ``read_keys``). Paths in it never reach the filesystem: the model
and the datasets are matched by name to what the studio already has, and what has no match is listed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

import yaml
from sqlalchemy.orm import Session

from engine.train.config import TrainConfig
from engine.train.config_load import read_keys, read_yaml_text
from engine.train.erniekit_keys import ERNIEKIT_ALIASES
from engine.train.options import DATASET_TYPE_NAMES, ConfigError, check_fields, comma_list, field_info
from engine.train.run_checks import not_applicable, problem_key
from studio.config import Settings
from studio.models import Dataset
from studio.services.datasets import list_datasets
from studio.services.errors import InvalidInput, PayloadTooLarge
from studio.services.messages import SERVICES
from studio.services.models import list_models

# ERNIEKit's longest example config is ~5 KB; a config 13 times that is not one a person wrote.
MAX_IMPORT_BYTES = 64 * 1024
# A config is key: value lines, a few of them lists (amp_custom_white_list); deeper nesting is not a config.
MAX_IMPORT_DEPTH = 4
# The dataset keys of a file, each with the run-spec field its datasets go to (None: the studio has none).
DATASET_KEYS = {
    "train_dataset_path": "dataset_ids",
    "eval_dataset_path": "eval_dataset_ids",
    "text_dataset_path": None,
}
# Keys of the file the studio sets itself for every run (each with what the studio uses instead).
STUDIO_SET = {
    "output_dir": "the studio writes every run under runs/<id>/output",
    "logging_dir": "the studio writes every run's logs under runs/<id>/output/logs",
    "train_dataset_type": "the studio reads each dataset in the format it detected at upload",
    "eval_dataset_type": "the studio reads each dataset in the format it detected at upload",
    "eval_dataset_prob": "the studio weighs evaluation datasets evenly",
}
# Not keys of their own on import: they follow from the datasets matched.
_DATASET_SIDE_KEYS = ("train_dataset_prob",)


@dataclass
class DatasetMatch:
    """One path a dataset key of the file names, and the studio dataset of that name (None: missing)."""

    key: str
    path: str
    line: int | None
    dataset_id: int | None = None
    dataset_name: str | None = None
    # the format the file gives the path (its *_dataset_type, ERNIEKit's names resolved) and the dataset's
    file_format: str = ""
    dataset_format: str = ""

    @property
    def note(self) -> str:
        """Why the path has no dataset, or how the dataset differs from what the file says."""
        if self.key == "text_dataset_path":
            return "VL-SFT text-only data is not a field of the studio's runs; it is left out"
        if self.dataset_id is None:
            return f"no uploaded dataset is named {path_name(self.path)!r}; upload it and pick it"
        if self.file_format and self.file_format != self.dataset_format:
            return f"the file says {self.file_format}; dataset #{self.dataset_id} was detected as {self.dataset_format}"
        return ""


@dataclass
class ImportedConfig:
    """A YAML's run choices as the studio's Train form and ``RunSpec`` take them."""

    stage: str
    fine_tuning: str
    compute_type: str
    # every other training key the file sets, the engine's value (converted to the key's type)
    hyperparameters: dict[str, Any]
    base_model: str | None
    model_path: str | None
    dataset_ids: list[int]
    dataset_probs: list[float] | None
    eval_dataset_ids: list[int]
    datasets: list[DatasetMatch]
    # ERNIEKit keys the engine accepts without effect: (key, why)
    notices: list[tuple[str, str]]
    # keys the file sets that have no effect on a run of its stage / fine-tuning / compute type:
    # (key, [(what, needed)]) as ``engine.train.options.Applies.unmet`` gives them
    not_applied: list[tuple[str, list[tuple[str, str]]]]
    # keys the studio sets itself, with what it uses instead: (key, value in the file, instead)
    studio_set: list[tuple[str, Any, str]] = field(default_factory=list)

    @property
    def missing(self) -> list[DatasetMatch]:
        return [m for m in self.datasets if m.dataset_id is None]

    def spec_hyperparameters(self) -> dict[str, Any]:
        """The keys as ``RunSpec.hyperparameters`` takes them, as the Train form sends them: lists
        comma-separated, the keys without effect on this run and the ones left to the model (null) out."""
        skipped = {key for key, _ in self.not_applied}
        return {
            key: ",".join(value) if isinstance(value, list) else value
            for key, value in self.hyperparameters.items()
            if key not in skipped and value is not None
        }


def import_train_yaml(
    session: Session, settings: Settings, data: str | bytes, source: str = "imported YAML"
) -> ImportedConfig:
    """Read an ERNIEKit training YAML as ``ernie-studio train`` does and map it onto the studio: every
    training key to its value, the model and the datasets by name. Raises ``InvalidInput`` (or
    ``PayloadTooLarge``) naming the problem and its line."""
    text = _checked_text(data, source)
    _check_structure(text, source)
    try:
        raw, lines = read_yaml_text(text, source)
        keys = read_keys(TrainConfig, raw, source, lines)
    except ConfigError as e:
        raise InvalidInput(str(e), details={"problems": e.problems}) from None
    problems = keys.unknown + keys.refused + list(keys.wrong.values())
    if keys.unknown:
        head = f"{len(keys.unknown)} unknown keys:\n" if len(keys.unknown) > 1 else ""
        raise InvalidInput(head + "\n".join(keys.unknown), details={"problems": problems})
    if problems:
        raise InvalidInput("\n".join(problems), details={"problems": problems})
    values = keys.values
    _check_holdable(values, source, lines)
    try:  # not validated: the form shows what the engine refuses, by field
        run = TrainConfig(**values)
    except (TypeError, ValueError) as e:
        raise InvalidInput(f"{source}: {e}") from None
    file_keys = {_field_of(k): k for k in raw}
    datasets = _match_datasets(session, values, lines, file_keys)
    model_path = values.get("model_name_or_path") or None
    imported = ImportedConfig(
        stage=run.stage,
        fine_tuning=run.fine_tuning,
        compute_type=run.compute_type,
        hyperparameters={
            k: v
            for k, v in values.items()
            if k not in ("stage", "fine_tuning", "model_name_or_path", *DATASET_KEYS, *_DATASET_SIDE_KEYS)
            and k not in STUDIO_SET
        },
        base_model=_match_model(session, settings, model_path) if model_path else None,
        model_path=model_path,
        dataset_ids=[m.dataset_id for m in datasets if m.key == "train_dataset_path" and m.dataset_id],
        dataset_probs=_probs(values, datasets, _where(source, lines, "train_dataset_prob")),
        eval_dataset_ids=[m.dataset_id for m in datasets if m.key == "eval_dataset_path" and m.dataset_id],
        datasets=datasets,
        notices=[(n.key, n.message) for n in keys.notices],
        not_applied=[],
        studio_set=[(k, raw[file_keys[k]], why) for k, why in STUDIO_SET.items() if k in file_keys],
    )
    for key in imported.hyperparameters:
        reasons = not_applicable(TrainConfig, key, run.stage, run.fine_tuning, run.compute_type)
        reasons = [r for r in reasons if r[0] != "model"]  # the model is the person's pick, checked later
        if reasons:
            imported.not_applied.append((key, reasons))
    return imported


# ---- the text -------------------------------------------------------------------------------------------


def _checked_text(data: str | bytes, source: str) -> str:
    raw = data.encode("utf-8", errors="surrogatepass") if isinstance(data, str) else data
    if len(raw) > MAX_IMPORT_BYTES:
        raise PayloadTooLarge(
            SERVICES("import_too_large", where=source, size=len(raw), limit=MAX_IMPORT_BYTES)
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise InvalidInput(SERVICES("import_not_utf8", where=f"{source}:{line}", byte=e.start)) from None
    if not text.strip():
        raise InvalidInput(SERVICES("import_empty", where=source))
    return text


def _check_structure(text: str, source: str) -> None:
    """Refuse what a config never needs and an attacker would: several documents, explicit tags (the
    ``!!python/...`` ones construct objects in unsafe loaders), anchors and aliases (a few lines of them
    expand to billions of values) and deep nesting. Reads the parser's events: nothing is built."""
    documents = depth = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            where = f"{source}:{event.start_mark.line + 1}"
            if isinstance(event, yaml.DocumentStartEvent):
                documents += 1
                if documents > 1:
                    raise InvalidInput(SERVICES("import_documents", where=where))
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                raise InvalidInput(SERVICES("import_anchors", where=where))
            tag = getattr(event, "tag", None)  # set only by an explicit tag (!!str, !!python/..., !x)
            if tag:
                tag = tag.replace("tag:yaml.org,2002:", "!!")
                raise InvalidInput(SERVICES("import_tag", where=where, tag=tag))
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_IMPORT_DEPTH:
                    raise InvalidInput(
                        SERVICES("import_nested", where=where, depth=depth, limit=MAX_IMPORT_DEPTH)
                    )
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = str(getattr(e, "problem", None) or e)
        raise InvalidInput(SERVICES("import_not_yaml", where=f"{source}{line}", problem=problem)) from None


def _check_holdable(values: dict[str, Any], source: str, lines: dict[str, int]) -> None:
    """Values no form field and no run can hold: a choice outside the key's choices, a number that is not
    finite. Refused with the engine's message and the key's line (a value out of bounds is imported: the
    form shows the engine's message beside its field)."""
    bad = set()
    for key, value in values.items():
        choices = field_info(TrainConfig, key).get("choices")
        items = value if isinstance(value, list) else [value]
        if choices is not None and value is not None and any(v not in choices for v in items):
            bad.add(key)
        if isinstance(value, float) and not math.isfinite(value):
            bad.add(key)
    if not bad:
        return
    try:
        config = TrainConfig(**values)
    except (TypeError, ValueError) as e:
        raise InvalidInput(f"{source}: {e}") from None
    problems = []
    for message in check_fields(config):
        key = problem_key(message)
        if key in bad:
            problems.append(f"{_where(source, lines, key)}: {message}")
    raise InvalidInput("\n".join(problems), details={"problems": problems})


def _where(source: str, lines: dict[str, int], key: str) -> str:
    """``source:line`` of the file's key for field ``key`` (an ERNIEKit alias of it counts)."""
    line = next((n for k, n in lines.items() if _field_of(k) == key), None)
    return f"{source}:{line}" if line else source


def _field_of(key: str) -> str:
    return ERNIEKIT_ALIASES.get(key, key)


# ---- names to the studio's datasets and models -------------------------------------------------------------


def path_name(path: str) -> str:
    """The last part of a path as the file writes it (``/data/a.jsonl`` or ``C:\\data\\a.jsonl`` -> ``a.jsonl``);
    the path itself is never opened."""
    return PureWindowsPath(PurePosixPath(path).name).name


def _match_datasets(
    session: Session, values: dict[str, Any], lines: dict[str, int], file_keys: dict[str, str]
) -> list[DatasetMatch]:
    datasets = list_datasets(session)
    out = []
    for key in DATASET_KEYS:
        if not values.get(key):
            continue
        own = values.get(key.replace("_path", "_type"), "")
        types = (
            [] if key == "text_dataset_path" else comma_list(own or values.get("train_dataset_type") or "")
        )
        for i, path in enumerate(comma_list(values[key])):
            wanted = types[i] if i < len(types) else (types[0] if len(types) == 1 else "")
            match = DatasetMatch(key, path, lines.get(file_keys.get(key, key)))
            match.file_format = DATASET_TYPE_NAMES.get(wanted, wanted)
            found = _dataset_named(datasets, path_name(path)) if DATASET_KEYS[key] else None
            if found is not None:
                match.dataset_id, match.dataset_name, match.dataset_format = (
                    found.id,
                    found.name,
                    found.format,
                )
            out.append(match)
    return out


def _dataset_named(datasets: list[Dataset], name: str) -> Dataset | None:
    """The newest dataset whose file name or name is ``name`` (or ``name`` without its suffix)."""
    stem = name.rsplit(".", 1)[0]
    for candidates in ((name,), (stem,)):
        hits = [d for d in datasets if d.filename in candidates or d.name in candidates]
        if hits:
            return max(hits, key=lambda d: d.id)
    return None


def _probs(values: dict[str, Any], datasets: list[DatasetMatch], where: str) -> list[float] | None:
    """The file's train_dataset_prob of the matched training datasets (None: the studio's even mix)."""
    if "train_dataset_prob" not in values:
        return None
    try:
        probs = [float(p) for p in comma_list(values["train_dataset_prob"])]
    except ValueError:
        raise InvalidInput(
            SERVICES("import_probs", where=where, value=values["train_dataset_prob"])
        ) from None
    train = [m for m in datasets if m.key == "train_dataset_path"]
    picked = [probs[i] for i, m in enumerate(train) if m.dataset_id and i < len(probs)]
    even = [round(1.0 / len(picked), 6)] * len(picked) if picked else []
    return None if picked == even else picked  # the studio's own even mix is the form's empty field


def _match_model(session: Session, settings: Settings, path: str) -> str | None:
    """The name of the model the studio lists whose name is the path's last part (case aside; ERNIEKit's
    ``-Paddle`` / ``-PT`` download suffix aside), or None."""
    wanted = path_name(path.rstrip("/\\")).lower()
    names = [m["name"] for m in list_models(session, settings)]
    if path.strip() in names:  # a name the studio lists (a preset, run:<id>)
        return path.strip()
    for candidate in (wanted, wanted.removesuffix("-paddle").removesuffix("-pt")):
        for name in names:
            if name.lower() == candidate:
                return name
    return None
