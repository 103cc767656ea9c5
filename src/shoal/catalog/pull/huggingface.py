"""Plan a pull from Hugging Face: which files of a repository, their sizes and hashes, from
the repository's file listing (huggingface_hub's model_info with files_metadata), at one
commit so the files agree. HF_TOKEN and HF_ENDPOINT are honoured (read at each pull)."""

from __future__ import annotations

import os
from collections.abc import Iterable

import httpx2  # huggingface_hub's HTTP client (its errors are this package's)
from huggingface_hub import HfApi, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers

from shoal.catalog.pull.download import RemoteFile
from shoal.catalog.pull.errors import NotOnSource, PullError, SourceUnreachable
from shoal.catalog.pull.gguf_files import choose_gguf, is_split, split_parts
from shoal.catalog.pull.names import DEFAULT_QUANT, HuggingFaceName
from shoal.catalog.pull.plan import PullPlan

DEFAULT_ENDPOINT = "https://huggingface.co"
# What a safetensors checkpoint needs: config, tokenizer, weights (top level only; no .bin,
# ONNX or other exports).
_CHECKPOINT_SUFFIXES = (".json", ".safetensors", ".model", ".txt", ".jinja", ".tiktoken")


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def plan_huggingface(name: HuggingFaceName, timeout_s: float) -> PullPlan:
    base = endpoint()
    label = f"pull {name.key!r} from Hugging Face ({base})"
    token = os.environ.get("HF_TOKEN") or None
    try:
        info = HfApi(endpoint=base, token=token).model_info(
            name.repo, files_metadata=True, timeout=timeout_s)
    except GatedRepoError as error:
        raise PullError(f"{label}: the repository is gated; accept its terms on the Hub and "
                        f"set HF_TOKEN") from error
    except (RepositoryNotFoundError, RevisionNotFoundError) as error:
        raise NotOnSource(f"{label}: no such repository (a private one needs HF_TOKEN)"
                          ) from error
    except OfflineModeIsEnabled as error:
        raise SourceUnreachable(f"{label}: HF_HUB_OFFLINE is set") from error
    except HfHubHTTPError as error:
        raise SourceUnreachable(f"{label}: the Hub answered {error}") from error
    except (httpx2.HTTPError, OSError) as error:
        raise SourceUnreachable(f"{label}: cannot reach it ({type(error).__name__}: "
                                f"{error})") from error
    siblings = {s.rfilename: s for s in info.siblings or ()}
    key, weights_format, chosen = _choose(name, siblings, label)
    gguf_format = weights_format == "gguf"
    headers = build_hf_headers(token=token)
    files = tuple(_remote(base, name.repo, info.sha or "main", siblings[f], label)
                  for f in chosen)
    split = tuple(chosen) if gguf_format and len(chosen) > 1 and is_split(chosen[0]) else ()
    return PullPlan(key=key, source="huggingface", format=weights_format,
                    weights=chosen[0] if gguf_format else ".", files=files,
                    headers=headers, label=label, split_parts=split,
                    origin={"repo": name.repo, "revision": info.sha, "endpoint": base})


def _choose(name: HuggingFaceName, siblings: dict, label: str) -> tuple[str, str, list[str]]:
    """(store key, weights format, files to fetch) for name among the repository's files."""
    try:
        if name.file:
            if name.file not in siblings:
                raise NotOnSource(f"the repository has no file {name.file}")
            return name.key, "gguf", split_parts(name.file, siblings)
        if name.quant:
            return name.key, "gguf", choose_gguf(siblings, name.quant, name.repo)
        if "model_index.json" in siblings:
            return name.key, "diffusers", diffusers_pipeline_files(siblings)
        checkpoint = sorted(f for f in siblings
                            if "/" not in f and f.endswith(_CHECKPOINT_SUFFIXES))
        if "config.json" in checkpoint and any(f.endswith(".safetensors") for f in checkpoint):
            return name.key, "safetensors", checkpoint
        if not any(f.lower().endswith(".gguf") for f in siblings):
            raise NotOnSource("it holds neither a safetensors checkpoint (config.json and "
                              "*.safetensors), a diffusers pipeline (model_index.json) nor a "
                              "GGUF file; shoal reads no other weights")
        parts = choose_gguf(siblings, None, name.repo)
        quant = DEFAULT_QUANT if DEFAULT_QUANT.lower() in parts[0].lower() else None
        return (f"{name.repo}:{quant}" if quant else f"{name.repo}/{parts[0]}"), "gguf", parts
    except NotOnSource as error:
        raise NotOnSource(f"{label}: {error}") from None


def diffusers_pipeline_files(names: Iterable[str]) -> list[str]:
    """What a diffusers pipeline needs of a repository: model_index.json and, in each
    component's folder, its configs, tokenizer files and safetensors weights, the plain ones
    where a folder also holds variants (diffusion_pytorch_model.fp16.safetensors)."""
    names = set(names)
    chosen = ["model_index.json"]
    for path in sorted(names):
        folder, _, file = path.rpartition("/")
        if not folder or "/" in folder or not file.endswith(_CHECKPOINT_SUFFIXES):
            continue
        if file.endswith(".safetensors") and file.count(".") > 1:  # a variant: name.fp16.ext
            stem = file.split(".", 1)[0]
            if f"{folder}/{stem}.safetensors" in names or any(
                    n.startswith(f"{folder}/{stem}-") for n in names):
                continue
        chosen.append(path)
    if not any(n.endswith(".safetensors") for n in chosen):
        raise NotOnSource("its diffusers pipeline has no safetensors weights; shoal reads no "
                          "other weights")
    return chosen


def _remote(base: str, repo: str, revision: str, sibling, label: str) -> RemoteFile:
    if sibling.size is None:
        raise PullError(f"{label}: the Hub gave no size for {sibling.rfilename}")
    lfs = sibling.lfs
    sha256 = lfs.sha256 if lfs is not None else None
    return RemoteFile(url=hf_hub_url(repo, sibling.rfilename, revision=revision, endpoint=base),
                      path=sibling.rfilename, size=int(sibling.size),
                      digest=f"sha256:{sha256}" if sha256 else f"git:{sibling.blob_id}",
                      sha256=sha256, git_sha1=None if lfs is not None else sibling.blob_id)
