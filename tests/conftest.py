"""Shared by every test directory: tests/ is on sys.path (fakes.py, serve_process.py)."""
