"""Reward functions by name: built-ins, `module:function`, `file.py:function`, reward-model folders.

Naming a module, a file or a reward-model folder runs that code or loads that model: reward
functions are user code. Repeated names get a suffix so their metrics stay distinct.

A `file.py` is loaded as a module registered under `file_module_name(path)`, so its functions
are found by name (the worker processes of `rewards.timeout_s` load it again under that name).
An exception at import, `SystemExit` included (`sys.exit(3)`), is one line naming the spec.

Deliberately simple: a function is loaded once per run, in the trainer's process (and again in
its worker process when there is one); Ctrl-C during an import stays a KeyboardInterrupt.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from infsamp.errors import RewardError
from infsamp.rewards.builtin import (
    BUILTIN_REWARDS,
    RewardFunction,
    format_reward,
    reasoning_gym_reward,
)

FILE_MODULE_PREFIX = "infsamp_user_rewards_"


def file_module_name(path: str) -> str:
    """The module name a reward file is loaded under: its stem and a hash of its full path, so
    two files of one name stay apart (and a worker process can load it under the same name)."""
    resolved = str(Path(path).resolve())
    digest = hashlib.sha1(resolved.encode()).hexdigest()[:8]
    return f"{FILE_MODULE_PREFIX}{Path(path).stem}_{digest}"


def load_file_module(path: str, name: str) -> Any:
    """Execute `path` as module `name`, registered in sys.modules (so that its functions are found
    by module and name); a file already loaded under that name is not run again."""
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)  # type: ignore[arg-type]
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)  # type: ignore[union-attr]
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import_failure(spec: str, what: str, err: BaseException, kind: str) -> RewardError:
    why = f"{type(err).__name__}: {err}".splitlines()[0]
    return RewardError(f"{kind} {spec!r}: {what} ({why})")


def _load_from_file(path: str, spec: str, kind: str) -> Any:
    if not Path(path).exists():
        raise RewardError(f"{kind} {spec!r}: file {path} does not exist")
    try:
        return load_file_module(path, file_module_name(path))
    except (Exception, SystemExit) as err:  # noqa: BLE001 - user code, sys.exit at import too
        raise _import_failure(spec, f"importing {path} failed", err, kind) from None


def _load_from_module(name: str, spec: str, kind: str) -> Any:
    try:
        return importlib.import_module(name)
    except (Exception, SystemExit) as err:  # noqa: BLE001
        raise _import_failure(spec, f"cannot import module {name!r}", err, kind) from None


def load_reference(spec: str, kind: str = "reward function") -> tuple[str, Any]:
    """'package.module:name' or 'path/to/file.py:name' -> (name, the callable it names);
    RewardError (one line, naming the `kind` and the spec) otherwise."""
    source, sep, attr = spec.rpartition(":")
    if not sep or not source or not attr:
        raise RewardError(f"{kind} {spec!r}: give 'module:name' or 'file.py:name'")
    is_file = source.endswith(".py")
    module = (_load_from_file(source, spec, kind) if is_file
              else _load_from_module(source, spec, kind))
    found = getattr(module, attr, None)
    if not callable(found):
        raise RewardError(f"{kind} {spec!r}: {source} has no function {attr!r}")
    return attr, found


def load_reward_function(spec: str, **model_options: Any) -> tuple[str, RewardFunction]:
    """A built-in name, 'package.module:function', 'path/to/file.py:function' or a reward model
    directory -> (name, function). `model_options` (device, dtype, max_tokens) go to
    `load_reward_model`."""
    if spec in BUILTIN_REWARDS:
        return spec, BUILTIN_REWARDS[spec]
    if Path(spec).is_dir():
        from infsamp.rewards.reward_model import load_reward_model

        return Path(spec).resolve().name, load_reward_model(spec, **model_options)
    source, sep, attr = spec.rpartition(":")
    if not sep or not source or not attr:
        raise RewardError(f"reward function {spec!r}: unknown (built-in: "
                          f"{', '.join(BUILTIN_REWARDS)}; or give 'module:function', "
                          "'file.py:function' or a reward model directory)")
    return load_reference(spec)


def load_reward_functions(names: list[str],
                          format_think_block: str = "forbid", answer_extraction: str = "answer_tag",
                          **model_options: Any) -> list[tuple[str, RewardFunction]]:
    """Load each spec; repeated names get a suffix (accuracy, accuracy_2) so metrics stay distinct.
    The built-in format reward gets `format_think_block` (`rewards.format_think_block`), the
    reasoning_gym reward `answer_extraction` (`rewards.answer_extraction`)."""
    loaded: list[tuple[str, RewardFunction]] = []
    seen: set[str] = set()
    for spec in names:
        name, func = load_reward_function(spec, **model_options)
        if func is format_reward and format_think_block != "forbid":
            func = functools.partial(format_reward, think_block=format_think_block)
        if func is reasoning_gym_reward:
            func = functools.partial(reasoning_gym_reward, answer_extraction=answer_extraction)
        unique, index = name, 2
        while unique in seen:
            unique, index = f"{name}_{index}", index + 1
        seen.add(unique)
        loaded.append((unique, func))
    return loaded
