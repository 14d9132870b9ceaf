"""`modeld pull` and `modeld push`.

`modeld pull URI --name N` asks a running daemon to load N from URI (the
daemon pulls into its own cache; the bar follows its PULLING status).
`modeld pull URI --cache-dir DIR` pulls into a cache folder without a
daemon, e.g. in an init container that warms a node's cache volume.
`modeld push FOLDER oci://registry/repo:tag [--layers raw|tar]` writes a
ModelPack artifact.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path


def add_store_args(sub, credential_args) -> None:
    p = sub.add_parser("pull", help="pull a model from oci://, s3:// or hf:// (into a daemon, or a cache folder)")
    p.add_argument("uri", help="oci://registry/repo:tag|@sha256:..., s3://bucket/prefix/ or hf://org/name[@rev]")
    p.add_argument("--name", help="the model's name in the daemon (default: the URI's last path part)")
    p.add_argument("--address", default="127.0.0.1:8001")
    p.add_argument("--cache-dir", dest="cache_dir", type=Path,
                   help="pull into this cache folder here instead of into a daemon")
    p.add_argument("--cache-budget", dest="cache_budget", default="50GiB", help="with --cache-dir: its disk budget")
    _registry_args(p)
    credential_args(p)
    p = sub.add_parser("push", help="push a model folder to an OCI registry as a ModelPack artifact")
    p.add_argument("folder", type=Path)
    p.add_argument("uri", help="oci://registry/repo:tag")
    p.add_argument("--format", dest="model_format", default="", help="onnx, gguf or safetensors (default: by files)")
    p.add_argument("--layers", dest="packing", choices=("raw", "tar"), default="raw",
                   help="each file as itself (raw, the default: `oras pull` gets the files) or in a tar archive "
                        "of its own (tar, as modctl packs)")
    _registry_args(p)


def _registry_args(p) -> None:
    p.add_argument("--plain-http", dest="plain_http", action="store_true",
                   help="reach the registry without TLS (a local registry)")
    p.add_argument("--registry-ca", dest="registry_ca", type=Path, help="PEM CA bundle the registry's certificate is "
                                                                        "signed by")
    p.add_argument("--registry-auth-file", dest="registry_auth_file", type=Path,
                   help="Docker config.json with the registry's credentials (default: ~/.docker/config.json)")


def default_name(uri_text: str) -> str:
    from .uri import parse_uri

    uri = parse_uri(uri_text)
    last = uri.path.rstrip("/").rsplit("/", 1)[-1] or uri.reference
    return last.replace(":", "-")


def _store(args, cache_dir: Path | None = None, budget: str = "1GiB"):
    import os

    from modeld.backends.sizes import parse_size

    from . import ModelStore, OciSettings, StoreSettings
    from .uri import parse_uri

    uri = parse_uri(args.uri)
    auth = args.registry_auth_file
    if auth is None:
        docker = os.environ.get("DOCKER_CONFIG")
        auth = (Path(docker) if docker else Path.home() / ".docker") / "config.json"
    oci = OciSettings(plain_http=(uri.host,) if args.plain_http else (), ca_file=args.registry_ca, auth_file=auth)
    return ModelStore(StoreSettings(cache_dir or Path.home() / ".cache" / "modeld" / "store", parse_size(budget),
                                    oci=oci))


def run_store_command(args, client_credentials) -> int:
    from modeld.backends.errors import ModeldError

    try:
        if args.command == "push":
            if not args.folder.is_dir():
                print(f"modeld: {args.folder} is not a folder", file=sys.stderr)
                return 2
            store = _store(args)
            digest = store.push(args.folder, args.uri, args.model_format, args.packing)
            print(f"pushed {args.uri}@{digest}")
            return 0
        if args.cache_dir is not None:
            return _pull_here(args)
        return _pull_into_daemon(args, client_credentials)
    except ModeldError as exc:
        print(f"modeld: {exc.kind.value}: {exc}", file=sys.stderr)
        return 1


def _pull_here(args) -> int:
    from . import Progress

    store = _store(args, args.cache_dir, args.cache_budget)
    progress = Progress()
    done = threading.Event()
    bar = threading.Thread(target=_show, args=(lambda: (progress.done, progress.total), done), daemon=True)
    bar.start()
    try:
        pulled = store.pull_sync(args.uri, progress)
    finally:
        done.set()
        bar.join()
    print(f"pulled {args.uri} into {pulled.folder}")
    return 0


def _pull_into_daemon(args, client_credentials) -> int:
    import grpc

    from modeld.clients import Client

    name = args.name or default_name(args.uri)
    with Client(args.address, **client_credentials(args)) as client:
        failure: list[BaseException] = []

        def load() -> None:
            try:
                client.load(name, config={"source": args.uri})
            except BaseException as exc:  # noqa: BLE001 - shown below, on the main thread
                failure.append(exc)

        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        done = threading.Event()

        def figures() -> tuple[int, int]:
            try:
                for m in client.models():
                    if m.name == name and m.state == "PULLING":
                        return _bytes_of(m.reason)
            except grpc.RpcError:
                pass
            return -1, -1
        bar = threading.Thread(target=_show, args=(figures, done), daemon=True)
        bar.start()
        loader.join()
        done.set()
        bar.join()
        if failure:
            exc = failure[0]
            if isinstance(exc, grpc.RpcError):
                print(f"modeld: {exc.code().name}: {exc.details()}", file=sys.stderr)
                return 1
            raise exc
    print(f"pulled {args.uri} and loaded it as {name}")
    return 0


def _bytes_of(reason: str) -> tuple[int, int]:
    # "pulling <uri>: <done> of <total> bytes"
    try:
        figures = reason.rsplit(": ", 1)[1].split()
        return int(figures[0]), int(figures[2])
    except (IndexError, ValueError):
        return -1, -1


def _show(figures, done: threading.Event) -> None:
    """A progress bar on stderr, where it is a terminal."""
    if not sys.stderr.isatty():
        done.wait()
        return
    from modeld.backends.sizes import format_size

    while not done.wait(0.2):
        got, total = figures()
        if total <= 0:
            continue
        width = 30
        filled = int(width * min(got, total) / total)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {format_size(got)} / {format_size(total)}")
        sys.stderr.flush()
    sys.stderr.write("\n")
