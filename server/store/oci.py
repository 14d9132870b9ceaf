"""OCI registries (the distribution API) over httpx: pull and push model artifacts.

Pulls three shapes of artifact:
- plain ORAS artifacts: each layer a file of the model folder, named by its
  `org.opencontainers.image.title` annotation (what `oras push` makes);
- CNCF ModelPack (config `application/vnd.cncf.model.config.v1+json`),
  layers named by `org.cncf.model.filepath` or the title annotation;
- Docker Model Runner models (`application/vnd.docker.ai.*` layers: GGUF,
  safetensors, license), which carry no file names.

Auth follows the registry's challenge: `Bearer realm=...,service=...` gets a
token from the realm (with the user's Basic credentials where configured),
`Basic` sends them directly. Credentials come from a Docker-style
config.json (`auths`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import httpx
import structlog

from modeld.backends.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable

from .cache import DIGEST_RE, Listing, RemoteFile, TransferBroken, safe_path
from .uri import SourceURI

log = structlog.get_logger("modeld.store")

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MODELPACK_CONFIG = "application/vnd.cncf.model.config.v1+json"
MODELPACK_ARTIFACT = "application/vnd.cncf.model.manifest.v1+json"
DMR_CONFIG = "application/vnd.docker.ai.model.config.v0.1+json"
TITLE = "org.opencontainers.image.title"
MODELPACK_PATH = "org.cncf.model.filepath"
# Docker Model Runner's layers carry no names: each media type has one
_DMR_NAMES = {"application/vnd.docker.ai.gguf.v3": ("model", ".gguf"),
              "application/vnd.docker.ai.safetensors": ("model", ".safetensors"),
              "application/vnd.docker.ai.license": ("LICENSE", ""),
              "application/vnd.docker.ai.chat.template.jinja": ("chat_template", ".jinja")}
_ACCEPT = ", ".join((OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST))
MAX_MANIFEST = 4 * 1024 * 1024
MAX_LAYERS = 4096
_CHALLENGE_RE = re.compile(r'(\w+)="([^"]*)"')


@dataclass(frozen=True)
class OciSettings:
    mirror: str = ""  # host:port tried first for every registry; the origin on its failure
    plain_http: tuple[str, ...] = ()  # registries (host:port) spoken to without TLS
    ca_file: Path | None = None  # CA bundle for registries' certificates; None: the system's
    auth_file: Path | None = None  # Docker-style config.json with "auths"
    timeout_s: float = 60.0


@dataclass
class _Auth:
    basic: tuple[str, str] | None = None
    tokens: dict[str, str] = field(default_factory=dict)  # scope -> Bearer token


def _credentials(settings: OciSettings, host: str) -> tuple[str, str] | None:
    path = settings.auth_file
    if path is None or not path.is_file():
        return None
    try:
        auths = json.loads(path.read_text(encoding="utf-8")).get("auths", {})
        entry = auths.get(host) or auths.get(f"https://{host}") or auths.get(f"http://{host}")
        if not entry:
            return None
        if "auth" in entry:
            user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
            return user, password
        return entry.get("username", ""), entry.get("password", "")
    except (OSError, ValueError, AttributeError, UnicodeDecodeError):
        raise FailedPrecondition("the registry credentials file (store_oci_auth_file) is not a readable "
                                 "Docker config.json") from None


class Registry:
    """One registry host, spoken to with one httpx client (thread-safe)."""

    def __init__(self, host: str, settings: OciSettings) -> None:
        self.host = host
        self.settings = settings
        scheme = "http" if host in settings.plain_http else "https"
        self.base = f"{scheme}://{host}"
        verify: object = True
        if settings.ca_file is not None:
            import ssl

            verify = ssl.create_default_context(cafile=str(settings.ca_file))
        self.client = httpx.Client(timeout=httpx.Timeout(settings.timeout_s, connect=10.0), verify=verify,
                                   follow_redirects=True, trust_env=False)
        self._auth = _Auth(basic=_credentials(settings, host))
        self._lock = threading.Lock()

    def close(self) -> None:
        self.client.close()

    # -- requests with the registry's auth challenge -------------------------

    def request(self, method: str, url: str, repo: str, push: bool = False, stream: bool = False,
                **kwargs) -> httpx.Response:
        scope = f"repository:{repo}:{'pull,push' if push else 'pull'}"
        headers = dict(kwargs.pop("headers", {}) or {})
        target = url if url.startswith(("http://", "https://")) else self.base + url
        for attempt in range(2):
            auth = self._auth_header(scope)
            if auth:
                headers["Authorization"] = auth
            try:
                request = self.client.build_request(method, target, headers=headers, **kwargs)
                response = self.client.send(request, stream=stream)
            except httpx.TransportError as exc:
                raise Unavailable(f"registry {self.host} cannot be reached ({type(exc).__name__}); "
                                  "check the address, TLS settings (store_oci_plain_http, store_oci_ca_file) "
                                  "or the network") from None
            if response.status_code != 401 or attempt == 1:
                return response
            challenge = response.headers.get("www-authenticate", "")
            response.close()
            if not self._answer(challenge, scope):
                return response
        return response

    def _auth_header(self, scope: str) -> str:
        with self._lock:
            token = self._auth.tokens.get(scope)
        if token:
            return f"Bearer {token}"
        if self._auth.basic is not None and self._auth.tokens.get("basic"):
            user, password = self._auth.basic
            return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        return ""

    def _answer(self, challenge: str, scope: str) -> bool:
        """Follow a 401's challenge; False when nothing more can be tried."""
        kind = challenge.split(" ", 1)[0].lower()
        if kind == "basic":
            if self._auth.basic is None:
                return False
            self._auth.tokens["basic"] = "1"
            return True
        if kind != "bearer":
            return False
        params = dict(_CHALLENGE_RE.findall(challenge))
        realm = params.get("realm", "")
        if not realm.startswith(("https://", "http://")):
            return False
        query = {"service": params.get("service", ""), "scope": params.get("scope", scope)}
        auth = httpx.BasicAuth(*self._auth.basic) if self._auth.basic is not None else None
        try:
            answer = self.client.get(realm, params=query, auth=auth)
        except httpx.TransportError as exc:
            raise Unavailable(f"registry {self.host}'s token service cannot be reached ({type(exc).__name__})") from None
        if answer.status_code != 200:
            return False
        try:
            body = answer.json()
            token = body.get("token") or body.get("access_token")
        except ValueError:
            token = None
        if not token:
            return False
        with self._lock:
            self._auth.tokens[scope] = token
        return True

    def check(self, response: httpx.Response, what: str) -> httpx.Response:
        code = response.status_code
        if code < 300:
            return response
        if stream_open(response):
            response.read()
        if code in (401, 403):
            raise FailedPrecondition(f"registry {self.host} refused access to {what} ({code}): set its credentials "
                                     "in the store's registry auth file (store_oci_auth_file, a Docker config.json)")
        if code == 404:
            raise NotFound(f"registry {self.host} has no {what} (404)")
        if code == 429 or code >= 500:
            raise Unavailable(f"registry {self.host} answered {code} for {what}; try again later")
        raise InvalidArgument(f"registry {self.host} answered {code} for {what}: {_error_text(response)}")

    # -- pull -------------------------------------------------------------------

    def manifest(self, repo: str, reference: str) -> tuple[dict, str]:
        what = f"manifest {repo}:{reference}" if not reference.startswith("sha256:") else f"manifest {repo}@{reference}"
        response = self.check(self.request("GET", f"/v2/{repo}/manifests/{reference}", repo,
                                           headers={"Accept": _ACCEPT}), what)
        body = response.content
        if len(body) > MAX_MANIFEST:
            raise InvalidArgument(f"registry {self.host}: {what} is larger than {MAX_MANIFEST} bytes")
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if reference.startswith("sha256:") and digest != reference:
            raise InvalidArgument(f"registry {self.host}: {what} does not match its digest (got {digest})")
        try:
            manifest = json.loads(body)
        except ValueError:
            raise InvalidArgument(f"registry {self.host}: {what} is not JSON") from None
        if not isinstance(manifest, dict):
            raise InvalidArgument(f"registry {self.host}: {what} is not a JSON object")
        if manifest.get("mediaType") in (OCI_INDEX, DOCKER_LIST) or "manifests" in manifest:
            manifests = manifest.get("manifests") or []
            if not manifests or not isinstance(manifests[0], dict) or not DIGEST_RE.fullmatch(
                    str(manifests[0].get("digest", ""))):
                raise InvalidArgument(f"registry {self.host}: {what} is an index with no usable manifest")
            return self.manifest(repo, manifests[0]["digest"])
        return manifest, digest

    def blob_fetch(self, repo: str, digest: str, label: str):
        def fetch(offset: int) -> tuple[Iterator[bytes], int]:
            headers = {"Range": f"bytes={offset}-"} if offset else {}
            response = self.check(self.request("GET", f"/v2/{repo}/blobs/{digest}", repo, stream=True,
                                               headers=headers), label)
            start = offset if response.status_code == 206 else 0
            return _chunks(response), start
        return fetch

    def small_blob(self, repo: str, digest: str, what: str, limit: int = MAX_MANIFEST) -> bytes:
        body = self.check(self.request("GET", f"/v2/{repo}/blobs/{digest}", repo), what).content
        if len(body) > limit or "sha256:" + hashlib.sha256(body).hexdigest() != digest:
            raise InvalidArgument(f"registry {self.host}: {what} does not match its digest")
        return body

    # -- push -------------------------------------------------------------------

    def has_blob(self, repo: str, digest: str) -> bool:
        response = self.request("HEAD", f"/v2/{repo}/blobs/{digest}", repo, push=True)
        if response.status_code == 404:
            return False
        self.check(response, f"blob {digest}")
        return True

    def put_blob(self, repo: str, digest: str, content, size: int) -> None:
        """Upload a blob the registry lacks; `content` is bytes or a callable
        giving its chunks (a large file streams, never held whole)."""
        if self.has_blob(repo, digest):
            return
        if callable(content):
            content = content()
        started = self.check(self.request("POST", f"/v2/{repo}/blobs/uploads/", repo, push=True),
                             f"an upload to {repo}")
        location = started.headers.get("location", "")
        if not location:
            raise InvalidArgument(f"registry {self.host} started an upload without a Location")
        if location.startswith("/"):
            location = self.base + location
        joiner = "&" if "?" in location else "?"
        self.check(self.request("PUT", f"{location}{joiner}digest={digest}", repo, push=True, content=content,
                                headers={"Content-Type": "application/octet-stream",
                                         "Content-Length": str(size)}), f"blob {digest}")

    def put_manifest(self, repo: str, reference: str, manifest: bytes, media_type: str) -> None:
        self.check(self.request("PUT", f"/v2/{repo}/manifests/{reference}", repo, push=True, content=manifest,
                                headers={"Content-Type": media_type}), f"manifest {repo}:{reference}")


