"""The Hugging Face Hub through huggingface_hub: hf://org/name[@revision][?include=glob,...].

huggingface_hub answers which files a revision holds (with the LFS files'
sha256, checked after download), where the hub is (HF_ENDPOINT), the token
(HF_TOKEN or the saved login) and whether to stay offline (HF_HUB_OFFLINE).
Without ?include the files the backends need are picked: an ONNX graph with
its tokenizer and config; else safetensors weights, config and tokenizer;
else one GGUF (Q4_K_M where the repository has several).
"""

from __future__ import annotations

import fnmatch
from urllib.parse import quote
from typing import Iterator

import httpx

from modeld.backends.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable

from .cache import MAX_FILES, Listing, RemoteFile, TransferBroken, safe_path
from .uri import SourceURI

_SIDE_FILES = ("*.json", "tokenizer.model", "*.tiktoken", "vocab.txt", "merges.txt", "*.jinja", "model.toml")
_PREFERRED_QUANT = "Q4_K_M"


def select_files(names: list[str], include: str = "") -> list[str]:
    """The files of a repository a backend needs (or those `include` matches)."""
    if include:
        patterns = [p for p in include.split(",") if p]
        return [n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)]

    def matching(*patterns: str) -> list[str]:
        return [n for n in names if any(fnmatch.fnmatch(n.rsplit("/", 1)[-1], p) for p in patterns)]

    side = [n for n in matching(*_SIDE_FILES) if "/" not in n or n.startswith("onnx/")]
    if matching("*.onnx"):
        return sorted(set(matching("*.onnx", "*.onnx.data", "*.onnx_data") + side))
    if matching("*.safetensors"):
        return sorted(set(matching("*.safetensors") + [n for n in side if "/" not in n]))
    ggufs = sorted(matching("*.gguf"))
    if ggufs:
        preferred = [n for n in ggufs if _PREFERRED_QUANT.lower() in n.lower()]
        return sorted({(preferred or ggufs)[0], *[n for n in side if "/" not in n and n.endswith("model.toml")]})
    return []


class HfSource:
    def listing(self, uri: SourceURI) -> Listing:
        from huggingface_hub import HfApi, constants
        from huggingface_hub.errors import (
            GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError, RevisionNotFoundError,
        )
        from huggingface_hub.utils import build_hf_headers

        if constants.HF_HUB_OFFLINE:
            raise Unavailable(f"{uri.text}: the Hugging Face Hub is off (HF_HUB_OFFLINE) and the model is not "
                              "in the store's cache")
        api = HfApi(endpoint=constants.ENDPOINT)
        try:
            info = api.model_info(uri.path, revision=uri.reference, files_metadata=True)
        except (RepositoryNotFoundError, RevisionNotFoundError):
            raise NotFound(f"{uri.text}: the hub has no such model or revision (or it is private and "
                           "HF_TOKEN is not set)") from None
        except GatedRepoError:
            raise FailedPrecondition(f"{uri.text}: the model is gated; accept its terms and set HF_TOKEN") from None
        except OfflineModeIsEnabled:
            raise Unavailable(f"{uri.text}: the Hugging Face Hub is off (HF_HUB_OFFLINE)") from None
        except HfHubHTTPError as exc:
            code = exc.response.status_code if exc.response is not None else 0
            raise Unavailable(f"{uri.text}: the hub answered {code or type(exc).__name__}; try again later") from None
        except (httpx.TransportError, OSError) as exc:
            raise Unavailable(f"{uri.text}: the hub cannot be reached ({type(exc).__name__}); check HF_ENDPOINT "
                              "or the network") from None
        siblings = {s.rfilename: s for s in (info.siblings or [])}
        if len(siblings) > 10 * MAX_FILES:
            raise InvalidArgument(f"{uri.text}: the repository lists {len(siblings)} files")
        chosen = select_files(sorted(siblings), uri.option("include"))
        if not chosen:
            raise InvalidArgument(f"{uri.text}: no file a backend can load (ONNX, safetensors or GGUF)"
                                  + (f" matches include={uri.option('include')!r}" if uri.option("include") else ""))
        commit = info.sha or uri.reference
        headers = build_hf_headers()
        files = []
        for name in chosen:
            sibling = siblings[name]
            lfs = sibling.lfs
            digest = f"sha256:{lfs.sha256}" if lfs is not None and getattr(lfs, "sha256", None) else None
            size = sibling.size if sibling.size is not None else (lfs.size if lfs is not None else None)
            # the hub's resolve route (what hf_hub_url builds, from the endpoint read now, not at import)
            url = f"{constants.ENDPOINT.rstrip('/')}/{uri.path}/resolve/{quote(commit, safe='')}/{quote(name)}"
            files.append(RemoteFile(safe_path(name, uri.text), size, digest, _fetch(url, headers, uri),
                                    f"file {name}"))
        return Listing(uri.text, f"hf:{uri.path}@{commit}:{','.join(chosen)}", tuple(files))


def _fetch(url: str, headers: dict, uri: SourceURI):
    def fetch(offset: int) -> tuple[Iterator[bytes], int]:
        request_headers = dict(headers)
        if offset:
            request_headers["Range"] = f"bytes={offset}-"
        client = httpx.Client(timeout=httpx.Timeout(60.0, connect=10.0), follow_redirects=True)
        try:
            response = client.send(client.build_request("GET", url, headers=request_headers), stream=True)
        except httpx.TransportError as exc:
            client.close()
            raise TransferBroken(type(exc).__name__) from None
        if response.status_code >= 300:
            response.close()
            client.close()
            if response.status_code in (401, 403):
                raise FailedPrecondition(f"{uri.text}: the hub refused the download ({response.status_code}); "
                                         "set HF_TOKEN")
            if response.status_code == 404:
                raise NotFound(f"{uri.text}: the hub has no {url.rsplit('/', 1)[-1]}")
            raise Unavailable(f"{uri.text}: the hub answered {response.status_code}; try again later")
        start = offset if response.status_code == 206 else 0

        def chunks() -> Iterator[bytes]:
            try:
                yield from response.iter_bytes()
            except (httpx.TransportError, httpx.StreamError) as exc:
                raise TransferBroken(type(exc).__name__) from None
            finally:
                response.close()
                client.close()
        return chunks(), start
    return fetch
