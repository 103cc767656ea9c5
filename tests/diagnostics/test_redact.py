"""Secrets never show in a diagnosis: fields named like credentials are replaced, and known
secret values are cut out of any text; everything else stays as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shoal.config import ClusterSettings, NodeConfig, ServerConfig
from shoal.diagnostics.redact import REDACTED, is_sensitive, redact


@pytest.mark.parametrize("name", ["api_keys", "api_key", "apiKey", "SHOAL_API_KEY", "secret",
                                  "cluster_secret", "access-token", "password", "AUTH",
                                  "OTEL_EXPORTER_OTLP_HEADERS", "db.password"])
def test_credential_names_are_sensitive(name):
    assert is_sensitive(name)


@pytest.mark.parametrize("name", ["max_num_batched_tokens", "keep_alive_s", "tokenizer",
                                  "monkey", "keepalive_s", "host", "max_tokens"])
def test_other_names_are_not(name):
    assert not is_sensitive(name)


def test_a_node_configuration_keeps_its_settings_but_not_its_secrets():
    config = NodeConfig(server=ServerConfig(port=9, api_keys=("sk-one", "sk-two")),
                        data_dir=Path("/tmp/d"),
                        cluster=ClusterSettings(secret="hush", name="node-sk-one"))
    shown = redact({"settings": config, "note": "keys sk-one and hush", "empty_key": ""},
                   secrets=("sk-one", "sk-two", "hush", ""))
    text = json.dumps(shown)
    assert "sk-one" not in text and "sk-two" not in text and "hush" not in text
    assert shown["settings"]["server"]["api_keys"] == REDACTED
    assert shown["settings"]["cluster"]["secret"] == REDACTED
    assert shown["settings"]["cluster"]["name"] == f"node-{REDACTED}"
    assert shown["note"] == f"keys {REDACTED} and {REDACTED}"
    assert shown["empty_key"] == ""  # nothing to hide
    assert shown["settings"]["server"]["port"] == 9
    assert shown["settings"]["data_dir"] == "/tmp/d"
    assert shown["settings"]["pool"]["queue"]["max_queue"] >= 1
