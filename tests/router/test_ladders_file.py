"""--tasks files: ladders load to the right values; every mistake is a ConfigFileError
naming the file, the line and the reason; task_name."""

from __future__ import annotations

import pytest

from shoal.config_file import ConfigFileError
from shoal.router.ladders import Ladder, load_ladders, task_name

EXAMPLE = """\
[tasks.code]
models = ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"]
pin_primary = false
keep_alive = "10m"
budget_s = 5

[tasks.chat]
models = ["llama3.2-1b"]
pin_primary = true
"""


def write(tmp_path, text):
    path = tmp_path / "tasks.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_example_loads(tmp_path):
    assert load_ladders(write(tmp_path, EXAMPLE)) == {
        "code": Ladder("code", ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"),
                       keep_alive_s=600.0, budget_s=5.0),
        "chat": Ladder("chat", ("llama3.2-1b",), pin_primary=True, budget_s=30.0),
    }


@pytest.mark.parametrize("toml_value,seconds", [
    ('"0"', 0.0), ("0", 0.0), ("90", 90.0), ('"2.5"', 2.5), ('"1h30m"', 5400.0),
    ('"-1s"', -1.0), ("-5", -1.0),
])
def test_keep_alive(tmp_path, toml_value, seconds):
    text = f"[tasks.t]\nmodels = ['m']\nkeep_alive = {toml_value}\n"
    assert load_ladders(write(tmp_path, text))["t"].keep_alive_s == seconds


def test_empty_file_has_no_ladders(tmp_path):
    assert load_ladders(write(tmp_path, "# nothing yet\n")) == {}


@pytest.mark.parametrize("text,line,reason", [
    ("[tasks.code]\nmodels = []\n", 2, "tasks.code: models must name at least one model"),
    ("[tasks.code]\npin_primary = true\n", 1, "[tasks.code] needs models = "),
    ("[tasks.code]\nmodels = 'm'\n", 2, "tasks.code.models must be a list of model names"),
    ("[tasks.code]\nmodels = ['a', 3]\n", 2, "models must be non-empty strings, not 3"),
    ("[tasks.code]\nmodels = ['a', 'a']\n", 2, "models lists a model twice"),
    ("[tasks.code]\nmodels = ['a']\npin_primary = 1\n", 3,
     "pin_primary must be true or false, not 1"),
    ("[tasks.code]\nmodels = ['a']\nbudget_s = 0\n", 3,
     "budget_s must be a number of seconds > 0"),
    ("[tasks.code]\nmodels = ['a']\nbudget_s = true\n", 3, "budget_s must be a number"),
    ("[tasks.code]\nmodels = ['a']\nbudget_s = nan\n", 3, "budget_s must be a number"),
    ("[tasks.code]\nmodels = ['a']\nkeep_alive = '10 minutes'\n", 3,
     "tasks.code.keep_alive: invalid duration '10 minutes'"),
    ("[tasks.code]\nmodels = ['a']\nkeep_alive = false\n", 3, "not a boolean"),
    ("[tasks.code]\nmodels = ['a']\nkeep_alive = inf\n", 3, "finite"),
    ("[tasks.code]\nmodels = ['a']\nbudget = 5\n", 3,
     "unknown key 'budget' in [tasks.code] (did you mean 'budget_s'?)"),
    ("[tasks.code]\nmodels = ['a']\n[tasks.code.extra]\n", 3, "unknown table 'extra'"),
    ("[task.code]\nmodels = ['a']\n", 1, "unknown table 'task' (did you mean 'tasks'?)"),
    ("models = ['a']\n", 1, "unknown key 'models' (expected one of: tasks)"),
    ("tasks = ['code']\n", 1, "tasks must be a table"),
    ("[tasks]\ncode = ['a']\n", 2, "tasks.code must be a table"),
    ("[tasks]\ncode = {models = []}\n", 2, "models must name at least one model"),
    ("[tasks.code]\nmodels = ['a'\n", 2, "invalid TOML"),
    ("[tasks.code]\nmodels = ['a']\n[tasks.code]\n", 3, "invalid TOML: Cannot declare"),
])
def test_errors_name_file_line_and_reason(tmp_path, text, line, reason):
    path = write(tmp_path, text)
    with pytest.raises(ConfigFileError) as error:
        load_ladders(path)
    assert (error.value.path, error.value.line) == (path, line)
    assert str(error.value).startswith(f"{path}:{line}: ")
    assert reason in str(error.value)


def test_unreadable_file_has_no_line(tmp_path):
    with pytest.raises(ConfigFileError) as error:
        load_ladders(tmp_path)
    assert error.value.line is None and str(error.value).startswith(f"{tmp_path}: ")


@pytest.mark.parametrize("kwargs", [
    {"models": ()}, {"models": "m"}, {"models": ("",)}, {"name": ""},
    {"pin_primary": "yes"}, {"keep_alive_s": float("inf")}, {"budget_s": -1},
])
def test_ladder_rejects(kwargs):
    with pytest.raises(ValueError):
        Ladder(**{"name": "t", "models": ("m",), **kwargs})


def test_ladder_keeps_a_tuple():
    assert Ladder("t", ["a", "b"]).models == ("a", "b")  # type: ignore[arg-type]


@pytest.mark.parametrize("model,name", [
    ("task:code", "code"), ("task:a:b", "a:b"), ("task:", None), ("qwen2.5:0.5b", None),
    ("code", None), ("mytask:code", None),
])
def test_task_name(model, name):
    assert task_name(model) == name
