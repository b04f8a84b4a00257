"""Training and export configs read from ERNIEKit-style YAML plus ``key=value`` overrides.

Field names are ERNIEKit's, so configs users already have keep working. An unknown key is an error that
names the file (and line) and suggests the closest valid key; values are checked with readable messages.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from engine.train.config import TrainConfig
from engine.train.erniekit_keys import (
    ERNIEKIT_ALIASES,
    ERNIEKIT_NOTICES,
    EXPORT_NOTICES,
    REFUSED_DEGREES,
    Notice,
)
from engine.train.export_config import ExportConfig
from engine.train.options import ConfigError, comma_list, field_types
from engine.train.stages import STAGE_ALIASES


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """Read an ERNIEKit training YAML and apply ``key=value`` overrides (later wins).

    ERNIEKit keys without effect here are accepted; ``config.notices`` says which and why.
    """
    return _load(TrainConfig, path, overrides or [], tolerated={})


def load_export_config(path: str | Path | None, overrides: list[str] | None = None) -> ExportConfig:
    """Read an export YAML; keys of a training config are accepted (and announced) so one file serves both."""
    tolerated = {f.name: "a training key; export does not use it" for f in dataclasses.fields(TrainConfig)}
    return _load(ExportConfig, path, overrides or [], tolerated={**tolerated, **EXPORT_NOTICES})


def config_from_dict(cls: type, values: dict[str, Any], source: str = "<dict>") -> Any:
    """Build a config from a plain dict (the studio's run form), with the same checks as a file."""
    return _build(cls, dict(values), source, {}, {})


def read_yaml_text(text: str, source: str) -> tuple[dict[str, Any], dict[str, int]]:
    """A config's YAML text as ``load_config`` reads it: its ``key: value`` pairs and each key's line
    (for text that is not a file: the studio's YAML import)."""
    return _parse_yaml(text, source)


@dataclass
class ConfigKeys:
    """What the engine makes of a config's keys before it builds the config: each field's value converted
    to its type (ERNIEKit aliases resolved), the keys it announces, and the problems by kind, each message
    naming where (``source:line``) and the key."""

    values: dict[str, Any]
    notices: list[Notice]
    unknown: list[str]
    refused: list[str]
    wrong: dict[str, str]


def read_keys(
    cls: type, values: dict[str, Any], source: str = "<dict>", lines: dict[str, int] | None = None
) -> ConfigKeys:
    """Sort a config's keys as ``load_config`` does: fields (converted), announced ERNIEKit keys, refused
    model-parallel degrees, keys of the wrong type and unknown keys (with the closest valid key)."""
    return _read_keys(cls, values, source, lines or {}, {})


def _load(cls: type, path: str | Path | None, overrides: list[str], tolerated: dict[str, str]) -> Any:
    values: dict[str, Any] = {}
    lines: dict[str, int] = {}
    source = "<overrides>"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.exists():
            raise FileNotFoundError(f"{p}: config file does not exist")
        values, lines = _read_yaml(p)
    fields = field_types(cls)
    unknown: list[str] = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. max_steps=100)")
        key, raw = item.split("=", 1)
        key = key.strip()
        target = _alias(cls, key)
        if target not in fields and key not in tolerated and key not in ERNIEKIT_NOTICES:
            unknown.append(f"override {item!r}: unknown key {key!r}{_suggest(key, fields)}")
            continue
        values.pop(key, None)  # an override goes after the file's keys, so it wins over an alias there too
        values[key] = _parse_override(raw.strip(), fields.get(target))
        lines[key] = -1
    return _build(cls, values, source, lines, tolerated, unknown)


def _alias(cls: type, key: str) -> str:
    """The field an ERNIEKit name stands for (``apply_hadamard`` -> ``fp8_hadamard``), else the key."""
    target = ERNIEKIT_ALIASES.get(key, key)
    return target if target in field_types(cls) else key


def _build(
    cls: type,
    values: dict[str, Any],
    source: str,
    lines: dict[str, int],
    tolerated: dict[str, str],
    unknown: list[str] | None = None,
) -> Any:
    """Check every key and value, and report all unknown keys at once (each with its line and the closest
    valid key), so a config from another tool is fixed in one pass. Keys without effect become notices."""
    keys = _read_keys(cls, values, source, lines, tolerated)
    unknown = keys.unknown + list(unknown or [])  # the file's keys in file order, then the overrides
    if unknown:
        head = f"{len(unknown)} unknown keys:\n" if len(unknown) > 1 else ""
        raise ConfigError(head + "\n".join(unknown), unknown)
    wrong = list(keys.wrong.values())
    if keys.refused or wrong:
        raise ConfigError("\n".join(keys.refused + wrong), keys.refused + wrong)
    config = cls(**keys.values)
    problems = config.validate()
    if problems:
        raise ConfigError(f"{source}: " + "; ".join(problems), problems)
    # Not a field: it is what the file said beyond the schema, so asdict() (train_config.json, the studio's
    # comparisons) stays the effective config itself.
    config.notices = keys.notices
    return config


