"""Data-parallel serving on Ray Serve: `flowllm serve --distributed-executor-backend ray`.

One ingress deployment serves the same Litestar app as a single server, over an engine
client (`RoutedEngine`) that sends each request to one of N engine replicas, each a whole
flowllm graph in its own Ray actor. Ray is an optional dependency (`flowllm[ray]`): nothing
here is imported unless that backend is asked for.

- `wire`: the events a replica streams back to the ingress;
- `replica`: the engine replica deployment;
- `router`: which replica a request goes to (prefix affinity, or round robin);
- `replica_link`: one replica as the ingress sees it (health, load, its latest metrics);
- `routed_engine`: the EngineClient over the replicas;
- `replica_metrics`: every replica's series, labelled, on the ingress's /metrics;
- `ingress`: the ingress deployment;
- `launch`: the command: start or join Ray, run the application, stop it on a signal.
"""