def stream_open(response: httpx.Response) -> bool:
    return not response.is_closed and not response.is_stream_consumed


def _error_text(response: httpx.Response) -> str:
    try:
        errors = response.json().get("errors") or []
        return "; ".join(str(e.get("message", e.get("code", ""))) for e in errors)[:300] or response.reason_phrase
    except (ValueError, AttributeError):
        return response.reason_phrase


def _chunks(response: httpx.Response) -> Iterator[bytes]:
    try:
        yield from response.iter_bytes()  # as it arrives: a drop loses nothing already received
    except (httpx.TransportError, httpx.StreamError) as exc:
        raise TransferBroken(type(exc).__name__) from None
    finally:
        response.close()


class OciSource:
    def __init__(self, settings: OciSettings) -> None:
        self.settings = settings
        self._registries: dict[str, Registry] = {}
        self._lock = threading.Lock()

    def registry(self, host: str) -> Registry:
        with self._lock:
            if host not in self._registries:
                self._registries[host] = Registry(host, self.settings)
            return self._registries[host]

    def close(self) -> None:
        for registry in self._registries.values():
            registry.close()

    def listing(self, uri: SourceURI) -> Listing:
        hosts = [self.settings.mirror, uri.host] if self.settings.mirror and self.settings.mirror != uri.host \
            else [uri.host]
        for i, host in enumerate(hosts):
            registry = self.registry(host)
            try:
                manifest, digest = registry.manifest(uri.path, uri.reference)
                return self._listing(uri, registry, manifest, digest)
            except (Unavailable, NotFound) as exc:
                if i + 1 == len(hosts):
                    raise
                log.warning("store_mirror_failed", mirror=host, uri=uri.text, reason=str(exc))
        raise AssertionError("unreachable")

    def _listing(self, uri: SourceURI, registry: Registry, manifest: dict, digest: str) -> Listing:
        layers = manifest.get("layers") or []
        if not isinstance(layers, list) or len(layers) > MAX_LAYERS:
            raise InvalidArgument(f"{uri.text}: the manifest's layers are not a list of at most {MAX_LAYERS}")
        config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
        hints = self._hints(uri, registry, config)
        files: list[RemoteFile] = []
        counts: dict[str, int] = {}
        for layer in layers:
            if not isinstance(layer, dict):
                raise InvalidArgument(f"{uri.text}: a manifest layer is not an object")
            layer_digest, size = str(layer.get("digest", "")), layer.get("size")
            if not DIGEST_RE.fullmatch(layer_digest) or not isinstance(size, int) or size < 0:
                raise InvalidArgument(f"{uri.text}: a layer has no sha256 digest and size")
            unpack = _tar_kind(layer)
            name = f".layers/{layer_digest.removeprefix('sha256:')[:32]}" if unpack else \
                self._layer_name(uri, layer, counts)
            if name is None:
                continue
            title = _annotations(layer).get(TITLE) or name
            label = f"layer {layer_digest[:19]}… ({title})"
            files.append(RemoteFile(name, size, layer_digest, registry.blob_fetch(uri.path, layer_digest, label),
                                    label, unpack=unpack))
        return Listing(uri.text, digest, tuple(files), hints)

    def _layer_name(self, uri: SourceURI, layer: dict, counts: dict[str, int]) -> str | None:
        annotations = layer.get("annotations") if isinstance(layer.get("annotations"), dict) else {}
        name = annotations.get(MODELPACK_PATH) or annotations.get(TITLE)
        media = str(layer.get("mediaType", ""))
        if name is not None:
            return safe_path(name, f"{uri.text} (layer annotation)")
        if media in _DMR_NAMES:
            stem, suffix = _DMR_NAMES[media]
            n = counts.get(media, 0)
            counts[media] = n + 1
            return f"{stem}{suffix}" if n == 0 else f"{stem}-{n:05d}{suffix}"
        return None  # a layer with no name and no known kind is nothing a backend loads

    def _hints(self, uri: SourceURI, registry: Registry, config: dict) -> dict:
        media = config.get("mediaType", "")
        digest = str(config.get("digest", ""))
        if media not in (MODELPACK_CONFIG, DMR_CONFIG) or not DIGEST_RE.fullmatch(digest):
            return {}
        try:
            raw = json.loads(registry.small_blob(uri.path, digest, "the artifact's config", 1024 * 1024))
        except ValueError:
            raise InvalidArgument(f"{uri.text}: the artifact's config is not JSON") from None
        inner = raw.get("config") if isinstance(raw, dict) and isinstance(raw.get("config"), dict) else {}
        hints = {"format": str(inner.get("format", "")).lower()} if inner.get("format") else {}
        if media == DMR_CONFIG and isinstance(raw, dict) and raw.get("format"):
            hints["format"] = str(raw["format"]).lower()
        return hints

    # -- push -------------------------------------------------------------------

    def push(self, folder: Path, uri: SourceURI, model_format: str = "", packing: str = "raw") -> str:
        """Write `folder` as a ModelPack artifact, one layer per file: the file
        itself (`packing="raw"`, `...v1.raw` layers) or a tar archive holding
        it at its path (`"tar"`, `...v1.tar` layers, as modctl packs); returns
        the manifest digest."""
        if uri.is_digest:
            raise InvalidArgument(f"{uri.text}: push to a tag, not a digest")
        if packing not in PACKINGS:
            raise InvalidArgument(f"layer packing {packing!r} is not known; use one of {', '.join(PACKINGS)}")
        registry = self.registry(uri.host)
        files = sorted((p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")),
                       key=lambda p: p.relative_to(folder).as_posix())
        if not files:
            raise InvalidArgument(f"{folder} holds no files to push")
        if len(files) > MAX_LAYERS:
            raise InvalidArgument(f"{folder} holds {len(files)} files; an artifact may have at most {MAX_LAYERS}")
        layers, diff_ids = [], []
        for path in files:
            rel = path.relative_to(folder).as_posix()
            safe_path(rel, f"{folder} (file to push)")
            if packing == "tar":
                layer = _TarLayer(path, rel)
                digest, size, body = layer.digest, layer.size, layer.chunks
                annotations = {MODELPACK_PATH: rel}  # no title: `oras pull` would write the archive under it
            else:
                digest, size = _file_digest(path)
                body = lambda path=path: _file_chunks(path)  # noqa: E731
                annotations = {TITLE: rel, MODELPACK_PATH: rel}
            registry.put_blob(uri.path, digest, body, size)
            layers.append({"mediaType": _layer_media(rel, packing), "digest": digest, "size": size,
                           "annotations": annotations})
            diff_ids.append(digest)  # uncompressed layers: the content's hash is the blob's
        config = {"descriptor": {"name": uri.path.rsplit("/", 1)[-1]},
                  "config": {"format": model_format or _guess_format(files)},
                  "modelfs": {"type": "layers", "diffIds": diff_ids}}
        config_bytes = json.dumps(config, separators=(",", ":")).encode()
        config_digest = "sha256:" + hashlib.sha256(config_bytes).hexdigest()
        registry.put_blob(uri.path, config_digest, lambda: iter((config_bytes,)), len(config_bytes))
        manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": MODELPACK_ARTIFACT,
                    "config": {"mediaType": MODELPACK_CONFIG, "digest": config_digest, "size": len(config_bytes)},
                    "layers": layers}
        manifest_bytes = json.dumps(manifest, separators=(",", ":")).encode()
        registry.put_manifest(uri.path, uri.reference, manifest_bytes, OCI_MANIFEST)
        return "sha256:" + hashlib.sha256(manifest_bytes).hexdigest()


