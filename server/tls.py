"""Server TLS for the gRPC port and the HTTP front, reloadable on SIGHUP.

gRPC asks a certificate-configuration fetcher on every new handshake
(grpc.dynamic_ssl_server_credentials); it gets a new configuration once
after a reload and None (keep the current one) otherwise. Connections
already up keep the keys they shook hands with, so calls in flight finish.
The HTTP front does the same through the SSL context's SNI callback, which
OpenSSL runs on every handshake (with or without SNI) and which may switch
the connection to the newest context before the certificate is sent.

Files are read and checked together (cert matches key, CA parses) before
anything changes: a reload that fails keeps serving the old certificates.
"""

from __future__ import annotations

import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

log = structlog.get_logger("modeld.tls")


class TlsError(ValueError):
    """Unusable certificate files; the message names the file."""


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    client_ca: Path | None = None  # set: clients need a certificate this CA signed


@dataclass(frozen=True)
class _Loaded:
    grpc_config: object  # grpc.ServerCertificateConfiguration
    http_context: ssl.SSLContext


def _read(path: Path, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise TlsError(f"{what} file {path} does not exist") from None
    except OSError as exc:
        raise TlsError(f"cannot read {what} file {path}: {exc.strerror}") from None
    if b"-----BEGIN" not in data:
        raise TlsError(f"{what} file {path} is not PEM (no '-----BEGIN' line)")
    return data


def _load(files: TlsFiles) -> _Loaded:
    cert = _read(files.cert, "TLS certificate")
    key = _read(files.key, "TLS key")
    client_ca = _read(files.client_ca, "client CA") if files.client_ca is not None else None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(files.cert, files.key)
    except ssl.SSLError as exc:
        raise TlsError(f"TLS certificate {files.cert} and key {files.key} do not make a pair ({exc.reason})") from None
    if client_ca is not None:
        try:
            context.load_verify_locations(cadata=client_ca.decode("ascii", "replace"))
        except ssl.SSLError as exc:
            raise TlsError(f"client CA file {files.client_ca} holds no usable certificate ({exc.reason})") from None
        context.verify_mode = ssl.CERT_REQUIRED
    grpc_config = grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=client_ca)
    return _Loaded(grpc_config, context)


def check_files(files: TlsFiles) -> None:
    """Raise TlsError when the files could not serve TLS (for start-up checks)."""
    _load(files)


class ServerTls:
    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._loaded = _load(files)
        self._initial = self._loaded.grpc_config
        self._pending = None  # a configuration gRPC has not fetched yet
        self._lock = threading.Lock()  # gRPC calls the fetcher from its own threads

    @property
    def mutual(self) -> bool:
        return self.files.client_ca is not None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self._initial, self._fetch,
                                                   require_client_authentication=self.mutual)

    def _fetch(self):
        with self._lock:
            config, self._pending = self._pending, None
        return config

    def reload(self) -> bool:
        try:
            loaded = _load(self.files)
        except TlsError as exc:
            log.error("tls_reload_failed", reason=str(exc))
            return False
        with self._lock:
            self._loaded = loaded
            self._pending = loaded.grpc_config
        log.info("tls_reloaded", cert=str(self.files.cert), client_ca=str(self.files.client_ca or ""))
        return True

    def http_context(self) -> ssl.SSLContext:
        """The context the HTTP server listens with; later handshakes move to
        the newest one in its SNI callback."""
        context = self._loaded.http_context
        context.sni_callback = self._use_newest
        return context

    def _use_newest(self, ssl_object, _server_name, context) -> None:
        newest = self._loaded.http_context
        if newest is not context:
            ssl_object.context = newest
        return None


def add_port(server: grpc.aio.Server, address: str, tls: ServerTls | None) -> int:
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.grpc_credentials())


def reload_credentials(tls, auth) -> None:
    """SIGHUP, for the daemon and the gateway alike: reread certificates
    (a ServerTls) and tokens (an Authenticator), either of which may be None.
    New handshakes and calls use them; connections and calls in flight are
    left alone. A file that fails to load keeps the old credentials (logged)."""
    if tls is None and auth is None:
        log.info("reload_skipped", reason="no TLS or token file configured")
        return
    if tls is not None:
        tls.reload()
    if auth is not None:
        auth.reload()
