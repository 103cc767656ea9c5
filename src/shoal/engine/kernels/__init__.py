"""Compiled CPU kernels (C++ built on this machine by torch's extension tool)."""