PACKINGS = ("raw", "tar")
_TAR_BLOCK = 512


class _TarLayer:
    """One file as a reproducible tar archive, streamed without a copy on
    disk: the header (the path, mode 0644, uid/gid 0, mtime 0: the same bytes
    from any machine, as ModelPack's reproducibility guidance asks), the
    file's bytes, padding to a block, and the two zero blocks that end an
    archive. Read twice: once to hash it, once to send it."""

    def __init__(self, path: Path, rel: str) -> None:
        import tarfile

        self.path = path
        self.file_size = path.stat().st_size
        info = tarfile.TarInfo(rel)
        info.size, info.mode, info.mtime, info.uid, info.gid = self.file_size, 0o644, 0, 0, 0
        info.uname = info.gname = ""
        self.header = info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
        self.trailer = b"\0" * (-self.file_size % _TAR_BLOCK) + b"\0" * (2 * _TAR_BLOCK)
        self.size = len(self.header) + self.file_size + len(self.trailer)
        hasher = hashlib.sha256()
        read = 0
        for chunk in self.chunks():
            hasher.update(chunk)
            read += len(chunk)
        if read != self.size:  # the file changed while it was read
            raise InvalidArgument(f"{rel} changed while it was packed; push again")
        self.digest = "sha256:" + hasher.hexdigest()

    def chunks(self) -> Iterator[bytes]:
        yield self.header
        left = self.file_size
        with self.path.open("rb") as f:
            while left > 0 and (chunk := f.read(min(1024 * 1024, left))):
                left -= len(chunk)
                yield chunk
        yield self.trailer


