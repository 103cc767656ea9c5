"""Distinct id types, so a node id is never passed where an instance id belongs.

Each is a NewType over str: free at runtime, checked by type checkers, and plain strings on
the wire (pydantic validates them as str). Generated ids are a short prefix naming the kind
plus 16 random hex digits (64 bits), unique enough for one cluster's lifetime and readable in
logs and `GET /cluster`.
"""

from __future__ import annotations

import uuid
from typing import NewType

NodeId = NewType("NodeId", str)
ModelId = NewType("ModelId", str)
InstanceId = NewType("InstanceId", str)
RunnerId = NewType("RunnerId", str)
CommandId = NewType("CommandId", str)
RequestId = NewType("RequestId", str)


def _random(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def new_node_id() -> NodeId:
    return NodeId(_random("node"))


def new_instance_id() -> InstanceId:
    return InstanceId(_random("inst"))


def new_command_id() -> CommandId:
    return CommandId(_random("cmd"))


def new_request_id() -> RequestId:
    return RequestId(_random("req"))


def runner_id_for(instance_id: InstanceId, rank: int) -> RunnerId:
    """The runner serving one rank of an instance: derived, so every node agrees on it."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0, not {rank}")
    return RunnerId(f"{instance_id}.r{rank}")
