"""Sentence pooling: per-token hidden states -> one vector per input, as the checkpoint's
sentence-transformers files (modules.json, <pooling dir>/config.json,
sentence_bert_config.json) say. Without them: mean pooling, no normalisation."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from shoal.engine.errors import UnsupportedModel

PoolingMode = Literal["mean", "cls", "max", "mean_sqrt_len", "last_token"]
_MODE_KEYS: dict[str, PoolingMode] = {
    "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "last_token",
}
# Module types (last dotted part) shoal runs; anything else would change the vectors.
_KNOWN_MODULES = {"Transformer", "Pooling", "Normalize"}


@dataclass(frozen=True)
class PoolingConfig:
    mode: PoolingMode = "mean"
    normalize: bool = False
    # Longest input the model was trained on (sentence_bert_config.json); None: unknown.
    max_seq_length: int | None = None


def read_pooling_config(directory: Path) -> PoolingConfig:
    """The pooling of a sentence-transformers directory; UnsupportedModel for modules shoal
    cannot run (a Dense projection, several pooling modes at once)."""
    directory = Path(directory)
    modules = _read_json(directory / "modules.json")
    max_seq_length = _read_json(directory / "sentence_bert_config.json").get("max_seq_length")
    if not isinstance(max_seq_length, int) or max_seq_length < 1:
        max_seq_length = None
    if not isinstance(modules, list) or not modules:
        return PoolingConfig(max_seq_length=max_seq_length)
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    unknown = sorted(set(kinds) - _KNOWN_MODULES)
    if unknown:
        raise UnsupportedModel(f"{directory}: sentence-transformers modules {unknown} are "
                               f"not supported (only Transformer, Pooling, Normalize)")
    mode: PoolingMode = "mean"
    if "Pooling" in kinds:
        pooling = _read_json(directory / str(kinds["Pooling"].get("path", "")) / "config.json")
        mode = _pooling_mode(pooling, directory)
    return PoolingConfig(mode=mode, normalize="Normalize" in kinds,
                         max_seq_length=max_seq_length)


def _pooling_mode(pooling: dict[str, Any], directory: Path) -> PoolingMode:
    if "pooling_mode" in pooling and isinstance(pooling["pooling_mode"], str):
        named = {"mean": "mean", "cls": "cls", "max": "max", "lasttoken": "last_token",
                 "mean_sqrt_len_tokens": "mean_sqrt_len"}.get(pooling["pooling_mode"])
        if named is None:
            raise UnsupportedModel(f"{directory}: pooling {pooling['pooling_mode']!r} "
                                   f"is not supported")
        return named  # type: ignore[return-value]
    modes = [mode for key, mode in _MODE_KEYS.items() if pooling.get(key)]
    unsupported = [key for key, value in pooling.items()
                   if key.startswith("pooling_mode_") and value and key not in _MODE_KEYS]
    if unsupported or len(modes) > 1:
        raise UnsupportedModel(f"{directory}: pooling {unsupported or modes} is not supported "
                               f"(exactly one of {sorted(set(_MODE_KEYS.values()))})")
    return modes[0] if modes else "mean"


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise UnsupportedModel(f"cannot read {path}: {error}") from error


def pool(hidden: torch.Tensor, mask: torch.Tensor, config: PoolingConfig) -> torch.Tensor:
    """hidden: [B, T, H] (any float dtype), mask: [B, T] bool (True on real tokens, padding
    on the right) -> [B, H] float32, L2-normalised when the config says so."""
    hidden = hidden.float()
    weights = mask.unsqueeze(-1).float()  # [B, T, 1]
    counts = weights.sum(dim=1).clamp(min=1.0)  # [B, 1]
    if config.mode == "cls":
        pooled = hidden[:, 0]
    elif config.mode == "last_token":
        last = mask.long().sum(dim=1) - 1  # [B] index of each row's last real token
        pooled = hidden[torch.arange(hidden.shape[0]), last]
    elif config.mode == "max":
        pooled = hidden.masked_fill(~mask.unsqueeze(-1), float("-inf")).amax(dim=1)
    else:
        summed = (hidden * weights).sum(dim=1)
        pooled = summed / (counts.sqrt() if config.mode == "mean_sqrt_len" else counts)
    return F.normalize(pooled, p=2.0, dim=-1) if config.normalize else pooled