_TAR_MEDIA = {"application/vnd.oci.image.layer.v1.tar": "tar", "application/vnd.oci.image.layer.v1.tar+gzip": "tar+gzip",
              "application/vnd.oci.image.layer.v1.tar+zstd": "tar+zstd",
              "application/vnd.docker.image.rootfs.diff.tar.gzip": "tar+gzip"}


def _annotations(layer: dict) -> dict:
    return layer.get("annotations") if isinstance(layer.get("annotations"), dict) else {}


def _tar_kind(layer: dict) -> str:
    """"tar", "tar+gzip" or "tar+zstd" for a layer that packs a folder, else
    "". `oras push` labels a plain file ...layer.v1.tar too, so a titled plain
    tar is a file unless marked for unpacking (oras-go's annotation); a
    folder oras packs is ...tar+gzip (oras-py marks it no other way); a
    ModelPack layer says so in its type (`...v1.tar`, `+gzip`, `+zstd`); an
    image layer has no title."""
    annotations = _annotations(layer)
    media = str(layer.get("mediaType", ""))
    if media.startswith("application/vnd.cncf.model."):
        packing = media.rsplit(".v1.", 1)[-1]
        return packing if packing in ("tar", "tar+gzip", "tar+zstd") else ""
    kind = _TAR_MEDIA.get(media, "")
    if not kind:
        return ""
    packed = annotations.get("io.deis.oras.content.unpack") == "true" or kind.startswith("tar+")
    return kind if packed or (TITLE not in annotations and MODELPACK_PATH not in annotations) else ""


