"""Prometheus metrics per replica, read from the :class:`ReplicaSet` at scrape time.

Every family carries a ``replica`` label (the replica's name):

* ``prefixgate_replica_healthy`` (1/0), ``prefixgate_replica_in_flight``,
  ``prefixgate_replica_index_blocks`` (keys its index holds: from KV events, or
  remembered from routing history when it publishes none);
* counters ``prefixgate_replica_requests_total`` (routed to it, retries included),
  ``prefixgate_replica_unreachable_total`` (connections that failed before
  anything was sent, each retried elsewhere when possible),
  ``prefixgate_replica_predicted_cached_tokens_total`` and
  ``prefixgate_replica_reported_cached_tokens_total`` (over the requests that had
  both a prediction and a reported ``cached_tokens``),
  ``prefixgate_replica_exact_predictions_total`` out of
  ``prefixgate_replica_compared_predictions_total``,
  ``prefixgate_replica_kv_event_batches_total``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.routing.replicas import ReplicaSet


class ReplicaCollector(Collector):
    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        gauges = {
            "healthy": ("1 when the replica is in the pool.", lambda r: 1.0 if r.healthy else 0.0),
            "in_flight": ("Requests routed to the replica and not finished.", lambda r: r.in_flight),
            "index_blocks": ("Block keys the gateway's index holds for the replica.", lambda r: r.index.num_blocks),
            "queued_prefill_tokens": ("Tokens the in-flight requests were predicted to prefill.",
                                      lambda r: r.queued_prefill),
        }
        counters = {
            "requests": ("Requests routed to the replica.", lambda r: r.requests),
            "unreachable": ("Connections to the replica that failed before sending.", lambda r: r.retried_away),
            "stalls": ("Times the replica sent nothing for the idle timeout and missed its health probe.",
                       lambda r: r.stalls),
            "predicted_cached_tokens": ("Cached tokens predicted at routing.", lambda r: r.predicted_tokens),
            "reported_cached_tokens": ("Cached tokens the replica reported (predicted requests).",
                                       lambda r: r.reported_tokens),
            "exact_predictions": ("Requests whose prediction equalled the reported cached tokens.",
                                  lambda r: r.predictions_exact),
            "compared_predictions": ("Requests with a prediction and reported cached tokens.",
                                     lambda r: r.predictions_compared),
            "kv_event_batches": ("KV-event batches applied.",
                                 lambda r: r.subscriber.batches if r.subscriber is not None else 0),
        }
        for name, (doc, value) in gauges.items():
            gauge = GaugeMetricFamily(f"prefixgate_replica_{name}", doc, labels=["replica"])
            for replica in self.replicas.replicas:
                gauge.add_metric([replica.name], float(value(replica)))
            yield gauge
        for name, (doc, value) in counters.items():
            counter = CounterMetricFamily(f"prefixgate_replica_{name}", doc, labels=["replica"])
            for replica in self.replicas.replicas:
                counter.add_metric([replica.name], float(value(replica)))
            yield counter
