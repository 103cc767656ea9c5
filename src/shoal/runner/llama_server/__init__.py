"""llama.cpp's llama-server as a runner: found and probed (binary.py), launched
(launch.py), supervised (supervisor.py), spoken to over its OpenAI-compatible HTTP API
(request_body.py out, events.py back)."""
