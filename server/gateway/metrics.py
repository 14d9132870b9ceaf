"""The gateway's Prometheus metrics (one registry per gateway process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BREAKER_VALUE = {"closed": 0, "half_open": 1, "open": 2}


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.picks = Counter("modeld_gateway_picks", "Calls sent to a node, by why it was chosen "
                             "(ring, p2c, spill, prefix, kv, update, any, hedge)", ["node", "reason"], registry=r)
        self.calls = Counter("modeld_gateway_calls", "Calls answered, by method and gRPC status",
                             ["method", "status"], registry=r)
        self.latency = Histogram("modeld_gateway_call_seconds", "Call latency through the gateway",
                                 ["method"], buckets=_LATENCY_BUCKETS, registry=r)
        self.breaker_state = Gauge("modeld_gateway_breaker_state", "Circuit breaker per node: 0 closed, "
                                   "1 half-open, 2 open", ["node"], registry=r)
        self.breaker_transitions = Counter("modeld_gateway_breaker_transitions", "Breaker state changes",
                                           ["node", "from_state", "to_state"], registry=r)
        self.split_calls = Counter("modeld_gateway_split_calls", "Calls for a split model sent to one of its "
                                   "targets", ["model", "target"], registry=r)
        self.hedges_fired = Counter("modeld_gateway_hedges_fired", "Hedged copies sent", ["model"], registry=r)
        self.hedges_won = Counter("modeld_gateway_hedges_won", "Hedged copies that answered first", ["model"],
                                  registry=r)
        self.retries = Counter("modeld_gateway_retries", "Calls retried on another node after UNAVAILABLE",
                               ["method"], registry=r)
        self.score = Gauge("modeld_gateway_node_score", "Health score per node, 0..1", ["node"], registry=r)
        self.in_flight = Gauge("modeld_gateway_node_in_flight", "Calls in flight per node", ["node"], registry=r)
        self.serving = Gauge("modeld_gateway_node_serving", "1 while the node's health says SERVING",
                             ["node"], registry=r)
        self.nodes = Gauge("modeld_gateway_nodes", "Nodes known to the gateway", registry=r)
        self.kv_models = Gauge("modeld_gateway_node_kv_models", "Models whose prefix-cache blocks the node "
                               "publishes to the gateway (KV-aware routing)", ["node"], registry=r)
        self.kv_blocks = Gauge("modeld_gateway_node_kv_blocks", "Prefix-cache blocks the gateway's index holds "
                               "for the node", ["node"], registry=r)
        self.admitted = Gauge("modeld_gateway_node_admitted", "1 once the node proved it holds the fleet token "
                              "(or no proof is asked: TLS to the nodes, or no token)", ["node"], registry=r)
