"""Which backend serves a model: decided once, where its placement is asked for.

Asked for (POST /instances "backend"), else assigned (--backend MODEL=NAME), else the
catalogue card's, else shoal's engine where it runs the architecture, else llama-server
where some node runs it. A choice that cannot run the model is a clear error naming why.
"""

from __future__ import annotations

from collections.abc import Collection

from shoal.backend_names import DEFAULT_BACKEND, BackendName
from shoal.cluster.model_facts import ModelFacts
from shoal.engine.models.registry import find_family

LLAMA_SERVER: BackendName = "llama-server"


class BackendChoiceError(ValueError):
    """No backend can serve the model as asked; the message says why."""


def engine_runs(facts: ModelFacts) -> bool:
    """Whether shoal's engine knows the model's architecture (unknown facts: assume so, the
    load says otherwise)."""
    return not facts.architecture or find_family(facts.architecture) is not None


def choose_backend(facts: ModelFacts, weight_format: str, chosen: BackendName | None,
                   running: Collection[str]) -> BackendName:
    """The backend for a model. chosen: the first of the request's, the node's --backend
    and the card's that is set; running: the backends some node runs."""
    model, architecture = facts.model, facts.architecture or "unknown"
    if chosen is not None:
        if chosen == DEFAULT_BACKEND and not engine_runs(facts):
            raise BackendChoiceError(f"model {model!r} ({architecture}) cannot run on shoal's "
                                     f"engine, which does not support that architecture")
        if chosen == LLAMA_SERVER and weight_format != "gguf":
            raise BackendChoiceError(f"model {model!r} cannot be served by llama-server, "
                                     f"which loads GGUF files only")
        if chosen not in (DEFAULT_BACKEND, LLAMA_SERVER):
            raise BackendChoiceError(f"model {model!r} is a text model; {chosen} serves "
                                     f"image pipelines")
        return chosen
    if engine_runs(facts):
        return DEFAULT_BACKEND
    if weight_format == "gguf" and LLAMA_SERVER in running:
        return LLAMA_SERVER
    why = ("no node runs llama-server (put it on PATH or start shoal serve with "
           "--llama-server PATH)" if weight_format == "gguf" else
           "llama-server loads GGUF files only")
    raise BackendChoiceError(f"model {model!r} has architecture {architecture!r}: shoal's "
                             f"engine does not support it, and {why}")
