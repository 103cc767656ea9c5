"""Fixtures of the router tests: the fake model sources of the in-memory pool."""

from memory_pool import sources  # noqa: F401 - the fixture, for every test module here
