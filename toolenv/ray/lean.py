"""Ray's background work that toolenv does not use, switched off on the clusters it starts.

Why: on the benchmark's node Ray's own processes spent about 85 ms of CPU per second whatever
the load (0.3 ms per call at 280 calls/s), and toolenv reads none of what that work produces:
the gateway has its own Prometheus metrics, Serve's autoscaling reports queue lengths to its
controller by its own RPC, and nothing reads task events or the dashboard's node stats. These
are set for the clusters toolenv starts (`--ray local` of `toolenv serve` and `toolenv rollout
study`, the test and benchmark clusters of `toolenv.ray.netns`; `CLUSTER_ENV` lives in
`toolenv_core.ray_lean`, which the study reaches); on a cluster of your own, start Ray with
these options and this environment to get the same (docs/ray.md). No Ray import: the netns helper uses it too.
`GRPC_ENV` is not background work but the replicas' gRPC setting; it travels with the
deployment (`toolenv.ray.app.REPLICA_ENV`), on any cluster.
"""

from __future__ import annotations

from toolenv_core.ray_lean import CLUSTER_ENV

__all__ = ["CLUSTER_ENV", "GRPC_ENV", "HEAD_START_ARGS", "RAY_START_ARGS"]

# Environment of every Serve replica's process as well (with `toolenv.ray.app.REPLICA_ENV`, in
# the deployment's runtime_env, so on any cluster): gRPC's EventEngine client and listener off.
# The handles' data path is gRPC (grpcio 1.85); by default its C core does every socket read and
# write on the EventEngine's own threads, a thread hop each way per message on both ends; with
# these two experiments off, the sockets are polled by the thread that polls gRPC's completion
# queue (the poller thread of gRPC's asyncio, which hands completions to the event loop anyway).
# Measured on one node (docs/ray.md): a zero-delay handle call (search) costs the path 0.74-0.78
# ms of CPU against 0.84-0.98 (three deployments of each, alternating on one cluster), and the
# gateway replica's context switches per call halve (5.2-6.4 against 11.4-12.4); a sandbox run's
# path CPU and p50 did not move beyond this 2-core machine's spread. Ray's own gRPC in the
# replica (core worker to raylet and GCS) reads the same variable; tests/raycluster pass.
GRPC_ENV = {"GRPC_EXPERIMENTS": "-event_engine_client,-event_engine_listener"}

# `ray start` options of every node: no usage reporting, no log monitor (it tails every worker's
# log files to stream them to drivers; toolenv's drivers connect with `log_to_driver=False`, the
# files stay on the node).
RAY_START_ARGS = ["--disable-usage-stats", "--include-log-monitor", "false"]
# And of the head: no dashboard (toolenv deploys through Python, not Serve's REST API).
HEAD_START_ARGS = ["--include-dashboard", "false"]
