#!/usr/bin/env python3
"""A stand-in for llama.cpp's llama-server, enough for LlamaServerSupervisor's tests: it
takes llama-server's flags (only --port and --alias matter; --version and --list-devices
answer as a CPU build), answers /health, /props and
/v1/models, and streams /completion as llama-server does: a prompt-progress event, one
event per token ("w0 ", "w1 ", ...; token ids 0, 1, ...), then the last with the counts.
A prompt containing SLOW streams a token every 0.2 s."""

import argparse
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _json(self, body, status=200):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self._json({"status": "ok"})
        elif self.path == "/props":
            self._json({"default_generation_settings": {"n_ctx": 512}, "chat_template": "x"})
        elif self.path == "/v1/models":
            self._json({"data": [{"id": self.server.alias, "meta": {"n_vocab": 100}}]})
        else:
            self._json({"error": {"code": 404, "message": "no such route"}}, 404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if self.path != "/completion":
            self._json({"error": {"code": 404, "message": "no such route"}}, 404)
            return
        prompt = body["prompt"]
        if "TOOLONG" in prompt:
            self._json({"error": {"code": 400, "message": "the prompt is too long",
                                  "type": "exceed_context_size_error"}}, 400)
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        prompt_tokens = len(prompt.split())
        events = [{"content": "", "tokens": [], "stop": False,
                   "prompt_progress": {"total": prompt_tokens, "cache": 0, "processed": 0}}]
        count = body.get("n_predict", 8)
        events += [{"content": f"w{i} ", "tokens": [i], "stop": False} for i in range(count)]
        events.append({"content": "", "tokens": [], "stop": True, "stop_type": "limit",
                       "stopping_word": "", "tokens_evaluated": prompt_tokens,
                       "tokens_predicted": count, "tokens_cached": 0})
        try:
            for event in events:
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
                if "SLOW" in prompt:
                    time.sleep(0.2)
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True


def main():
    if "--version" in sys.argv:
        print("version: 1 (fake)")
        return
    if "--list-devices" in sys.argv:
        print("Available devices:\n  (none)")
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--alias", default="model")
    args, _rest = parser.parse_known_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.alias = args.alias
    print("fake llama-server listening", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
