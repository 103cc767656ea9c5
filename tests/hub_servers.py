"""Servers on 127.0.0.1, in the test process, that answer as Hugging Face's file API and
Ollama's registry do, for the files a test gives them.

Hugging Face: GET /api/models/<repo>[/revision/<rev>] (model_info with blobs: siblings with
size, blobId and lfs.sha256), GET /api/models/<repo>/tree/<rev> (the file listing
snapshot_download reads) and GET/HEAD /<repo>/resolve/<rev>/<file> with X-Repo-Commit,
ETag / X-Linked-Etag / X-Linked-Size, Content-Length and Range. Ollama: GET
/v2/<ns>/<model>/manifests/<tag> and /v2/<ns>/<model>/blobs/<digest>, with Range.

Every file request is logged (path, first byte asked for, bytes sent); a file can be made to
drop its connection once after some bytes, or to serve one flipped byte.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
_LFS_SUFFIXES = (".gguf", ".safetensors")


@dataclass
class Served:
    data: bytes
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class FileLog:
    path: str
    start: int
    sent: int = 0


class HubServer:
    """One server; add files with add_hf_repo / add_ollama_model, then use .url."""

    def __init__(self) -> None:
        self.files: dict[str, Served] = {}  # URL path -> bytes
        self.json: dict[str, object] = {}  # URL path -> JSON answer
        self.log: list[FileLog] = []
        self.drop_after: dict[str, int] = {}  # URL path -> bytes, then the connection drops
        self.corrupt: set[str] = set()  # URL paths served with one byte flipped
        self.delay_s = 0.0  # pause after each chunk (lets concurrent pulls overlap)
        self.tokens: dict[str, str] = {}  # URL path prefix -> the token it wants (private)
        self.authorizations: list[str | None] = []  # the Authorization header of each request
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def requests_for(self, suffix: str) -> list[FileLog]:
        return [entry for entry in self.log if entry.path.endswith(suffix)]

    # -- Hugging Face ---------------------------------------------------------------------

    def add_hf_repo(self, repo: str, files: dict[str, bytes]) -> None:
        siblings, tree = [], []
        for name, data in sorted(files.items()):
            sha256 = hashlib.sha256(data).hexdigest()
            blob_id = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
            sibling = {"rfilename": name, "size": len(data), "blobId": blob_id}
            entry = {"type": "file", "path": name, "size": len(data), "oid": blob_id}
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{blob_id}"'}
            if name.endswith(_LFS_SUFFIXES):
                sibling["lfs"] = {"size": len(data), "sha256": sha256, "pointerSize": 134}
                entry["lfs"] = {"oid": sha256, "size": len(data), "pointerSize": 134}
                headers.update({"X-Linked-Etag": f'"{sha256}"', "X-Linked-Size": str(len(data)),
                                "ETag": f'"{sha256}"'})
            siblings.append(sibling)
            tree.append(entry)
            for revision in ("main", COMMIT):
                self.files[f"/{repo}/resolve/{revision}/{name}"] = Served(data, headers)
        info = {"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                "siblings": siblings}
        self.json[f"/api/models/{repo}"] = info
        for revision in ("main", COMMIT):
            self.json[f"/api/models/{repo}/revision/{revision}"] = info
            # list_repo_tree (snapshot_download), recursive: every file of the repository
            self.json[f"/api/models/{repo}/tree/{revision}"] = tree

    # -- Ollama ---------------------------------------------------------------------------

    def add_ollama_model(self, name: str, tag: str, layers: dict[str, bytes]) -> dict:
        """layers: Ollama media-type suffix (model, template, params, ...) -> bytes."""
        namespace, _, model = name.rpartition("/")
        base = f"/v2/{namespace or 'library'}/{model}"
        described = []
        for kind, data in layers.items():
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            described.append({"mediaType": f"application/vnd.ollama.image.{kind}",
                              "digest": digest, "size": len(data)})
            self.files[f"{base}/blobs/{digest}"] = Served(data)
        config = b'{"model_format":"gguf"}'
        manifest = {"schemaVersion": 2,
                    "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                    "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                               "digest": "sha256:" + hashlib.sha256(config).hexdigest(),
                               "size": len(config)},
                    "layers": described}
        self.json[f"{base}/manifests/{tag}"] = manifest
        return manifest


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:  # noqa: N802 (http.server's name)
            self._answer(body=False)

        def do_GET(self) -> None:  # noqa: N802
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            path = self.path.split("?", 1)[0]
            authorization = self.headers.get("Authorization")
            hub.authorizations.append(authorization)
            wanted = [token for prefix, token in hub.tokens.items() if prefix in path]
            if wanted and authorization != f"Bearer {wanted[0]}":
                # What the Hub answers for a private repository without the right token.
                self._send(401, {"Content-Type": "application/json",
                                 "X-Error-Code": "RepoNotFound"},
                           b'{"error":"Repository not found"}', body)
            elif path in hub.json:
                data = json.dumps(hub.json[path]).encode()
                self._send(200, {"Content-Type": "application/json"}, data, body)
            elif path in hub.files:
                self._send_file(path, hub.files[path], body)
            else:
                self._send(404, {"Content-Type": "application/json",
                                 "X-Error-Code": "RepoNotFound"},
                           b'{"error":"Repository not found"}', body)

        def _send_file(self, path: str, served: Served, body: bool) -> None:
            data = served.data
            if path in hub.corrupt:
                data = data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + \
                    data[len(data) // 2 + 1:]
            start = 0
            match = re.match(r"bytes=(\d+)-$", self.headers.get("Range", ""))
            headers = {**served.headers, "Accept-Ranges": "bytes",
                       "Content-Type": "application/octet-stream"}
            status = 200
            if match:
                start = int(match[1])
                status = 206
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            chunk = data[start:]
            headers["Content-Length"] = str(len(chunk))
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            if not body:
                return
            entry = FileLog(path, start)
            hub.log.append(entry)
            limit = hub.drop_after.pop(path, None)
            for offset in range(0, len(chunk), 256 * 1024):
                piece = chunk[offset:offset + 256 * 1024]
                if limit is not None and entry.sent + len(piece) > limit:
                    piece = piece[:limit - entry.sent]
                    self.wfile.write(piece)
                    entry.sent += len(piece)
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)  # the network drops mid-file
                    return
                self.wfile.write(piece)
                entry.sent += len(piece)
                if hub.delay_s:
                    threading.Event().wait(hub.delay_s)

        def _send(self, status: int, headers: dict[str, str], data: bytes, body: bool) -> None:
            self.send_response(status)
            for key, value in {**headers, "Content-Length": str(len(data))}.items():
                self.send_header(key, value)
            self.end_headers()
            if body:
                self.wfile.write(data)

    return Handler


def read(path: Path) -> bytes:
    return Path(path).read_bytes()
