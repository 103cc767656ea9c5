"""Which instance serves a request, and getting it there (router.py): what a request's
model name names (naming.py), fallback ladders of task names (ladders.py), choosing a live
instance (chooser.py), placing one on demand (placer.py) after making room (room.py),
cancelling a request by id (cancellable.py) and where a request's time went (clock.py).
It sits above the cluster; the pool below the cluster is policy over this node's runners."""

from shoal.router.router import ModelUnavailable, Router, WrongModelTask

__all__ = ["ModelUnavailable", "Router", "WrongModelTask"]
