"""Ray's background work that toolenv does not use, switched off on the clusters it starts.

Why: on the benchmark's node Ray's own processes spent about 85 ms of CPU per second whatever
the load (0.3 ms per call at 280 calls/s), and toolenv reads none of what that work produces:
the gateway has its own Prometheus metrics, Serve's autoscaling reports queue lengths to its
controller by its own RPC, and nothing reads task events or the dashboard's node stats. These
are set for the clusters toolenv starts (`toolenv serve --ray local`, the test and benchmark
clusters of `toolenv.ray.netns`); on a cluster of your own, start Ray with these options and
this environment to get the same (docs/ray.md). No Ray import: the netns helper uses it too.
"""

from __future__ import annotations

# Environment of every Ray process of the cluster (GCS, raylets, agents, Serve's controller and
# replicas inherit it from the raylet).
CLUSTER_ENV = {
    # Ray's metrics pipeline (workers -> agent -> Prometheus export) and its GCS-side series.
    "RAY_enable_metrics_collection": "0",
    # Task events (`ray list tasks`, the dashboard's timeline): reported to the GCS every second.
    "RAY_task_events_report_interval_ms": "0",
    # The dashboard agent's node stats (psutil over every worker), for the dashboard's node view.
    "REPORTER_UPDATE_INTERVAL_MS": "60000",
    # Serve's controller reconciles every 0.1 s by default; 0.5 s is still well under the
    # autoscaling delays (2 s up, 20 s down) and Ray's own node-death detection (about 2 s).
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
}

# `ray start` options of every node: no usage reporting, no log monitor (it tails every worker's
# log files to stream them to drivers; toolenv's drivers connect with `log_to_driver=False`, the
# files stay on the node).
RAY_START_ARGS = ["--disable-usage-stats", "--include-log-monitor", "false"]
# And of the head: no dashboard (toolenv deploys through Python, not Serve's REST API).
HEAD_START_ARGS = ["--include-dashboard", "false"]
