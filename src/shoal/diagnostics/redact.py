"""Secrets out of what a diagnosis shows: any field whose name has a word such as key,
secret, token or password in it is replaced, whatever its value; and any text that holds a
known secret value (an API key, the cluster secret) has it replaced, wherever it appears.

Names are split into words at _ - . and case changes: `api_keys`, `cluster_secret`,
`OTEL_EXPORTER_OTLP_HEADERS` are redacted, `max_num_batched_tokens` is not ("tokens", the
plural, counts text; it names no credential).
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterable, Mapping
from pathlib import PurePath
from typing import Any

REDACTED = "[redacted]"
SENSITIVE_WORDS = frozenset({
    "key", "keys", "apikey", "secret", "secrets", "token", "password", "passwd",
    "passphrase", "credential", "credentials", "auth", "authorization", "cookie", "headers",
})
_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")


def is_sensitive(name: str) -> bool:
    """Whether a field or variable called name may hold a secret."""
    return any(word.lower() in SENSITIVE_WORDS for word in _WORD.findall(str(name)))


def redact(value: Any, secrets: Iterable[str] = ()) -> Any:
    """value as plain JSON-able data (dataclasses, enums and paths converted), with
    sensitive fields and known secret values replaced by REDACTED."""
    known = tuple(sorted({s for s in secrets if s}, key=len, reverse=True))
    return _redact(value, known)


def _redact(value: Any, secrets: tuple[str, ...]) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(name): REDACTED if is_sensitive(str(name)) and _present(item)
                else _redact(item, secrets) for name, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_redact(item, secrets) for item in value]
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, PurePath):
        value = str(value)
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, REDACTED)
        return value
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return _redact(str(value), secrets)


def _present(value: Any) -> bool:
    """An empty value hides nothing: it stays visible (no key set is worth knowing)."""
    return value not in (None, "", (), [], {})
