"""Data-parallel serving on Ray Serve: `flowllm serve --distributed-executor-backend ray`.

Each engine replica is an engine core (flowllm/engine/core.py: the step loop and the
model) in a Ray actor, listening on TCP; one ingress deployment serves the same Litestar
app as a single server, over an engine client (`RoutedEngine`) that routes each request
to one of N fronts, each the per-request half of the placed graph joined to one
replica's core by the cross-process channels of a single server (flowllm/graph/remote.py,
wire.py). Ray is an optional dependency (`flowllm[ray]`): nothing here is imported unless
that backend is asked for.

- `arguments`: the scale-out flags;
- `replica`: the engine replica deployment (an engine core on TCP);
- `router`: which replica a request goes to (prefix affinity, or round robin);
- `replica_link`: one replica as the ingress sees it (its front, health, load);
- `routed_engine`: the EngineClient over the replicas' fronts;
- `replica_metrics`: every replica's series, labelled, on the ingress's /metrics;
- `ingress`: the ingress deployment;
- `launch`: the command: start or join Ray, run the application, stop it on a signal.
"""
