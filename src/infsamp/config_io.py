"""Reading the configuration into `config.Config`: YAML files, command-line overrides (dotted
keys, converted to each field's type with one clear line for a wrong one), writing it back, and the
list of every option that the CLI flags and help are built from.

Deliberately simple: defaults <- one YAML file <- overrides, in that order; no includes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from infsamp.config import Config
from infsamp.files import write_text
from infsamp.options import ConfigError


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Convert `value` to the annotated type or raise ConfigError naming `key`."""
    if value is None:  # YAML `key:` with nothing after it
        raise ConfigError(f"{key}: expected {type_name(annotation)}, got an empty value")
    origin = typing.get_origin(annotation)
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        if isinstance(value, str) and value.lstrip()[:1] == "[":  # flow YAML: '[{role: user}]'
            value = _flow_list(value, key)
        elif isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, item_type, key) for v in value]
    if origin is dict:
        return _coerce_mapping(value, key)
    if origin in (types.UnionType, typing.Union):  # str | dict: a name, or a mapping ('{a: 1}')
        mapping = isinstance(value, dict) or (isinstance(value, str) and value.lstrip()[:1] == "{")
        return _coerce_mapping(value, key) if mapping else _coerce(value, str, key)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if annotation is int:
        return _integer(value, key)
    if annotation is float:
        try:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if annotation is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    return value


def _flow_list(text: str, key: str) -> list[Any]:
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = None
    if not isinstance(value, list):
        raise ConfigError(f"{key}: expected a list such as [a, b], got {text!r}")
    return value


def _coerce_mapping(value: Any, key: str) -> dict[str, Any]:
    """A YAML mapping, or its flow text on the command line ('{enable_thinking: false}')."""
    if isinstance(value, str):
        try:
            value = yaml.safe_load(value) if value.strip() else {}
        except yaml.YAMLError:
            value = None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"{key}: expected a mapping such as {{enable_thinking: false}}, "
                          f"got {value!r}")
    return dict(value)


def _integer(value: Any, key: str) -> int:
    """An integer literal only ('90', 90): '1e30', 10.0 and 'three' are refused, never rounded."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = value.strip() if isinstance(value, str) else ""
    if text.lstrip("+-").isdigit() and len(text) <= 40:
        return int(text)
    raise ConfigError(f"{key}: expected an integer literal such as 90, got {value!r}")


def apply_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """Set dotted keys ('training.learning_rate') on `cfg`, converting and checking types."""
    for key, value in overrides.items():
        section_name, _, name = key.partition(".")
        if (not hasattr(cfg, section_name)
                or not dataclasses.is_dataclass(getattr(cfg, section_name))):
            raise ConfigError(f"{key}: unknown section {section_name!r} "
                              f"(known: {', '.join(f.name for f in dataclasses.fields(Config))})")
        section = getattr(cfg, section_name)
        hints = typing.get_type_hints(type(section))
        if name not in hints:
            raise ConfigError(f"{key}: unknown key (known in {section_name}: {', '.join(hints)})")
        setattr(section, name, _coerce(value, hints[name], key))
    return cfg


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}; a non-dict section value is kept as is for the error
    message."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and not prefix:
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


MAX_CONFIG_BYTES = 1 << 20  # a config is settings, not data: 1 MiB holds thousands of them


class _DuplicateKey(yaml.YAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (YAML would keep the last)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if not isinstance(key, typing.Hashable):
                continue  # refused later as a key that is not a name
            if key in seen:
                raise _DuplicateKey(f"line {line}: {key!r} is given twice (lines {seen[key]} "
                                    f"and {line}); keep one")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path}: does not exist")
    if path.is_dir():
        raise ConfigError(f"config file {path}: is a folder, not a YAML file")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path}: {path.stat().st_size} bytes, more than a config "
                          f"holds (at most {MAX_CONFIG_BYTES}); put data in a dataset file")
    try:
        tree = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path}: not a text file") from None
    except _DuplicateKey as err:
        raise ConfigError(f"config file {path} {err}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file {path}{where}: not valid YAML") from None
    if tree is None:
        raise ConfigError(f"config file {path}: is empty (no settings; run `infsamp train` "
                          "without a file for the demo)")
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping of sections")
    for section, value in tree.items():
        if not isinstance(value, dict):
            raise ConfigError(f"{section}: expected a mapping of options, got {value!r}")
    return tree


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Defaults <- YAML file <- overrides, then validation. Raises ConfigError (one line)."""
    cfg = Config()
    if path is not None:
        apply_overrides(cfg, flatten(read_yaml(path)))
    apply_overrides(cfg, overrides or {})
    return cfg.validate()


CONFIG_HEADER = ("# The settings of this run, written by infsamp. A resume does not read this "
                 "file: to resume\n# with edited settings pass the file: infsamp train "
                 "THIS_FILE --resume\n")
_SHA_LINE = "# sha256 of the settings below: "
NOT_SETTINGS = ("checkpointing.resume", "logging.output_dir")  # how and where, not what


def save_config(cfg: Config, path: str | Path) -> None:
    """Written to a temporary file and renamed, so a kill never leaves half a config. A header
    records the sha256 of the settings, so that an edit by hand is recognised (`config_edits`)."""
    path = Path(path)
    body = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    write_text(path, f"{CONFIG_HEADER}{_SHA_LINE}{_sha256(body)}\n{body}")


def config_edits(path: Path, cfg: Config) -> list[tuple[str, Any, Any]] | None:
    """None when `path` is as `save_config` wrote it (or was written before the header existed);
    else (key, value in the file, value in `cfg`) for every setting the edit made differ from
    `cfg` ([] when the edited file says what `cfg` says). Raises ConfigError for an edit that is
    not a readable config."""
    text = path.read_text(errors="replace")
    _, found, rest = text.partition(_SHA_LINE)
    digest, _, body = rest.partition("\n")
    if not found or _sha256(body) == digest.strip():
        return None
    try:
        edited = load_config(path)
    except ConfigError as err:
        raise ConfigError(f"{path} was edited by hand and cannot be read ({err}); undo the edit "
                          "(a resume does not read it)") from None
    mine, theirs = flatten(cfg.to_dict()), flatten(edited.to_dict())
    return [(key, theirs[key], mine[key]) for key in mine
            if key not in NOT_SETTINGS and theirs[key] != mine[key]]


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def iter_options() -> typing.Iterator[tuple[str, Any, Any, str]]:
    """(dotted key, type, default, help) for every option: drives the CLI flags and the docs."""
    for section in dataclasses.fields(Config):
        cls = section.default_factory  # type: ignore[misc]
        hints = typing.get_type_hints(cls)
        defaults = cls()
        for f in dataclasses.fields(cls):
            yield (f"{section.name}.{f.name}", hints[f.name], getattr(defaults, f.name),
                   f.metadata.get("help", ""))


def type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) is list:
        return f"list[{type_name(typing.get_args(annotation)[0])}]"
    if typing.get_origin(annotation) is dict:
        return "mapping"
    if typing.get_origin(annotation) in (types.UnionType, typing.Union):
        return " or ".join(type_name(a) for a in typing.get_args(annotation))
    return getattr(annotation, "__name__", str(annotation))
