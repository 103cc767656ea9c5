"""An expected failure is one line, `shoal: error: ...`, and a non-zero exit; --debug adds
the traceback; a bug keeps its traceback."""

from __future__ import annotations

import pytest
from serve_process import free_port

from shoal.cli.app import main


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("shoal: error: ")]


@pytest.fixture
def no_node_here(monkeypatch, tmp_path):
    """`shoal run` finds no node at SHOAL_HOST / SHOAL_PORT and starts its own."""
    monkeypatch.setenv("SHOAL_HOST", "127.0.0.1")
    monkeypatch.setenv("SHOAL_PORT", str(free_port()))
    monkeypatch.setenv("SHOAL_DATA_DIR", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("model, message", [
    # A name that could be pulled is pulled first (tests send pulls to a closed port).
    ("no-such-model", "pull 'no-such-model:latest' from Ollama's registry"),
    ("no/such/model", "model 'no/such/model' not found"),
    ("broken.gguf", "is not a GGUF file"),
])
def test_a_model_that_cannot_load_is_one_line_and_exit_1(no_node_here, capsys, model, message):
    (no_node_here / "broken.gguf").write_text("not a model")
    name = str(no_node_here / model) if model.endswith(".gguf") else model
    assert main(["run", name, "hello"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    [line] = error_lines(err)
    assert message in line


def test_an_unreachable_node_is_one_line_and_exit_1(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    for command in (["ps"], ["cluster"], ["diagnose"], ["pull", "smollm2"], ["run", "m", "hi"]):
        assert main([*command, "--url", url]) == 1, command
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert error_lines(err) == err.splitlines()
        assert err.startswith(f"shoal: error: no shoal node answers at {url} (")


def test_debug_shows_the_traceback_before_the_line(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    for argv in (["--debug", "ps", "--url", url], ["ps", "--url", url, "--debug"]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("Traceback (most recent call last):")
        assert "httpx.ConnectError" in err
        assert err.splitlines()[-1].startswith("shoal: error: no shoal node answers")


def test_a_bad_flag_value_still_exits_2_with_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--threads", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: shoal") and "Traceback" not in err


def test_a_bug_keeps_its_traceback(monkeypatch):
    def broken(_url):
        raise KeyError("nodes")

    monkeypatch.setattr("shoal.cli.cluster.fetch_cluster", broken)
    with pytest.raises(KeyError):
        main(["ps"])
