"""The import direction, as tests: backends never know the server, the server
reaches backends only through their contract, and starting the daemon loads
no ML runtime until a model needs it."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# What server/ may import from modeld.backends: the contract every backend
# implements and the vocabulary the engine and the services share with it.
# Anything else is one backend's implementation, which the server reaches only
# through the registry, so a backend can change its insides (or be missing
# on this machine) without the server noticing.
SERVER_MAY_IMPORT = {
    "modeld.backends.base",  # Backend, LoadedModel, GenerativeModel, Capability, Verdict
    "modeld.backends.errors",  # the error kinds the services map onto status codes
    "modeld.backends.model_config",  # ModelConfig, parsed by the repository
    "modeld.backends.options",  # the typed backend options inside ModelConfig
    "modeld.backends.registry",  # the one door to implementations, imported lazily by name
    "modeld.backends.dtypes",  # datatype tables the wire conversion shares with backends
    "modeld.backends.sizes",  # byte sizes in configs and the memory budget
    "modeld.backends.digits",  # ascii_digits: whole numbers in text a caller or operator writes
    "modeld.backends.generation.params",  # request, event and usage types of generation
    "modeld.backends.generation.step_sink",  # STEP_SINK: how a worker takes a generation's events on its step thread
    "modeld.backends.load_policy",  # the settings' LoadPolicy the engine stamps into each ModelConfig
    "modeld.backends.artifact_paths",  # scrub_paths: a failed load's reasons without the daemon's paths
}

# Known exceptions, each with its reason. `modeld prepare` builds model
# artifacts offline (make models) and drives llama.cpp's quantizer; it never
# runs inside the daemon. It borrows the llama.cpp log silencer rather than
# copying its ctypes callback, whose lifetime is subtle.
ALLOWED_EXCEPTIONS = {
    ("server/prepare.py", "modeld.backends.llamacpp.context"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["modeld", *parts])


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (lazy imports inside functions
    count: they run too), relative imports resolved and `from pkg import mod`
    counted as pkg.mod."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Call):
            # importlib.import_module("x") / __import__("x") with a literal name
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                if isinstance(node.args[0].value, str):
                    found.add(node.args[0].value)
    return found


def _files(folder: str, at_least: int = 6) -> list[Path]:
    files = sorted((ROOT / folder).rglob("*.py"))
    assert len(files) >= at_least, f"found only {files} under {folder}/: is ROOT right?"
    return files


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


# Packages whose __init__ runs on the way to an allowed module; only the
# package itself is allowed, not what lies under it.
_PASSED_THROUGH = {"modeld.backends", "modeld.backends.generation"}


def _contract(module: str) -> bool:
    # `from modeld.backends.errors import InvalidArgument` shows up as
    # modeld.backends.errors.InvalidArgument: within an allowed module is fine
    return module in _PASSED_THROUGH or any(_within(module, allowed) for allowed in SERVER_MAY_IMPORT)


def test_the_import_scanner_sees_imports():
    # guards the two tests below from passing because they saw nothing
    assert "modeld.backends.registry" in imported_modules(ROOT / "server/app.py")
    assert "modeld.backends.llamacpp.context" in imported_modules(ROOT / "backends/llamacpp/backend.py")


def test_backends_never_import_the_server():
    offenders = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in _files("backends")
        for module in sorted(imported_modules(path))
        if _within(module, "modeld.server")
    ]
    assert not offenders, "backends must not know the server (errors travel as backends.errors kinds):\n" + "\n".join(offenders)


def test_the_server_imports_backends_only_through_their_contract():
    offenders = []
    for path in _files("server"):
        rel = str(path.relative_to(ROOT))
        for module in sorted(imported_modules(path)):
            if not _within(module, "modeld.backends") or _contract(module):
                continue
            if any(rel == where and _within(module, allowed) for where, allowed in ALLOWED_EXCEPTIONS):
                continue
            offenders.append(f"{rel} imports {module}")
    assert not offenders, (
        "the server reaches a backend's implementation only through modeld.backends.registry; "
        "import the contract instead, or add a module to SERVER_MAY_IMPORT with the reason it is contract:\n"
        + "\n".join(offenders)
    )


HEAVY_RUNTIMES = ("torch", "llama_cpp", "transformers")

# onnxruntime is not on the list: OnnxBackend.availability imports it on
# purpose, since ONNX is the daemon's default tensor backend and a broken
# install should show as "unavailable" at start, not at the first load.
_PROBE = f"""
import json, sys
import modeld.server.app
from modeld.backends.registry import BackendRegistry
registry = BackendRegistry()
print(json.dumps({{
    "loaded": [m for m in {HEAVY_RUNTIMES!r} if m in sys.modules],
    "backends": {{e.name: e.availability.ok for e in registry.entries()}},
}}))
"""


def test_starting_the_daemon_loads_no_ml_runtime():
    # a fresh interpreter: this test process may have imported torch already
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(report["backends"]) >= {"torch", "llamacpp"}, report  # the registry did look at both
    assert report["loaded"] == [], (
        f"importing the daemon and building the backend registry imported {report['loaded']}; "
        "a backend must import its runtime in load(), and check for it in availability() with "
        "importlib.util.find_spec"
    )


# What a front (a gRPC service or an HTTP route) may import from the server:
# the data plane, and the vocabulary it decodes into and encodes from. The
# engine, the repository, the memory books and the workers stay behind the
# data plane, so a front cannot grow a second answer to "which model".
FRONTS = ("server/services", "server/http")
FRONT_MAY_IMPORT = {
    "modeld.server.dataplane",
    "modeld.server.requests",  # InferRequest, ModelState: what the data plane takes and gives
    "modeld.server.request_context",  # the call's id and protocol
    "modeld.server.lifecycle",  # draining, read by health answers
    "modeld.server.stats",  # figures the statistics RPCs encode
    "modeld.server.rerank",  # the rerank parameters' names
    "modeld.server.tool_calls",  # tool choice and call reading shared by the OpenAI and gRPC fronts (no engine in it)
    "modeld.server.workers.kv_cache",  # a prefix cache read as gateways are told of it, in the daemon or a worker (no engine in it)
    "modeld.server.auth",
    "modeld.server.metrics",
    "modeld.server.services",
    "modeld.server.http",
}


def _server_imports(folder: str):
    for path in _files(folder, at_least=2):
        for module in sorted(imported_modules(path)):
            if _within(module, "modeld.server"):
                yield str(path.relative_to(ROOT)), module


def test_fronts_reach_the_engine_only_through_the_data_plane():
    offenders = [f"{where} imports {module}" for folder in FRONTS for where, module in _server_imports(folder)
                 if not any(_within(module, allowed) for allowed in FRONT_MAY_IMPORT)]
    assert not offenders, "a front decodes, calls modeld.server.dataplane and encodes:\n" + "\n".join(offenders)


_ENGINE_PARTS = {"served", "loading", "accounting", "health", "failover", "dispatch", "deadlines"}


def test_nothing_imports_the_engine_s_parts():
    offenders = [f"{where} imports {module}" for folder in ("server", "backends", "clients")
                 for where, module in _server_imports(folder)
                 if not where.startswith("server/engine/") and _engine_part(module)]
    assert not offenders, "import Engine and ServedModel from modeld.server.engine, not its parts:\n" + "\n".join(offenders)


def _engine_part(module: str) -> bool:
    parts = module.split(".")
    return parts[:3] == ["modeld", "server", "engine"] and len(parts) > 3 and parts[3] in _ENGINE_PARTS


def test_the_engine_s_parts_are_known_to_the_layering_test():
    # the rule above names the parts: a new one must be named there too
    found = {p.stem for p in (ROOT / "server/engine").glob("*.py")} - {"__init__"}
    assert found == _ENGINE_PARTS


def test_the_gateway_never_imports_the_daemon():
    daemon = ("modeld.server.app", "modeld.server.engine", "modeld.server.dataplane", "modeld.server.services",
              "modeld.server.http")
    offenders = [f"{where} imports {module}" for where, module in _server_imports("server/gateway")
                 if any(_within(module, d) for d in daemon)]
    assert not offenders, "the gateway forwards calls; it shares modules with the daemon, never the daemon:\n" + "\n".join(offenders)
