"""Real stores on loopback for the model store's tests.

- OCI: Debian's docker-registry (the CNCF distribution registry), started
  with a temporary storage folder, optionally behind htpasswd (Basic) auth;
- S3: moto in its standalone server mode, speaking the S3 REST protocol
  (no S3 server from the package registries runs here as a service);
- Hugging Face: a small HTTP server answering the hub's api/models and
  resolve routes for a folder, which huggingface_hub reaches through
  HF_ENDPOINT.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import ssl
import subprocess
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

REGISTRY_BIN = shutil.which("docker-registry") or "/usr/bin/docker-registry"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Registry:
    proc: subprocess.Popen
    host: str  # 127.0.0.1:<port>
    storage: Path

    def uri(self, repo: str, tag: str) -> str:
        return f"oci://{self.host}/{repo}:{tag}"

    def blob_file(self, digest: str) -> Path:
        hexd = digest.removeprefix("sha256:")
        return self.storage / "docker" / "registry" / "v2" / "blobs" / "sha256" / hexd[:2] / hexd / "data"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class TokenServer:
    """The registry's token service (distribution's `auth: token`): Basic
    credentials in, an RS256 JWT out whose x5c chain the registry checks
    against its rootcertbundle, granting the scope asked for."""

    SERVICE, ISSUER = "modeld-test-registry", "modeld-test-issuer"

    def __init__(self, root: Path, user: str, password: str) -> None:
        import datetime

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import NameOID

        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "modeld test token signer")])
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(hours=1))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.bundle = root / "token-signer.pem"
        self.bundle.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        self.requests: list[str] = []  # the scope of each token asked for
        expected = "Basic " + __import__("base64").b64encode(f"{user}:{password}".encode()).decode()
        tokens = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                from urllib.parse import parse_qs, urlparse

                query = parse_qs(urlparse(self.path).query)
                scope = query.get("scope", [""])[0]
                tokens.requests.append(scope)
                if self.headers.get("Authorization") != expected:
                    self.send_response(401)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = json.dumps({"token": tokens.token(scope)}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/token"

    def token(self, scope: str) -> str:
        import base64
        import uuid

        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import padding

        def b64(data: bytes) -> str:
            return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

        access = []
        if scope.count(":") == 2:
            kind, repo, actions = scope.split(":")
            access.append({"type": kind, "name": repo, "actions": actions.split(",")})
        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256",
                  "x5c": [base64.b64encode(self.cert.public_bytes(serialization.Encoding.DER)).decode()]}
        claims = {"iss": self.ISSUER, "sub": "alice", "aud": self.SERVICE, "exp": now + 300, "nbf": now - 10,
                  "iat": now, "jti": uuid.uuid4().hex, "access": access}
        signing = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
        signature = self.key.sign(signing.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing}.{b64(signature)}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_registry(root: Path, htpasswd: tuple[str, str] | None = None, token: TokenServer | None = None,
                   tls: tuple[Path, Path] | None = None, ca_file: Path | None = None) -> Registry:
    """docker-registry on a free loopback port: plain HTTP, or TLS with the
    (certificate, key) in `tls`; behind htpasswd (Basic) or token auth."""
    if not Path(REGISTRY_BIN).exists():
        raise RuntimeError("docker-registry is not installed: `make registry` (apt-get install docker-registry)")
    port = free_port()
    storage = root / "storage"
    storage.mkdir(parents=True, exist_ok=True)
    auth = ""
    if htpasswd is not None:
        user, password = htpasswd
        hashed = subprocess.run(["htpasswd", "-nbB", user, password], capture_output=True, text=True,
                                check=True).stdout.strip()
        (root / "htpasswd").write_text(hashed + "\n")
        auth = f"auth:\n  htpasswd:\n    realm: modeld-test\n    path: {root / 'htpasswd'}\n"
    if token is not None:
        auth = (f"auth:\n  token:\n    realm: {token.realm}\n    service: {token.SERVICE}\n"
                f"    issuer: {token.ISSUER}\n    rootcertbundle: {token.bundle}\n")
    tls_config = f"  tls:\n    certificate: {tls[0]}\n    key: {tls[1]}\n" if tls is not None else ""
    config = root / "config.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {storage}\n  delete:\n    enabled: true\n"
        f"  cache:\n    blobdescriptor: \"\"\n"
        f"http:\n  addr: 127.0.0.1:{port}\n{tls_config}{auth}")
    proc = subprocess.Popen([REGISTRY_BIN, "serve", str(config)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    registry = Registry(proc, f"127.0.0.1:{port}", storage)
    deadline = time.monotonic() + 30
    while True:
        try:
            scheme = "https" if tls is not None else "http"
            verify = ssl.create_default_context(cafile=str(ca_file)) if ca_file is not None else True
            if httpx.get(f"{scheme}://{registry.host}/v2/", timeout=1, verify=verify).status_code in (200, 401):
                return registry
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            registry.stop()
            raise RuntimeError("docker-registry did not start")
        time.sleep(0.05)


# -- S3: moto's standalone server ------------------------------------------------------


@dataclass
class S3:
    server: object
    endpoint: str

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def upload(self, bucket: str, prefix: str, folder: Path) -> None:
        client = self.client()
        client.create_bucket(Bucket=bucket)
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                client.upload_file(str(path), bucket, prefix + path.relative_to(folder).as_posix())

    def stop(self) -> None:
        self.server.stop()


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def start_s3() -> S3:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return S3(server, f"http://{host}:{port}")


# -- Hugging Face: the hub's routes for a folder of repositories ---------------------


class HubServer:
    """Serves <root>/<org>/<name>/ as a hub model repository at one fixed commit."""

    COMMIT = "0123456789abcdef0123456789abcdef01234567"

    def __init__(self, root: Path, drop_after: int = 0, token: str = "") -> None:
        self.root = root
        self.downloads: list[str] = []  # "<file> <Range header>" per GET
        # with a token, every repository is private: a request without "Bearer <token>" is answered as the
        # hub answers for a private repository (401, RepoNotFound: it does not say the repository exists)
        self.token = token
        self.authorizations: list[str] = []  # the Authorization header of each request, "" when absent
        # the first GET of each file closes its connection after this many bytes (0: never)
        self.drop_after = drop_after
        self._dropped: set[str] = set()
        # hold_file's body stops after hold_after bytes until `hold` is set
        self.hold: threading.Event | None = None
        self.hold_file, self.hold_after = "", 0
        self.fail_with = 0  # an HTTP status every request gets instead (0: serve)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                if hub.fail_with:
                    return self._send(hub.fail_with, b'{"error": "failing on purpose"}')
                hub.authorizations.append(self.headers.get("Authorization", ""))
                if hub.token and self.headers.get("Authorization", "") != f"Bearer {hub.token}":
                    return self._send(401, b'{"error": "Repository not found"}',
                                      {"Content-Type": "application/json", "X-Error-Code": "RepoNotFound"}, body)
                path = self.path.split("?", 1)[0]
                parts = [p for p in path.split("/") if p]
                if parts[:2] == ["api", "models"]:
                    return self._info(parts[2:])
                if len(parts) >= 5 and parts[2] == "resolve":
                    return self._file(parts[0], parts[1], "/".join(parts[4:]), body)
                self._send(404, b'{"error": "not found"}')

            def _send(self, code: int, data: bytes, headers: dict | None = None, body: bool = True) -> None:
                self.send_response(code)
                for k, v in (headers or {"Content-Type": "application/json"}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def _info(self, rest: list[str]) -> None:
                # /api/models/<org>/<name>[/revision/<rev>]
                repo = hub.root / rest[0] / rest[1] if len(rest) >= 2 else None
                if repo is None or not repo.is_dir():
                    return self._send(404, b'{"error": "Repository not found"}',
                                      {"Content-Type": "application/json", "X-Error-Code": "RepoNotFound"})
                siblings = []
                for f in sorted(p for p in repo.rglob("*") if p.is_file()):
                    data = f.read_bytes()
                    sibling = {"rfilename": f.relative_to(repo).as_posix(), "size": len(data),
                               "blobId": hashlib.sha1(data).hexdigest()}
                    if f.suffix in (".onnx", ".gguf", ".safetensors"):
                        sibling["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                                          "pointerSize": 134}
                    siblings.append(sibling)
                info = {"_id": "x", "id": f"{rest[0]}/{rest[1]}", "modelId": f"{rest[0]}/{rest[1]}",
                        "sha": HubServer.COMMIT, "private": False, "siblings": siblings, "tags": []}
                self._send(200, json.dumps(info).encode())

            def _file(self, org: str, name: str, rel: str, body: bool) -> None:
                f = hub.root / org / name / rel
                if ".." in rel or not f.is_file():
                    return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, body)
                data = f.read_bytes()
                headers = {"Content-Type": "application/octet-stream", "X-Repo-Commit": HubServer.COMMIT,
                           "ETag": f'"{hashlib.sha256(data).hexdigest()}"', "Accept-Ranges": "bytes"}
                code, start = 200, 0
                wanted = self.headers.get("Range", "")
                if wanted.startswith("bytes="):
                    start = int(wanted[6:].split("-")[0] or 0)
                    code = 206
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                if body:
                    hub.downloads.append(f"{rel} {wanted}".strip())
                if body and hub.drop_after and rel not in hub._dropped and len(data) > hub.drop_after:
                    hub._dropped.add(rel)
                    self.send_response(code)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data) - start))
                    self.end_headers()
                    self.wfile.write(data[start:start + hub.drop_after])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if body and hub.hold is not None and rel.endswith(hub.hold_file):
                    self.send_response(code)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data) - start))
                    self.end_headers()
                    self.wfile.write(data[start:start + hub.hold_after])
                    self.wfile.flush()
                    hub.hold.wait(60)
                    self.wfile.write(data[start + hub.hold_after:])
                    return
                self._send(code, data[start:], headers, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# -- faults in front of a real registry ------------------------------------------------


class FaultyProxy:
    """An HTTP proxy in front of a registry (plain HTTP) that can answer
    every request with a status of its own (`fail_with`), or cut the first
    GET of each blob after `drop_after` bytes of its body (a store that drops
    the connection mid-blob). Everything else, Range headers included, goes
    through unchanged; `requests` records "<method> <path> <Range>"."""

    def __init__(self, upstream: str) -> None:
        self.upstream = f"http://{upstream}"
        self.fail_with = 0
        self.drop_after = 0
        self.requests: list[str] = []
        self._dropped: set[str] = set()
        self._client = httpx.Client(timeout=60, follow_redirects=True)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self._forward()

            def do_HEAD(self) -> None:
                self._forward()

            def do_PUT(self) -> None:
                self._forward()

            def do_POST(self) -> None:
                self._forward()

            def do_PATCH(self) -> None:
                self._forward()

            def _forward(self) -> None:
                proxy.requests.append(f"{self.command} {self.path} {self.headers.get('Range', '')}".strip())
                length = int(self.headers.get("Content-Length", 0) or 0)
                body = self.rfile.read(length) if length else b""
                if proxy.fail_with:
                    data = b'{"errors": [{"code": "UNKNOWN", "message": "failing on purpose"}]}'
                    self.send_response(proxy.fail_with)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                answer = proxy._client.request(self.command, proxy.upstream + self.path, headers=headers,
                                               content=body)
                data = answer.content
                blob = self.command == "GET" and "/blobs/sha256:" in self.path
                cut = blob and proxy.drop_after and self.path not in proxy._dropped and len(data) > proxy.drop_after
                self.send_response(answer.status_code)
                for k, v in answer.headers.items():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command == "HEAD":
                    return
                if cut:
                    proxy._dropped.add(self.path)
                    self.wfile.write(data[:proxy.drop_after])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def uri(self, repo: str, tag: str) -> str:
        return f"oci://{self.host}/{repo}:{tag}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._client.close()
