"""Models by repo id from a Hugging Face mirror, as users behind firewalls reach one: a fake hub on loopback serves a
small repo, and ``tmac pull`` / ``tmac run ORG/NAME`` honour huggingface_hub's environment — ``HF_ENDPOINT`` (the
mirror is the one asked), ``HF_TOKEN`` (sent to it), ``HF_HUB_CACHE`` and ``HF_HOME`` (where files land),
``HTTP_PROXY`` (requests go through the proxy) and ``HF_HUB_OFFLINE`` (the cache answers, nothing is asked)."""
import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading

import fuzz_targets
import pytest

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "acme/tiny"


class FakeHub(http.server.BaseHTTPRequestHandler):
    """The hub's API as huggingface_hub uses it for a download: the repo's file tree, and each file by
    ``/{repo}/resolve/{revision}/{file}`` with its commit and ETag; through a proxy, the same in absolute form."""

    files: dict = {}
    seen: list = []

    def do_GET(self, head: bool = False):
        path = self.path.split("?")[0]
        if path.startswith("http://"):  # asked through a proxy
            path = "/" + path.split("/", 3)[3]
        self.seen.append((self.command, self.path, self.headers.get("Authorization")))
        status, headers, body = 404, {"X-Error-Code": "RepoNotFound"}, b"{}"
        if path.startswith(f"/api/models/{REPO}/tree/"):
            status, headers = 200, {}
            body = json.dumps([{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                               for f, b in self.files.items()]).encode()
        elif path.startswith(f"/{REPO}/resolve/main/"):
            name = path.split("/", 5)[5]
            if name in self.files:
                body = self.files[name]
                status, headers = 200, {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(body).hexdigest()}"'}
            else:
                headers = {"X-Error-Code": "EntryNotFound"}
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def do_HEAD(self):
        self.do_GET(head=True)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    d = tmp_path_factory.mktemp("hub")
    fuzz_targets.write_gguf(str(d / "tiny-Q4_0.gguf"))
    FakeHub.files = {"tiny-Q4_0.gguf": (d / "tiny-Q4_0.gguf").read_bytes(), "README.md": b"# tiny\n"}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def tmac(*args, env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING")) and "PROXY" not in k.upper()}
    return subprocess.run([sys.executable, "-m", "tmac", *args], capture_output=True, text=True, timeout=300,
                          env={**clean, "HF_HUB_DOWNLOAD_TIMEOUT": "10", "HF_HUB_ETAG_TIMEOUT": "10", **env})


def _asked(kind: str) -> list:
    return [s for s in FakeHub.seen if f"/{REPO}/" in s[1] and (kind in s[1])]


def test_pull_from_a_mirror_with_a_token_into_hf_hub_cache_then_run_offline(hub, tmp_path):
    FakeHub.seen.clear()
    env = {"HF_ENDPOINT": hub, "HF_TOKEN": "hf_sesame", "HF_HUB_CACHE": str(tmp_path / "cache")}
    r = tmac("pull", REPO, env=env)
    assert r.returncode == 0, r.stderr
    got = tmp_path / "cache" / "models--acme--tiny" / "snapshots" / COMMIT / "tiny-Q4_0.gguf"
    assert got.read_bytes() == FakeHub.files["tiny-Q4_0.gguf"]
    asked = _asked("")
    assert _asked("/resolve/main/tiny-Q4_0.gguf") and all(auth == "Bearer hf_sesame" for _, _, auth in asked), asked
    FakeHub.seen.clear()
    r = tmac("run", REPO, "-p", "Hi", "-n", "2", "--temperature", "0", env={**env, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    assert not FakeHub.seen  # offline: the cache answered


def test_run_by_quant_downloads_from_the_mirror_into_hf_home(hub, tmp_path):
    FakeHub.seen.clear()
    r = tmac("run", f"{REPO}:Q4_0", "-p", "Hi", "-n", "2", "--temperature", "0",
             env={"HF_ENDPOINT": hub, "HF_HOME": str(tmp_path / "home")})
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "home" / "hub" / "models--acme--tiny" / "snapshots" / COMMIT / "tiny-Q4_0.gguf").is_file()
    assert _asked("/tree/main") and _asked("/resolve/main/tiny-Q4_0.gguf")


def test_pull_through_a_proxy(hub, tmp_path):
    """The mirror's host does not resolve here: only the proxy (the fake hub, answering absolute-form requests)
    can reach it, as behind a corporate proxy."""
    FakeHub.seen.clear()
    r = tmac("pull", REPO, env={"HF_ENDPOINT": "http://hub.invalid", "HTTP_PROXY": hub,
                                "HF_HUB_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    assert any(path.startswith("http://hub.invalid/acme/tiny/resolve/main/") for _, path, _ in FakeHub.seen)


def test_a_file_the_mirror_lacks_is_said(hub, tmp_path):
    r = tmac("pull", f"{REPO}:Q8_0", env={"HF_ENDPOINT": hub, "HF_HUB_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 1 and "no Q8_0 GGUF" in r.stderr and "Q4_0" in r.stderr and "Traceback" not in r.stderr
