"""The models a node offers, as every dialect lists them: served ones first, then catalogue
models whose weights are on this machine (app.state.list_available)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ListedModel:
    id: str
    state: str  # the runner's state, or "available" for a catalogue model not loaded
    max_model_len: int | None
    entry: Any | None  # the catalogue entry (shoal.catalog.resolve.CatalogEntry), if any
    supervisor: Any | None  # the runner supervisor serving it, if any


def listed_models(state: Any) -> list[ListedModel]:
    """Every model to list, in /v1/models order; state is the FastAPI app's state."""
    available = [entry for entry in state.list_available() if entry.available]
    entries = {entry.id: entry for entry in available}
    listed = []
    for supervisor in state.router.supervisors:
        info = supervisor.model_info
        listed.append(ListedModel(id=supervisor.model_id, state=supervisor.state,
                                  max_model_len=info.max_model_len if info else None,
                                  entry=entries.get(supervisor.model_id),
                                  supervisor=supervisor))
    served = {model.id for model in listed}
    for entry in available:
        if entry.id not in served:
            listed.append(ListedModel(id=entry.id, state="available",
                                      max_model_len=entry.context_length, entry=entry,
                                      supervisor=None))
    return listed


def find_listed(state: Any, name: str) -> ListedModel | None:
    """The listed model a client's name means: its id, a catalogue alias, or a name the
    router has already resolved."""
    key = state.router.canonical_id(name).lower()
    for model in listed_models(state):
        aliases = getattr(model.entry, "aliases", ())
        if key == model.id.lower() or key in (alias.lower() for alias in aliases):
            return model
    return None
