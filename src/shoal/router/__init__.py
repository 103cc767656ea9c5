"""Which instance serves a request, and getting it there (router.py): choosing a live
instance (chooser.py), placing one on demand (placer.py) after making room (room.py),
fallback ladders of task names (ladders.py), cancelling a request by id (cancellable.py)
and where a request's time went (clock.py). Sits above the cluster; the pool below it is
policy over this node's runners."""

from shoal.router.router import ModelUnavailable, Router, WrongModelTask

__all__ = ["ModelUnavailable", "Router", "WrongModelTask"]
