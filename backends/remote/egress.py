"""What a remote model may reach and send, checked at load before any byte
leaves the daemon.

A remote model's [remote] table may come from a client (an inline load), so
on its own it must not be able to make the daemon read a secret or call a
host the operator did not mean:

- `api_key_env` must be on the operator's list (setting remote_api_key_envs):
  otherwise any variable of the daemon's environment could be sent as a
  bearer token to a URL the caller chose;
- a key never travels over plain http, except to loopback;
- with remote_allowed_hosts set, the engine's host must be on it;
- link-local addresses and cloud metadata services (169.254.0.0/16,
  fe80::/10, metadata.google.internal, ...) are refused after resolving the
  host, unless the host is on remote_allowed_hosts by name.

URLs shown in errors and logs lose their userinfo (`redact_url`).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from modeld.backends.errors import InvalidArgument
from modeld.backends.load_policy import LoadPolicy

# names that are, or resolve to, a cloud provider's instance metadata service
METADATA_HOSTS = frozenset({
    "metadata", "metadata.google.internal", "metadata.goog", "metadata.azure.com", "instance-data",
    "instance-data.ec2.internal", "metadata.tencentyun.com", "metadata.platformequinix.com",
})
# metadata addresses outside the link-local ranges (AWS's IPv6 one, Alibaba's, Oracle's)
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "169.254.170.2", "fd00:ec2::254", "100.100.100.200", "192.0.0.192",
))
_USERINFO_RE = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s]*@")


class EgressRefused(InvalidArgument):
    """A remote model's config asks for something the operator did not allow."""


@dataclass(frozen=True)
class Destination:
    """A remote engine's URL, checked: where it resolved, whether it is loopback."""

    url: str
    host: str
    addresses: tuple[str, ...]

    @property
    def is_loopback(self) -> bool:
        return bool(self.addresses) and all(ipaddress.ip_address(a).is_loopback for a in self.addresses)


def check_destination(model: str, url: str, policy: LoadPolicy, resolve=None) -> Destination:
    """The engine's host checked against the policy and resolved; raises
    EgressRefused naming the reason and the setting that would allow it."""
    parts = urlsplit(url)
    host = (parts.hostname or "").rstrip(".").lower()
    allowed = {h.rstrip(".").lower() for h in policy.remote_allowed_hosts}
    shown = redact_url(url)
    if allowed and host not in allowed:
        raise EgressRefused(f"model {model!r}: [remote] url {shown} is not on the hosts the operator allows "
                            "remote engines at (setting remote_allowed_hosts)")
    addresses = _addresses(model, host, parts.port or (443 if parts.scheme == "https" else 80), shown, resolve)
    if host not in allowed:
        forbidden = host in METADATA_HOSTS or any(_is_forbidden(a) for a in addresses)
        if forbidden:
            raise EgressRefused(f"model {model!r}: [remote] url {shown} is a link-local or cloud metadata address, "
                                "which remote engines may not use unless an operator names the host in the "
                                "setting remote_allowed_hosts")
    return Destination(url, host, addresses)


def check_api_key_env(model: str, name: str, policy: LoadPolicy) -> None:
    if name and name not in policy.remote_api_key_envs:
        allowed = ", ".join(sorted(policy.remote_api_key_envs)) or "none"
        raise EgressRefused(f"model {model!r}: [remote] api_key_env {name} is not a variable the operator lets "
                            f"remote models send (setting remote_api_key_envs; allowed now: {allowed})")


def check_key_transport(model: str, destination: Destination) -> None:
    """A key goes over TLS, or to this machine."""
    if urlsplit(destination.url).scheme != "https" and not destination.is_loopback:
        raise EgressRefused(f"model {model!r}: [remote] api_key_env would send its key in clear text to "
                            f"{redact_url(destination.url)}; use an https:// URL (plain http carries a key only "
                            "to loopback)")


def redact_url(url: str) -> str:
    """`url` without its userinfo (user:password@)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return redact_text(url)
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


def redact_text(text: str) -> str:
    """Every URL in `text` without its userinfo."""
    return _USERINFO_RE.sub(r"\1", text)


def _addresses(model: str, host: str, port: int, shown: str, resolve) -> tuple[str, ...]:
    try:
        return (str(ipaddress.ip_address(host)),)
    except ValueError:
        pass
    try:
        infos = (resolve or socket.getaddrinfo)(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        # unresolvable now: the load's first call fails as unreachable; a
        # name that never resolves reaches nothing, metadata included
        return ()
    return tuple(sorted({_unscoped(info[4][0]) for info in infos}))


def _unscoped(address: str) -> str:
    return address.split("%", 1)[0]  # fe80::1%eth0


def _is_forbidden(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    if mapped is not None:
        ip = mapped
    return ip.is_link_local or ip in METADATA_ADDRESSES or ip.is_multicast or ip.is_unspecified
