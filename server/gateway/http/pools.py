"""Where each node serves HTTP, and one keep-alive connection pool per node.

The ring knows a node by its gRPC address. Its HTTP address is, first
found: the operator's explicit mapping (`--node-http GRPC=HTTP`), the port
the node advertises in its Stats (`http_port`, where the daemon sends one),
or `node_http_port` on the node's gRPC host (a StatefulSet whose pods all
serve HTTP on one port). Toward the nodes the gateway speaks HTTP/1.1 over
a keep-alive pool per node (client.py), with TLS when --node-tls-ca is set
(the CA, client certificate and server name the gRPC channels use).
"""

from __future__ import annotations

import ssl

import grpc
import structlog

from modeld.server.gateway.config import GatewaySettings
from modeld.server.gateway.failure import CallFailed
from modeld.server.gateway.http.client import NodePool
from modeld.server.gateway.nodes import Fleet, Node

log = structlog.get_logger("modeld.gateway")


def parse_mapping(entries: tuple[str, ...]) -> dict[str, str]:
    """`GRPC_HOST:PORT=HTTP_HOST:PORT` entries as a dict (checked by config.py)."""
    return dict(entry.split("=", 1) for entry in entries)


def node_tls_context(s: GatewaySettings) -> ssl.SSLContext | None:
    """The client TLS context toward the nodes' HTTP ports; None: plaintext."""
    if not s.node_tls_ca:
        return None
    context = ssl.create_default_context(cafile=s.node_tls_ca)
    if s.node_tls_cert:
        context.load_cert_chain(s.node_tls_cert, s.node_tls_key)
    return context


class NodePools:
    """A connection pool per node, made on first use and closed when the node
    leaves the fleet (or moves to another HTTP address)."""

    def __init__(self, fleet: Fleet, settings: GatewaySettings) -> None:
        self.fleet, self.settings = fleet, settings
        self.mapping = parse_mapping(settings.node_http)
        self.tls = node_tls_context(settings)
        self._clients: dict[str, tuple[str, NodePool]] = {}
        self._unmapped_logged: set[str] = set()
        fleet.listeners.append(self._prune)

    def http_address(self, node: Node) -> str | None:
        mapped = self.mapping.get(node.address)
        if mapped:
            return mapped
        host = node.address.rpartition(":")[0]
        advertised = getattr(node.stats, "http_port", 0) if node.stats is not None else 0
        port = advertised or self.settings.node_http_port
        return f"{host}:{port}" if port else None

    def client(self, node: Node) -> NodePool:
        """The node's pool; UNAVAILABLE naming the fix when the gateway does
        not know where it serves HTTP (routing then tries another node)."""
        address = self.http_address(node)
        if address is None:
            if node.address not in self._unmapped_logged:
                self._unmapped_logged.add(node.address)
                log.warning("node_http_unknown", node=node.name, address=node.address,
                            hint="give --node-http GRPC=HTTP or gateway.node_http_port")
            raise CallFailed(grpc.StatusCode.UNAVAILABLE,
                             f"the gateway does not know node {node.name}'s HTTP address: give it "
                             f"--node-http {node.address}=HOST:HTTP_PORT or gateway.node_http_port")
        known = self._clients.get(node.address)
        if known is not None and known[0] == address:
            return known[1]
        if known is not None:
            known[1].close()
        s = self.settings
        host, _, port = address.rpartition(":")
        # no read deadline: a generation may stream for minutes; a frozen node
        # is found by its Stats probes (nodes.py), which cancel the calls
        # waiting on it. Idle connections close after 30 s, before the
        # daemon's 75 s keep-alive, so the gateway never races a closing server.
        client = NodePool(host, int(port), tls=self.tls,
                          # the name checked in each node's certificate (nodes dialled by IP), as gRPC's
                          server_hostname=s.node_tls_server_name or host.strip("[]"),
                          max_idle=s.http_node_keepalive, idle_s=30.0, connect_timeout_s=s.http_connect_timeout_s)
        self._clients[node.address] = (address, client)
        return client

    def _prune(self) -> None:
        for address in list(self._clients):
            if address not in self.fleet.by_address:
                self._clients.pop(address)[1].close()

    async def close(self) -> None:
        for _, client in self._clients.values():
            client.close()
        self._clients.clear()
