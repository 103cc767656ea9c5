"""--clients files: tiers and clients load to the right values; every mistake is a
ConfigFileError naming the file, the line and the reason; Tier.clamp and tier_of."""

from __future__ import annotations

import pytest

from shoal.config_file import ConfigFileError, line_of
from shoal.pool.clients import ClientTiers, Tier, load_clients

EXAMPLE = """\
default_tier = "free"   # unlisted clients

[tiers.free]
max_concurrent = 2
max_queued = 8
priority = [5, 9]

[tiers.pro]
max_concurrent = 16
priority = [0, 9]

[clients]
alice = "pro"
bob = "free"
"""


def write(tmp_path, text):
    path = tmp_path / "clients.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_example_loads(tmp_path):
    tiers = load_clients(write(tmp_path, EXAMPLE))
    assert tiers.tiers == {"free": Tier("free", 2, 8, 5, 9), "pro": Tier("pro", 16, None, 0, 9)}
    assert tiers.clients == {"alice": "pro", "bob": "free"}
    assert tiers.default_tier == "free"


@pytest.mark.parametrize("text,expected", [
    ("", ClientTiers({}, {})),
    ("[tiers.a]\n", ClientTiers({"a": Tier("a")}, {})),
    ("tiers = {a = {max_queued = 1}}\nclients = {'x y' = 'a'}\n",
     ClientTiers({"a": Tier("a", max_queued=1)}, {"x y": "a"})),
])
def test_minimal_files(tmp_path, text, expected):
    assert load_clients(write(tmp_path, text)) == expected


@pytest.mark.parametrize("text,line,reason", [
    ("[tiers.free]\nmax_concurent = 2\n", 2,
     "unknown key 'max_concurent' in [tiers.free] (did you mean 'max_concurrent'?)"),
    ("default_tier = 'a'\n[tier.a]\n", 2, "unknown table 'tier' (did you mean 'tiers'?)"),
    ("[limits]\nx = 1\n", 1, "unknown table 'limits' (expected one of: clients, "),
    ("[tiers.a]\nmax_concurrent = true\n", 2,
     "max_concurrent must be an integer >= 1, not True"),
    ("[tiers.a]\n\nmax_queued = 0\n", 3, "max_queued must be an integer >= 1, not 0"),
    ("[tiers.a]\nmax_queued = 1.5\n", 2, "max_queued must be an integer >= 1"),
    ("[tiers.a]\npriority = [3, 10]\n", 2, "0 <= min <= max <= 9, not [3, 10]"),
    ("[tiers.a]\npriority = [5, 2]\n", 2, "not [5, 2]"),
    ("[tiers.a]\npriority = [-1, 2]\n", 2, "not [-1, 2]"),
    ("[tiers.a]\npriority = 5\n", 2, "priority must be [min, max]"),
    ("[tiers.a]\npriority = [false, 9]\n", 2, "not [False, 9]"),
    ("[tiers.a]\n[clients]\nalice = 'a'\nbob = 'gold'\n", 4,
     "client 'bob' is in tier 'gold', which is not defined (tiers: a)"),
    ("[clients]\nbob = 3\n", 2, "clients.bob must be a tier name (a string), not 3"),
    ("default_tier = 'gold'\n[tiers.a]\n", 1, "default_tier 'gold' is not defined (tiers: a)"),
    ("\ndefault_tier = 'gold'\n", 2, "not defined (no [tiers.NAME] tables)"),
    ("default_tier = 1\n", 1, "default_tier must be a tier name (a string), not 1"),
    ("tiers = 3\n", 1, "tiers must be a table, not 3"),
    ("[tiers]\na = 3\n", 2, "tiers.a must be a table, not 3"),
    ("[tiers]\na = {max_queued = 0}\n", 2, "max_queued must be an integer >= 1"),
    ("[tiers.a]\nmax_queued = 1\nmax_queued = 2\n", 3,
     "invalid TOML: Cannot overwrite a value (column"),
    ("[tiers.a]\nmax_queued = \n", 2, "invalid TOML: Invalid value"),
    ("[tiers.a]\npriority = [1,\n", 2, "invalid TOML: Invalid value (at end of document)"),
])
def test_errors_name_file_line_and_reason(tmp_path, text, line, reason):
    path = write(tmp_path, text)
    with pytest.raises(ConfigFileError) as error:
        load_clients(path)
    assert (error.value.path, error.value.line) == (path, line)
    assert str(error.value).startswith(f"{path}:{line}: ")
    assert reason in str(error.value)


def test_unreadable_file_has_no_line(tmp_path):
    missing = tmp_path / "missing.toml"
    with pytest.raises(ConfigFileError) as error:
        load_clients(missing)
    assert error.value.line is None
    assert str(error.value) == f"{missing}: cannot read the file: No such file or directory"
    (tmp_path / "latin1.toml").write_bytes(b"a = '\xe9'\n")
    with pytest.raises(ConfigFileError, match="cannot read the file"):
        load_clients(tmp_path / "latin1.toml")


@pytest.mark.parametrize("key_path,line", [
    (("default_tier",), 1), (("tiers", "free"), 3), (("tiers", "free", "priority"), 6),
    (("tiers", "pro", "priority"), 10), (("tiers",), 3), (("clients", "bob"), 14),
    (("tiers", "gold"), None),
])
def test_line_of(key_path, line):
    assert line_of(EXAMPLE, key_path) == line


@pytest.mark.parametrize("asked,given", [(0, 5), (4, 5), (5, 5), (7, 7), (9, 9), (12, 9)])
def test_clamp(asked, given):
    assert Tier("free", priority_min=5, priority_max=9).clamp(asked) == given
    assert Tier("any").clamp(min(asked, 9)) == min(asked, 9)


@pytest.mark.parametrize("default_tier,client_id,tier", [
    ("free", "alice", "pro"), ("free", "bob", "free"), ("free", "carol", "free"),
    ("free", None, "free"), (None, "alice", "pro"), (None, "carol", None), (None, None, None),
])
def test_tier_of(default_tier, client_id, tier):
    tiers = ClientTiers({"free": Tier("free", 2), "pro": Tier("pro", 16)},
                        {"alice": "pro", "bob": "free"}, default_tier)
    found = tiers.tier_of(client_id)
    assert (found.name if found else None) == tier


@pytest.mark.parametrize("kwargs", [
    {"max_concurrent": 0}, {"max_queued": True}, {"priority_min": 4, "priority_max": 3},
    {"priority_max": 10}, {"name": ""},
])
def test_tier_rejects(kwargs):
    with pytest.raises(ValueError):
        Tier(**{"name": "t", **kwargs})


def test_client_tiers_are_read_only():
    clients = {"alice": "a"}
    tiers = ClientTiers({"a": Tier("a")}, clients)
    clients["alice"] = "b"
    assert tiers.clients["alice"] == "a"
    with pytest.raises(TypeError):
        tiers.clients["bob"] = "a"  # type: ignore[index]
