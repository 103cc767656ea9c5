"""Which GGUF file of a repository a quantisation tag means, as llama.cpp's -hf picks it:
the file whose name carries the tag (any letter case), Q4_K_M when no tag is given; a model
split into -0000N-of-0000M files is all of its parts."""

from __future__ import annotations

import re
from collections.abc import Iterable

from shoal.catalog.pull.errors import NotOnSource
from shoal.catalog.pull.names import DEFAULT_QUANT

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


def split_parts(file: str, files: Iterable[str]) -> list[str]:
    """file's split parts in order (file alone when it is not split); NotOnSource when a part
    is missing from the repository."""
    match = _SPLIT.match(file)
    if match is None:
        return [file]
    count = int(match["count"])
    parts = [f"{match['stem']}-{index:05d}-of-{match['count']}.gguf"
             for index in range(1, count + 1)]
    missing = sorted(set(parts) - set(files))
    if missing:
        raise NotOnSource(f"{file} is part of a {count}-part GGUF whose parts "
                          f"{', '.join(missing)} are missing")
    return parts


def is_split(file: str) -> bool:
    return _SPLIT.match(file) is not None


def merged_name(first_part: str) -> str:
    """The joined file's name: the first part's without -00001-of-0000M."""
    match = _SPLIT.match(first_part)
    return (f"{match['stem']}.gguf" if match else first_part).rsplit("/", 1)[-1]


def choose_gguf(files: Iterable[str], quant: str | None, repo: str) -> list[str]:
    """The parts of the GGUF model in files that quant (default Q4_K_M) names."""
    names = sorted(files)
    models = [f for f in names if f.lower().endswith(".gguf") and "mmproj" not in f.lower()]
    if not models:
        raise NotOnSource(f"{repo} holds no GGUF file")
    wanted = quant or DEFAULT_QUANT
    tag = re.compile(rf"(^|[-._/]){re.escape(wanted)}([-._/]|$)", re.IGNORECASE)
    matching = [f for f in models if tag.search(f.rsplit("/", 1)[-1])]
    if not matching and quant is None and len(_models(models)) == 1:
        matching = models  # one model, whatever its quantisation: llama.cpp takes it too
    if not matching:
        raise NotOnSource(f"{repo} has no GGUF file for {wanted}; it has: "
                          f"{', '.join(quantisations(models)) or ', '.join(models)}")
    return split_parts(matching[0], names)


def quantisations(files: Iterable[str]) -> list[str]:
    """The quantisation tags found in GGUF file names (for error messages)."""
    found = set()
    for name in files:
        match = re.search(r"(?:^|[-._])((?:UD-)?(?:I?Q\d[A-Z0-9_]*|BF16|F16|F32))(?:[-.]|$)",
                          name.rsplit("/", 1)[-1], re.IGNORECASE)
        if match:
            found.add(match.group(1).upper())
    return sorted(found)


def _models(files: list[str]) -> set[str]:
    """Distinct models among GGUF files (a split model's parts count once)."""
    stems = set()
    for name in files:
        match = _SPLIT.match(name)
        stems.add(match["stem"] if match else name)
    return stems
