"""A local stand-in for the Hugging Face Hub's HTTP API: the routes huggingface_hub's
``create_repo``, ``create_branch``, ``list_repo_files``, ``preupload_lfs_files`` and
``create_commit`` call (huggingface_hub 2.x, legacy LFS transfers: the tests set
``HF_HUB_DISABLE_XET``), served by a real HTTP server on 127.0.0.1, so that ``mpack push`` runs
the real ``HfApi`` over real sockets. Used by tests/test_push_hub.py.

What it keeps is what the Hub would hold: repos, their branches and pull-request refs as
``{path: bytes}``, and the LFS objects by sha256, with a count of every upload of each (the Hub's
LFS batch API, as the git-lfs spec has it: an object already stored gets no ``actions``, so the
client skips it; two requests for an object not stored yet both get an upload action).
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

#: Files the Hub stores through LFS whatever their size (the .gitattributes of a new repo).
LFS_SUFFIXES = (".safetensors", ".bin", ".model")
#: The size from which a file goes to LFS (the Hub's 10 MB rule).
LFS_MIN_SIZE = 10 * 1024 * 1024
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


@dataclass
class Commit:
    repo: str
    revision: str
    summary: str
    description: str
    create_pr: bool
    added: list[str]
    lfs: list[str]
    deleted: list[str]


@dataclass
class HubState:
    repos: dict[str, dict[str, dict[str, bytes]]] = field(default_factory=dict)  # repo->ref->files
    private: dict[str, bool] = field(default_factory=dict)
    lfs: dict[str, bytes] = field(default_factory=dict)  # sha256 -> bytes
    uploads: Counter = field(default_factory=Counter)  # sha256 -> PUTs received
    bytes_received: int = 0
    commits: list[Commit] = field(default_factory=list)
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path)
    validated_cards: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    # --- plumbing ----------------------------------------------------------------------------

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, doc: Any = None, headers: dict[str, str] | None = None) -> None:
        data = b"" if doc is None else json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, code: str | None = None) -> None:
        self._send(status, {"error": message}, {"X-Error-Code": code} if code else None)

    @property
    def state(self) -> HubState:
        return self.server.state

    def _authorized(self) -> bool:
        if self.headers.get("Authorization", "").startswith("Bearer hf_"):
            return True
        self._error(401, "Invalid credentials in Authorization header")
        return False

    # --- routes ------------------------------------------------------------------------------

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        parts = url.path.split("/")
        with self.state.lock:
            self.state.requests.append(("GET", url.path))
        # /api/models/{ns}/{name}/tree/{rev}
        if parts[1:3] == ["api", "models"] and len(parts) >= 7 and parts[5] == "tree":
            repo, ref = f"{parts[3]}/{parts[4]}", unquote(parts[6])
            files = self._ref(repo, ref)
            if files is None:
                return
            tree = [
                {"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                for p, b in sorted(files.items())
            ]
            return self._send(200, tree)
        self._error(404, f"no route GET {url.path}")

    def do_PUT(self) -> None:
        url = urlsplit(self.path)
        body = self._body()
        if url.path.startswith("/lfs-upload/"):
            oid = url.path.rsplit("/", 1)[1]
            if hashlib.sha256(body).hexdigest() != oid:
                return self._error(400, "sha256 mismatch")
            with self.state.lock:
                self.state.requests.append(("PUT", url.path))
                self.state.lfs[oid] = body
                self.state.uploads[oid] += 1
                self.state.bytes_received += len(body)
            return self._send(200, {})
        self._error(404, f"no route PUT {url.path}")

    def do_POST(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        body = self._body()
        parts = url.path.split("/")
        with self.state.lock:
            self.state.requests.append(("POST", url.path))
        if url.path == "/api/validate-yaml":
            doc = json.loads(body)
            text = doc["content"]
            front = text.split("---\n")[1] if text.startswith("---\n") else ""
            try:
                meta = yaml.safe_load(front)
            except yaml.YAMLError as e:
                return self._send(400, {"errors": [{"message": str(e)}], "warnings": []})
            if meta is not None and not isinstance(meta, dict):
                return self._send(400, {"errors": [{"message": "not a mapping"}], "warnings": []})
            self.state.validated_cards.append(text)
            return self._send(200, {"errors": [], "warnings": []})
        if not self._authorized():
            return
        if url.path == "/api/repos/create":
            doc = json.loads(body)
            repo = f"{doc['organization']}/{doc['name']}"
            with self.state.lock:
                if repo in self.state.repos:  # the Hub's 409 names the repo's url too
                    return self._send(
                        409,
                        {
                            "error": "You already created this model repo",
                            "url": f"{self.server.url}/{repo}",
                        },
                    )
                self.state.repos[repo] = {"main": {".gitattributes": GITATTRIBUTES}}
                self.state.private[repo] = doc.get("visibility") == "private" or bool(
                    doc.get("private")
                )
            return self._send(200, {"url": f"{self.server.url}/{repo}", "name": repo})
        # /{ns}/{name}.git/info/lfs/objects/batch
        if url.path.endswith(".git/info/lfs/objects/batch"):
            doc = json.loads(body)
            objects = []
            for o in doc["objects"]:
                entry = {"oid": o["oid"], "size": o["size"]}
                if o["oid"] not in self.state.lfs:  # the git-lfs spec: no actions when stored
                    entry["actions"] = {
                        "upload": {"href": f"{self.server.url}/lfs-upload/{o['oid']}"}
                    }
                objects.append(entry)
            return self._send(200, {"transfer": "basic", "objects": objects})
        if parts[1:3] != ["api", "models"] or len(parts) < 7:
            return self._error(404, f"no route POST {url.path}")
        repo, route, ref = f"{parts[3]}/{parts[4]}", parts[5], unquote(parts[6])
        if repo not in self.state.repos:
            return self._error(404, "Repository not found", "RepoNotFound")
        if route == "branch":
            with self.state.lock:
                refs = self.state.repos[repo]
                if ref in refs:
                    return self._error(409, "Reference already exists")
                refs[ref] = dict(refs["main"])
            return self._send(200, {})
        if route == "preupload":
            doc = json.loads(body)
            files = []
            for f in doc["files"]:
                sample = base64.b64decode(f["sample"])
                lfs = (
                    f["path"].endswith(LFS_SUFFIXES) or f["size"] >= LFS_MIN_SIZE or b"\0" in sample
                )
                files.append(
                    {
                        "path": f["path"],
                        "uploadMode": "lfs" if lfs else "regular",
                        "shouldIgnore": False,
                        "oid": None,
                    }
                )
            return self._send(200, {"files": files})
        if route == "commit":
            return self._commit(repo, ref, body, create_pr=query.get("create_pr") == ["1"])
        self._error(404, f"no route POST {url.path}")

    def _ref(self, repo: str, ref: str) -> dict[str, bytes] | None:
        refs = self.state.repos.get(repo)
        if refs is None:
            self._error(404, "Repository not found", "RepoNotFound")
            return None
        if ref not in refs:
            self._error(404, f"Invalid rev id: {ref}", "RevisionNotFound")
            return None
        return refs[ref]

    def _commit(self, repo: str, ref: str, body: bytes, *, create_pr: bool) -> None:
        items = [json.loads(line) for line in body.splitlines() if line.strip()]
        header = items[0]["value"]
        files = self._ref(repo, ref)
        if files is None:
            return
        new = dict(files)
        added, lfs, deleted = [], [], []
        for item in items[1:]:
            v = item["value"]
            if item["key"] == "file":
                new[v["path"]] = base64.b64decode(v["content"])
                added.append(v["path"])
            elif item["key"] == "lfsFile":
                if v["oid"] not in self.state.lfs:
                    return self._error(400, f"LFS object {v['oid']} was never uploaded")
                new[v["path"]] = self.state.lfs[v["oid"]]
                lfs.append(v["path"])
            elif item["key"] == "deletedFile":
                if v["path"] not in new:
                    return self._error(404, "A file with this name doesn't exist")
                del new[v["path"]]
                deleted.append(v["path"])
            else:
                return self._error(400, f"unknown operation {item['key']}")
        oid = hashlib.sha1(json.dumps(items).encode()).hexdigest()
        with self.state.lock:
            refs = self.state.repos[repo]
            self.state.commits.append(
                Commit(
                    repo,
                    ref,
                    header["summary"],
                    header["description"],
                    create_pr,
                    added,
                    lfs,
                    deleted,
                )
            )
            if create_pr:
                n = sum(r.startswith("refs/pr/") for r in refs) + 1
                refs[f"refs/pr/{n}"] = new
                pr = {"pullRequestUrl": f"{self.server.url}/{repo}/discussions/{n}"}
            else:
                refs[ref] = new
                pr = {}
        self._send(
            200, {"commitUrl": f"{self.server.url}/{repo}/commit/{oid}", "commitOid": oid, **pr}
        )


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: HubState
    url: str


class LocalHub:
    """``with LocalHub() as hub:`` a Hub stand-in at ``hub.url``, its contents in ``hub.state``."""

    def __init__(self) -> None:
        self.server = _Server(("127.0.0.1", 0), _Handler)
        self.server.state = HubState()
        self.url = self.server.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def state(self) -> HubState:
        return self.server.state

    def __enter__(self) -> LocalHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
