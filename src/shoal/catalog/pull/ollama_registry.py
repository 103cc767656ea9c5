"""Plan a pull from Ollama's registry: the manifest of name:tag
(/v2/<namespace>/<model>/manifests/<tag>) lists layers by media type and sha256 digest, each
fetched from /v2/<namespace>/<model>/blobs/<digest>. The model layer is a GGUF; template,
system prompt and parameters become the model's card."""

from __future__ import annotations

import os
import re

import httpx

from shoal.catalog.pull.download import RemoteFile
from shoal.catalog.pull.errors import NotOnSource, PullError, SourceUnreachable
from shoal.catalog.pull.names import OllamaName
from shoal.catalog.pull.plan import PullPlan

DEFAULT_REGISTRY = "https://registry.ollama.ai"
REGISTRY_ENV = "SHOAL_OLLAMA_REGISTRY"
MANIFEST_MEDIA_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
_LAYER_PREFIX = "application/vnd.ollama.image."
# Layer kind -> file name in the model's directory; "model" is the weights.
LAYER_FILES = {"model": "model.gguf", "template": "template", "system": "system",
               "params": "params.json", "license": "license"}
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def registry(configured: str | None = None) -> str:
    return (configured or os.environ.get(REGISTRY_ENV) or DEFAULT_REGISTRY).rstrip("/")


def plan_ollama(name: OllamaName, client: httpx.Client, base: str) -> PullPlan:
    label = f"pull {name.key!r} from Ollama's registry ({base})"
    repository = f"{base}/v2/{name.namespace}/{name.model}"
    try:
        response = client.get(f"{repository}/manifests/{name.tag}",
                              headers={"Accept": MANIFEST_MEDIA_TYPE})
    except httpx.HTTPError as error:
        raise SourceUnreachable(f"{label}: cannot reach it ({type(error).__name__}: "
                                f"{error})") from error
    if response.status_code == 404:
        raise NotOnSource(f"{label}: the registry has no such model")
    if response.status_code != 200:
        raise SourceUnreachable(f"{label}: the registry answered HTTP {response.status_code}")
    try:
        layers = response.json()["layers"]
        files = [_layer_file(layer, repository) for layer in layers]
    except (ValueError, KeyError, TypeError) as error:
        raise PullError(f"{label}: the registry's manifest is malformed ({error})") from error
    by_kind = {kind: file for kind, file in files if kind in LAYER_FILES}
    if "model" not in by_kind:
        raise PullError(f"{label}: the manifest has no model layer "
                        f"({_LAYER_PREFIX}model); shoal cannot serve adapters or projectors "
                        f"alone")
    return PullPlan(key=name.key, source="ollama", format="gguf",
                    weights=LAYER_FILES["model"], files=tuple(by_kind.values()), headers={},
                    label=label, origin={"registry": base, "manifest": response.json()},
                    card_files={kind: LAYER_FILES[kind] for kind in by_kind if kind != "model"})


def _layer_file(layer: dict, repository: str) -> tuple[str, RemoteFile]:
    media_type, digest, size = layer["mediaType"], layer["digest"], int(layer["size"])
    if not _DIGEST.match(digest) or size < 0:
        raise ValueError(f"layer digest {digest!r} or size {size!r}")
    kind = media_type.removeprefix(_LAYER_PREFIX) if media_type.startswith(_LAYER_PREFIX) else ""
    path = LAYER_FILES.get(kind, f"blobs/{digest.replace(':', '-')}")
    return kind, RemoteFile(url=f"{repository}/blobs/{digest}", path=path, size=size,
                            digest=digest, sha256=digest.removeprefix("sha256:"))
