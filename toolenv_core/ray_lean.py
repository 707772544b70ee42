"""The environment of the Ray clusters toolenv starts, without the background work it does not use.

Here rather than in `toolenv.ray.lean` (which has the rest and says why) so that both commands
that start a local cluster reach it: `toolenv serve --ray local` and `toolenv rollout study --ray
local` (`ray_connect.init_local`). No Ray import: the netns helper uses it too.
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