def _file_digest(path: Path) -> tuple[str, int]:
    hasher, size = hashlib.sha256(), 0
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1024 * 1024), b""):
            hasher.update(chunk)
            size += len(chunk)
    return "sha256:" + hasher.hexdigest(), size


def _file_chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as body:
        yield from iter(lambda: body.read(1024 * 1024), b"")


_WEIGHT_SUFFIXES = (".onnx", ".gguf", ".safetensors", ".bin", ".pt", ".pt2", ".mlmodel", ".data")


def _layer_media(rel: str, packing: str = "raw") -> str:
    """ModelPack's layer type for a file: weights, their configuration
    (config.json, tokenizers, vocab.txt, model.toml), documentation or code,
    packed as `packing` ("raw" or "tar")."""
    name = rel.lower()
    base = name.rsplit("/", 1)[-1]
    if name.endswith(_WEIGHT_SUFFIXES):
        kind = "weight"
    elif base.endswith(".md") or base.startswith(("license", "readme", "notice", "copying")):
        kind = "doc"
    elif base.endswith((".py", ".sh")):
        kind = "code"
    else:
        kind = "weight.config"
    return f"application/vnd.cncf.model.{kind}.v1.{packing}"


def _guess_format(files: list[Path]) -> str:
    for suffix, name in ((".gguf", "gguf"), (".onnx", "onnx"), (".safetensors", "safetensors")):
        if any(p.name.endswith(suffix) for p in files):
            return name
    return ""
