"""Runner messages for prefix KV between nodes (cluster/prefix_share.py drives them).

A runner reports what its prefix cache gained and lost (PrefixReport, batched). A runner
whose new request lacks prefix blocks asks for them (PrefixWanted) and holds the request
until its supervisor has passed on what arrived (PrefixPart, each imported at once) and says
the fetch is over (PrefixFetched), which it always does within a bound. A holder's runner
answers PrefixExport with its blocks in parts (PrefixExportPart). Hashes and KV travel as
bytes: these messages are dumped in Python mode, not JSON mode.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class RunnerMessage(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PrefixMessage(RunnerMessage):
    """A message whose fields keep their bytes on the wire."""


class PrefixReport(PrefixMessage):
    """Prefix cache changes since the last report. compat: what another instance must
    match to exchange blocks with this one (prefix_compat.py)."""

    type: Literal["prefix_report"] = "prefix_report"
    compat: str
    stored: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()
    anchors: tuple[tuple[bytes, bytes], ...] = ()  # (routing key, block hash)
    sessions: tuple[bytes, ...] = ()


class PrefixWanted(PrefixMessage):
    """Request request_id holds its first have_blocks blocks here and would like the rest
    of block_hashes (its prompt's full blocks; token_ids are the tokens they cover)."""

    type: Literal["prefix_wanted"] = "prefix_wanted"
    request_id: str
    compat: str
    block_hashes: tuple[bytes, ...]
    have_blocks: int
    token_ids: tuple[int, ...]


class PrefixPart(PrefixMessage):
    """Blocks fetched for request_id (kv_wire.py's form), to import now."""

    type: Literal["prefix_part"] = "prefix_part"
    request_id: str
    blocks: dict[str, Any]


class PrefixFetched(PrefixMessage):
    """The fetch for request_id is over (outcome: "complete" or why not): admit it."""

    type: Literal["prefix_fetched"] = "prefix_fetched"
    request_id: str
    outcome: str = "complete"


class PrefixExport(PrefixMessage):
    """Send the cached blocks of token_ids from block start_block on, in parts."""

    type: Literal["prefix_export"] = "prefix_export"
    export_id: str
    compat: str
    token_ids: tuple[int, ...]
    start_block: int = 0


class PrefixExportPart(PrefixMessage):
    """Part seq of export export_id; last ends it (blocks None with error: nothing to send)."""

    type: Literal["prefix_export_part"] = "prefix_export_part"
    export_id: str
    seq: int
    last: bool
    blocks: dict[str, Any] | None = None
    error: str | None = None
