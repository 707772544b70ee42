#!/usr/bin/env bash
# Start dockerd in the background when no engine answers, then wait until `docker info` does.
set -euo pipefail
if docker info >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" != 0 ]; then
  echo "toolenv setup: no Docker engine answers and we are not root: start dockerd yourself" >&2
  exit 1
fi
logfile="${TOOLENV_DOCKERD_LOG:-/var/log/toolenv-dockerd.log}"
echo "[setup] starting dockerd (log: $logfile)"
nohup dockerd >"$logfile" 2>&1 </dev/null &
for _ in $(seq 1 120); do
  if docker info >/dev/null 2>&1; then echo "[setup] dockerd is up"; exit 0; fi
  sleep 0.5
done
echo "toolenv setup: dockerd did not answer within 60 s; see $logfile" >&2
tail -n 30 "$logfile" >&2 || true
exit 1