def _read_keys(
    cls: type, values: dict[str, Any], source: str, lines: dict[str, int], tolerated: dict[str, str]
) -> ConfigKeys:
    fields = field_types(cls)
    kwargs = {}
    notices: list[Notice] = []
    found: list[str] = []
    refused: list[str] = []
    wrong: dict[str, str] = {}
    for key, value in values.items():
        where = f"{source}:{lines[key]}" if lines.get(key, -1) > 0 else source
        target = _alias(cls, key)
        if target == "stage" and value in STAGE_ALIASES:
            notices.append(
                Notice(key, f"{value} is ERNIEKit's earlier name of {STAGE_ALIASES[value]}; trained as that")
            )
            value = STAGE_ALIASES[value]
        if target in fields:
            try:
                kwargs[target] = _coerce(value, fields[target], key, where)
            except ConfigError as e:
                wrong[key] = str(e)
        elif cls is TrainConfig and key in REFUSED_DEGREES and _degree(value) > 1:
            refused.append(
                f"{where}: {key}: {value} asks for {REFUSED_DEGREES[key]} parallelism, which this engine "
                "does not do; set it to 1 (or leave it out) and train data-parallel on N devices (the "
                "studio's num_devices, or paddle.distributed.launch --nproc_per_node N)"
            )
        elif key in tolerated or key in ERNIEKIT_NOTICES:
            notices.append(Notice(key, tolerated.get(key) or ERNIEKIT_NOTICES[key]))
        else:
            found.append(f"{where}: unknown key {key!r}{_suggest(key, fields)}")
    return ConfigKeys(kwargs, notices, found, refused, wrong)


def _degree(value: Any) -> int:
    """A parallel degree as ERNIEKit writes it (an int, "2", or -1 for "all")."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 1


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    return _parse_yaml(path.read_text(encoding="utf-8"), str(path))


def _parse_yaml(text: str, path: str) -> tuple[dict[str, Any], dict[str, int]]:
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{line}: not valid YAML: {getattr(e, 'problem', e)}") from e
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config is a mapping of key: value lines, not {type(data).__name__}")
    lines = {}
    if isinstance(node, yaml.MappingNode):
        for k, _ in node.value:
            lines[str(k.value)] = k.start_mark.line + 1
    return {str(k): v for k, v in data.items()}, lines


def _suggest(key: str, fields: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _base_types(tp: Any) -> tuple[type, ...]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return tuple(t for t in typing.get_args(tp) if t is not type(None))
    return (tp,)


def _parse_override(raw: str, tp: Any) -> Any:
    """Command-line strings become the field's type; YAML syntax handles lists, numbers and nulls."""
    if raw.lower() in ("none", "null"):
        return None
    if tp is None:
        return raw
    base = _base_types(tp)
    if str in base:
        return raw
    if any(typing.get_origin(t) is list for t in base):
        return comma_list(raw)
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    base = _base_types(tp)
    if value is None:
        if type(None) in typing.get_args(tp):
            return None
        raise ConfigError(f"{where}: {key} may not be empty")
    for t in base:
        converter = _list_value if typing.get_origin(t) is list else _CONVERTERS.get(t)
        converted = converter(value) if converter else _NO_VALUE
        if converted is not _NO_VALUE:
            return converted
    names = " or ".join(getattr(t, "__name__", str(t)) for t in base)
    raise ConfigError(f"{where}: {key} must be {names}, got {value!r}")


_NO_VALUE = object()  # a converter's answer for "not of my type"


def _list_value(value: Any) -> Any:
    if isinstance(value, str):
        return comma_list(value)
    if isinstance(value, list | tuple):
        return [str(v) for v in value]
    return _NO_VALUE


def _bool_value(value: Any) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.lower() in ("true", "yes", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    return _NO_VALUE


def _int_value(value: Any) -> Any:
    if isinstance(value, bool):
        return _NO_VALUE
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return _parsed(value, int)


def _float_value(value: Any) -> Any:
    if isinstance(value, bool):
        return _NO_VALUE
    if isinstance(value, int | float):
        return float(value)
    return _parsed(value, float)


def _parsed(value: Any, parse: type) -> Any:
    """A number written as text ("3e-4", "100"), or _NO_VALUE."""
    if isinstance(value, str):
        try:
            return parse(value)
        except ValueError:
            pass
    return _NO_VALUE


def _str_value(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    if isinstance(value, str | int | float) and not isinstance(value, bool):
        return str(value)
    return _NO_VALUE


_CONVERTERS = {bool: _bool_value, int: _int_value, float: _float_value, str: _str_value}


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)
