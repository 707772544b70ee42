"""Run inside the head node's network namespace (the cluster and its HTTP proxy live there):
bounded load through the Ray gateway, and the Serve status. Prints JSON on stdout.

    python in_cluster.py load URL --calls N --concurrency C --tool sandbox|search [...]
    python in_cluster.py replicas ADDRESS APP
    python in_cluster.py applications ADDRESS
    python in_cluster.py get URL
    python in_cluster.py put URL JSON
    python in_cluster.py delete ADDRESS APP
    python in_cluster.py shutdown ADDRESS
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

SLEEPY = "import time\ntime.sleep({s})\nprint('ok')\n"


async def load(args: argparse.Namespace) -> list[dict]:
    """`calls` calls, `concurrency` at once, each with its deadline; the client waits at most
    the deadline plus `grace_s`, so a hang shows up as status 0 ("no answer")."""
    results: list[dict] = []
    queue = list(range(args.calls))
    end = time.monotonic() + args.max_s
    limits = httpx.Limits(max_connections=args.concurrency)
    timeout = args.deadline_ms / 1000 + args.grace_s
    async with httpx.AsyncClient(base_url=args.url, limits=limits, timeout=timeout) as client:

        async def one(i: int) -> None:
            headers = {"X-Toolenv-Deadline-Ms": str(args.deadline_ms)}
            if args.trajectory:
                headers |= {"X-Trajectory-Id": args.trajectory, "X-Turn": str(i)}
            program = args.code or SLEEPY.format(s=args.sleep_s)
            pad = "#" * args.pad_bytes + "\n" if args.pad_bytes else ""
            code: dict = {"code": pad + program, "language": "python"}
            if args.run_timeout:
                code["run_timeout"] = args.run_timeout
            if args.max_output_bytes:
                code["max_output_bytes"] = args.max_output_bytes
            if args.tool == "sandbox":
                path, body = "/run_code", code
            elif args.tool == "search":
                path, body = "/retrieve", {"queries": [f"query {i}"], "topk": 2}
            else:
                path, body = f"/v1/tools/{args.tool}/call", {"arguments": code}
            started = time.monotonic()
            try:
                resp = await client.post(path, json=body, headers=headers)
                status, text = resp.status_code, resp.text
                node = resp.headers.get("x-toolenv-node")
                replica = resp.headers.get("x-toolenv-replica")
                request_ids = resp.headers.get_list("x-request-id")
            except httpx.HTTPError as exc:
                status, text, node, replica, request_ids = 0, repr(exc), None, None, []
            results.append(
                {
                    "i": i,
                    "tool": args.tool,
                    "status": status,
                    "elapsed_s": time.monotonic() - started,
                    "node": node,
                    "replica": replica,
                    "request_ids": request_ids,
                    "body": text[:8000],
                    "body_bytes": len(text),
                    "retry_after": resp.headers.get("retry-after") if status else None,
                }
            )

        async def worker() -> None:
            while queue and time.monotonic() < end:
                await one(queue.pop())
                if args.pause_s:
                    await asyncio.sleep(args.pause_s)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return results


def replicas(address: str, app: str) -> dict:
    import ray
    from ray import serve

    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    status = serve.status().applications[app]
    out = {
        name: {str(state): n for state, n in d.replica_states.items()}
        for name, d in status.deployments.items()
    }
    out["_alive_nodes"] = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
    return out


def applications(address: str) -> dict:
    import ray
    from ray import serve

    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    return {name: a.status.value for name, a in serve.status().applications.items()}


def delete(address: str, app: str) -> dict:
    """One application deleted gracefully (its replicas release what they hold)."""
    import ray
    from ray import serve

    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    serve.delete(app)
    return {"ok": True}


def shutdown(address: str) -> dict:
    """Graceful: every replica runs its shutdown (sandbox pools released) before we kill nodes."""
    import ray
    from ray import serve

    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    serve.shutdown()
    return {"ok": True}


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("load")
    p.add_argument("url")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--tool", default="sandbox", help="sandbox, search, or a tool name (generic)")
    p.add_argument("--trajectory", default=None, help="X-Trajectory-Id to send")
    p.add_argument("--sleep-s", type=float, default=0.0)
    p.add_argument("--code", default=None, help="program to run (default: sleep, then print)")
    p.add_argument("--pad-bytes", type=int, default=0, help="a comment this long before the code")
    p.add_argument("--max-output-bytes", type=int, default=0, help="output bound (0: its own)")
    p.add_argument("--run-timeout", type=float, default=0, help="run_timeout (0: the default)")
    p.add_argument("--pause-s", type=float, default=0.0)
    p.add_argument("--deadline-ms", type=float, default=10_000)
    p.add_argument("--grace-s", type=float, default=3.0)
    p.add_argument("--max-s", type=float, default=60.0)
    r = sub.add_parser("replicas")
    r.add_argument("address")
    r.add_argument("app")
    g = sub.add_parser("get")
    g.add_argument("url")
    u = sub.add_parser("put")
    u.add_argument("url")
    u.add_argument("body")
    a = sub.add_parser("applications")
    a.add_argument("address")
    d = sub.add_parser("delete")
    d.add_argument("address")
    d.add_argument("app")
    s = sub.add_parser("shutdown")
    s.add_argument("address")
    args = parser.parse_args()
    if args.cmd == "load":
        print(json.dumps(asyncio.run(load(args))))
    elif args.cmd == "get":
        resp = httpx.get(args.url, timeout=30)
        replica = resp.headers.get("x-toolenv-replica")
        node = resp.headers.get("x-toolenv-node")
        print(json.dumps({"status": resp.status_code, "text": resp.text, "replica": replica,
                          "node": node}))  # fmt: skip
    elif args.cmd == "put":
        resp = httpx.put(args.url, content=args.body, timeout=30)
        print(json.dumps({"status": resp.status_code, "text": resp.text}))
    elif args.cmd == "replicas":
        print(json.dumps(replicas(args.address, args.app)))
    elif args.cmd == "applications":
        print(json.dumps(applications(args.address)))
    elif args.cmd == "delete":
        print(json.dumps(delete(args.address, args.app)))
    else:
        print(json.dumps(shutdown(args.address)))


if __name__ == "__main__":
    main()
