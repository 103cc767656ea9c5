"""Fallback ladders: a task name that clients use as a model ("task:code"), mapped to models
tried in order, so a request is served by the first one that can be had in time.

Read from the TOML file given with `--tasks FILE`:

    [tasks.code]
    models = ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"]  # required, tried in order
    pin_primary = false   # optional: true waits for the first model instead of falling back
    keep_alive = "10m"    # optional: keep_alive of the models the task loads, in seconds or
                          # a duration ("10m", "1h30m"); as in Ollama, 0 unloads the model
                          # after the request and a negative value keeps it loaded forever
    budget_s = 5          # optional, > 0, default 30: how long a request may wait for a
                          # model of the ladder to load

Any mistake in the file (a misspelt key, an empty models list, a bad duration) is a
ConfigFileError naming the file and line.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shoal.config_file import FieldError, TomlFile, is_number
from shoal.durations import parse_duration_s

TASK_PREFIX = "task:"


class UnknownTask(LookupError):
    """A request named task:NAME and no ladder is called NAME (answered like an unknown
    model: 404)."""
DEFAULT_BUDGET_S = 30.0

_TASK_KEYS = ("models", "pin_primary", "keep_alive", "budget_s")


@dataclass(frozen=True)
class Ladder:
    name: str
    models: tuple[str, ...]  # tried in order; models[0] is the primary
    pin_primary: bool = False  # wait for models[0] rather than fall back
    # As a request's keep_alive_s: None the server's default, 0 unload after the request,
    # negative keep loaded forever.
    keep_alive_s: float | None = None
    budget_s: float = DEFAULT_BUDGET_S  # longest wait for a model of the ladder to load

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise FieldError(("name",), f"a task name must be a non-empty string, "
                                        f"not {self.name!r}")
        models = self.models
        if isinstance(models, str) or not isinstance(models, Sequence):
            raise FieldError(("models",), f"models must be a list of model names, "
                                          f"not {models!r}")
        object.__setattr__(self, "models", tuple(models))  # a list from a file, kept immutable
        if not self.models:
            raise FieldError(("models",), "models must name at least one model")
        for model in self.models:
            if not isinstance(model, str) or not model:
                raise FieldError(("models",), f"models must be non-empty strings, "
                                              f"not {model!r}")
        if len(set(self.models)) != len(self.models):
            raise FieldError(("models",), f"models lists a model twice: {list(self.models)}")
        if not isinstance(self.pin_primary, bool):
            raise FieldError(("pin_primary",), f"pin_primary must be true or false, "
                                               f"not {self.pin_primary!r}")
        if self.keep_alive_s is not None and not (is_number(self.keep_alive_s)
                                                  and math.isfinite(self.keep_alive_s)):
            raise FieldError(("keep_alive_s",), f"keep_alive_s must be a number of seconds, "
                                                f"not {self.keep_alive_s!r}")
        if not (is_number(self.budget_s) and math.isfinite(self.budget_s)
                and self.budget_s > 0):
            raise FieldError(("budget_s",), f"budget_s must be a number of seconds > 0, "
                                            f"not {self.budget_s!r}")


def task_name(model: str) -> str | None:
    """NAME for a model named "task:NAME", else None (an ordinary model name, or "task:")."""
    if model.startswith(TASK_PREFIX):
        return model[len(TASK_PREFIX):] or None
    return None


def load_ladders(path: Path) -> dict[str, Ladder]:
    """The ladders in a --tasks file by task name (format in the module docstring);
    ConfigFileError naming the file and line for anything wrong in it."""
    file = TomlFile.read(path)
    file.table((), allowed=("tasks",))
    return {name: _load_ladder(file, name) for name in file.table(("tasks",))}


def _load_ladder(file: TomlFile, name: str) -> Ladder:
    key_path = ("tasks", name)
    table = file.table(key_path, allowed=_TASK_KEYS)
    if "models" not in table:
        raise file.error(key_path, f"[tasks.{name}] needs models = [\"model\", ...]")
    if not isinstance(table["models"], list):
        raise file.error((*key_path, "models"), f"tasks.{name}.models must be a list of "
                                                f"model names, not {table['models']!r}")
    keep_alive_s = None
    if "keep_alive" in table:
        try:
            keep_alive_s = parse_duration_s(table["keep_alive"])
        except ValueError as error:
            raise file.error((*key_path, "keep_alive"), f"tasks.{name}.keep_alive: "
                                                        f"{error}") from None
        # Every negative value means "forever"; -1.0 is how requests carry it (see
        # shoal.api.ollama.options.keep_alive_seconds).
        keep_alive_s = -1.0 if keep_alive_s < 0 else keep_alive_s
    try:
        return Ladder(name, tuple(table["models"]),
                      pin_primary=table.get("pin_primary", False), keep_alive_s=keep_alive_s,
                      budget_s=table.get("budget_s", DEFAULT_BUDGET_S))
    except FieldError as error:
        key = {"keep_alive_s": "keep_alive"}.get(error.field[0], error.field[0])
        raise file.error((*key_path, key), f"tasks.{name}: {error}") from None
