"""Ollama's `options`, `keep_alive` and `format` fields, turned into shoal's internal ones.

options are handled in three groups, so clients that send many of them (chat front-ends keep
a whole settings panel) work unchanged, and nothing that changes the output is dropped:
  honoured       temperature, top_p, top_k, min_p, seed, num_predict, stop, repeat_penalty,
                 presence_penalty, frequency_penalty
  no effect      how a model is loaded and run (num_ctx, num_batch, num_gpu, num_thread, ...):
                 shoal sizes contexts, batches and threads itself, so these are accepted and
                 change nothing; repeat_last_n likewise (shoal's penalties see the whole
                 sequence), except that 0 turns the penalties off as in Ollama
  rejected       sampling methods shoal lacks (typical_p, tfs_z, mirostat): 400 unless set to
                 the value that disables them
Unknown option names are logged and ignored, as Ollama does.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from shoal.api.errors import APIError, invalid_parameter
from shoal.api.sampling import stop_strings
from shoal.durations import parse_duration_s
from shoal.protocol import ResponseFormat

log = logging.getLogger("shoal.api.ollama")

# SamplingParams field -> the option's name in a client's request, for error messages.
OPTION_NAMES = {
    "temperature": "options.temperature", "top_p": "options.top_p", "top_k": "options.top_k",
    "min_p": "options.min_p", "seed": "options.seed", "max_tokens": "options.num_predict",
    "stop": "options.stop", "repetition_penalty": "options.repeat_penalty",
    "presence_penalty": "options.presence_penalty",
    "frequency_penalty": "options.frequency_penalty",
}

# Sampling methods shoal does not implement, with the value at which each is off.
_NEUTRAL = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0}


class Options(BaseModel):
    model_config = ConfigDict(extra="allow")

    # honoured
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None
    stop: str | list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # accepted, no effect (see the module docstring)
    num_ctx: int | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    num_thread: int | None = None
    num_keep: int | None = None
    repeat_last_n: int | None = None
    numa: bool | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    penalize_newline: bool | None = None
    mirostat_tau: float | None = None  # only read when mirostat is on
    mirostat_eta: float | None = None
    # rejected unless neutral
    typical_p: float | None = None
    tfs_z: float | None = None
    mirostat: int | None = None


def sampling_values(raw: dict[str, Any] | None) -> dict[str, Any]:
    """SamplingParams keyword values from Ollama options (None where the option is unset)."""
    try:
        options = Options.model_validate(raw or {})
    except ValidationError as error:
        first = error.errors()[0]
        name = ".".join(str(part) for part in first["loc"])
        raise invalid_parameter(f"options.{name}", f"invalid options.{name}: "
                                                   f"{first['msg']}") from None
    if options.model_extra:
        log.warning("ignoring unknown Ollama options: %s", ", ".join(sorted(options.model_extra)))
    for name, neutral in _NEUTRAL.items():
        value = getattr(options, name)
        if value is not None and value != neutral:
            raise invalid_parameter(f"options.{name}", f"options.{name} is not supported "
                                                       f"(leave it unset or {neutral})")
    penalties_off = options.repeat_last_n == 0
    return {
        "temperature": options.temperature, "top_p": options.top_p, "top_k": options.top_k,
        "min_p": options.min_p,
        "seed": None if options.seed is None or options.seed < 0 else options.seed,
        "max_tokens": _max_tokens(options.num_predict),
        "stop": stop_strings(options.stop) or None,
        "repetition_penalty": None if penalties_off else options.repeat_penalty,
        "presence_penalty": None if penalties_off else options.presence_penalty,
        "frequency_penalty": None if penalties_off else options.frequency_penalty,
    }


def _max_tokens(num_predict: int | None) -> int | None:
    # -1: no limit; -2: until the context is full. Both are "no limit" to shoal.
    if num_predict is None or num_predict in (-1, -2):
        return None
    if num_predict < 1:
        raise invalid_parameter("options.num_predict", "options.num_predict must be >= 1, or "
                                                       "-1 / -2 for no limit")
    return num_predict


# ---- keep_alive -----------------------------------------------------------------------------

def keep_alive_seconds(raw: float | str | None) -> float | None:
    """Seconds to keep the model loaded: None (server default), 0 (unload when idle) or
    -1 (forever, for any negative value). Accepts seconds as a number, or a duration string
    like "5m", "1h30m", "-1s" (Go's time.ParseDuration syntax), or "300"."""
    if raw is None:
        return None
    try:
        seconds = parse_duration_s(raw)
    except ValueError:
        raise _bad_keep_alive(raw.strip() if isinstance(raw, str) else raw) from None
    return -1.0 if seconds < 0 else seconds


def _bad_keep_alive(raw: Any) -> APIError:
    return invalid_parameter("keep_alive", f"keep_alive must be a number of seconds or a "
                                           f"duration like \"5m\" or \"1h30m\", not {raw!r}")


# ---- format ---------------------------------------------------------------------------------

def response_format(raw: str | dict[str, Any] | None) -> ResponseFormat | None:
    """"json" -> any JSON object; a dict -> JSON valid under that schema; "" / None -> text."""
    if raw is None or raw == "":
        return None
    if raw == "json":
        return ResponseFormat(type="json_object")
    if isinstance(raw, dict):
        return ResponseFormat(type="json_schema", json_schema=raw)
    raise invalid_parameter("format", f'format must be "json" or a JSON schema object, '
                                      f"not {raw!r}")
