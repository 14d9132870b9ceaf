"""Model source URIs: oci://registry/repo:tag or @sha256:..., s3://bucket/prefix/,
hf://org/name[@revision]."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl

from modeld.backends.errors import InvalidArgument
from modeld.backends.model_config import STORE_SCHEMES

MAX_URI = 2048

_REPO_RE = re.compile(r"[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*")
_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
_HOST_RE = re.compile(r"[A-Za-z0-9.-]+(?::[0-9]{1,5})?|\[[0-9a-fA-F:]+\](?::[0-9]{1,5})?")
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_HF_REPO_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(?:/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?")
_HF_REV_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_./-]{0,127}")


@dataclass(frozen=True)
class SourceURI:
    scheme: str
    text: str
    host: str = ""  # oci: the registry
    path: str = ""  # oci: repository; s3: key prefix; hf: org/name
    reference: str = ""  # oci: tag or digest; hf: revision; s3: bucket
    options: tuple[tuple[str, str], ...] = ()  # ?include=... (hf)

    @property
    def is_digest(self) -> bool:
        return self.reference.startswith("sha256:")

    def option(self, key: str, default: str = "") -> str:
        return dict(self.options).get(key, default)


def parse_uri(text: object) -> SourceURI:
    if not isinstance(text, str) or not text:
        raise InvalidArgument("a model source must be a URI string such as oci://registry/repo:tag")
    if len(text) > MAX_URI:
        raise InvalidArgument(f"model source URI is {len(text)} characters; at most {MAX_URI}")
    scheme, sep, rest = text.partition("://")
    if not sep:
        raise InvalidArgument(f"model source {text[:80]!r} is not a URI; use one of "
                              + ", ".join(f"{s}://" for s in STORE_SCHEMES))
    if scheme not in STORE_SCHEMES:
        raise InvalidArgument(f"model source scheme {scheme[:20]!r} is not known; modeld pulls from "
                              + ", ".join(f"{s}://" for s in STORE_SCHEMES))
    return {"oci": _oci, "s3": _s3, "hf": _hf}[scheme](text, rest)


def _oci(text: str, rest: str) -> SourceURI:
    host, _, repo = rest.partition("/")
    if "@" in repo:
        repo, _, reference = repo.partition("@")
        if not _DIGEST_RE.fullmatch(reference):
            raise InvalidArgument(f"{text}: a digest reference is @sha256:<64 hex digits>")
    else:
        last = repo.rsplit("/", 1)[-1]
        if ":" in last:
            repo, _, reference = repo.rpartition(":")
            if not _TAG_RE.fullmatch(reference):
                raise InvalidArgument(f"{text}: tag {reference!r} is not a valid OCI tag")
        else:
            reference = "latest"
    if not _HOST_RE.fullmatch(host) or not _REPO_RE.fullmatch(repo or "") or len(repo) > 255:
        raise InvalidArgument(f"{text}: expected oci://registry[:port]/repository[:tag|@sha256:...] "
                              "(lower-case repository path)")
    return SourceURI("oci", text, host=host, path=repo, reference=reference)


def _s3(text: str, rest: str) -> SourceURI:
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET_RE.fullmatch(bucket) or ".." in prefix or "\x00" in prefix:
        raise InvalidArgument(f"{text}: expected s3://bucket/prefix/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"  # a folder, not every key that starts with the same letters
    return SourceURI("s3", text, path=prefix, reference=bucket)


def _hf(text: str, rest: str) -> SourceURI:
    rest, _, query = rest.partition("?")
    repo, _, revision = rest.partition("@")
    if not _HF_REPO_RE.fullmatch(repo) or ".." in repo or (revision and (not _HF_REV_RE.fullmatch(revision)
                                                                        or ".." in revision)):
        raise InvalidArgument(f"{text}: expected hf://org/name[@revision][?include=<pattern>]")
    options = tuple(parse_qsl(query, keep_blank_values=False))
    unknown = sorted({k for k, _ in options} - {"include"})
    if unknown:
        raise InvalidArgument(f"{text}: unknown option {unknown[0]!r}; hf:// takes ?include=<file pattern>")
    return SourceURI("hf", text, path=repo, reference=revision or "main", options=options)
