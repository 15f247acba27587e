"""Normal clients' latency and throughput on ``rl serve-rm``'s server, alone and beside hostile clients, in one run.

    PYTHONPATH=... python benchmarks/reward_server_load.py [--seconds 6] [--normal 3] [--client remote]

Starts a :class:`~rl_rollout.rewards.RewardServer` on loopback (``max_request_bytes`` 1 MiB, ``request_timeout_s``
2 s, ``max_connections`` 48, as the load test in ``tests/test_rollout_reward_server.py``) and runs ``--normal``
clients that each POST an 8-sample batch, 20 ms apart, a new connection per request (urllib: what every version
of the server speaks), or with ``--client remote`` through :class:`~rl_rollout.rewards.RemoteRewardClient`
(whatever it does: since 0.21.0 httpx, keeping the connection where the server allows it): first alone for ``--seconds / 2``, then for ``--seconds`` beside 12 slow clients
(a body byte every 0.2 s), 3 oversized (1 GiB announced, 2 MiB sent) and 3 malformed ones (bad JSON, as fast as
they can). Prints, for both phases: requests completed, requests/s, p50 / p95 / p99 / max latency in ms, failed
normal requests, and the server's replies by status. Uses only the server's public API, so the same script
measures an older version of the code (point PYTHONPATH at its ``packages/*/src``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time
import urllib.error
import urllib.request

import rl_rollout
from rl_rollout.rewards import RemoteRewardClient, RemoteRewardError, RewardServer

TOKEN = "bench-token"


def _score(prompts, responses, labels):
    return [float(r.strip() == (y or "")) for r, y in zip(responses, labels, strict=True)]


def _post(url: str, body: bytes, timeout: float = 10.0) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _normal(url: str, stop: threading.Event, latencies: list[float], failures: list, remote: bool) -> None:
    batch = {"prompts": ["2+2="] * 8, "responses": ["4"] * 8, "labels": ["4"] * 8}
    body = json.dumps(batch).encode()
    client = RemoteRewardClient(url, TOKEN, retries=0) if remote else None
    if client is not None:  # warm-up, not timed: the first call sets up the client's connection pool
        client.score(batch["prompts"], batch["responses"], batch["labels"])
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            if client is not None:
                status, rewards = 200, client.score(batch["prompts"], batch["responses"], batch["labels"])
            else:
                status, reply = _post(url, body)
                rewards = json.loads(reply).get("rewards") if status == 200 else None
        except (OSError, RemoteRewardError) as e:
            failures.append(repr(e))
            continue
        if status != 200 or rewards != [1.0] * 8:
            failures.append((status, rewards))
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.02)


def _slow(url: str, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            with _raw(url) as s:
                s.sendall(
                    f"POST / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 1000\r\n\r\n".encode()
                )
                while not stop.is_set():
                    s.sendall(b"x")
                    time.sleep(0.2)
        except OSError:
            pass  # cut by the deadline: come back


def _oversized(url: str, stop: threading.Event) -> None:
    chunk = b"y" * (256 << 10)
    head = f"POST / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: {1 << 30}\r\n\r\n".encode()
    while not stop.is_set():
        try:
            with _raw(url) as s:
                s.sendall(head)
                for _ in range(8):
                    s.sendall(chunk)
        except OSError:
            pass
        time.sleep(0.05)


def _malformed(url: str, stop: threading.Event) -> None:
    bodies = [b"[" * 50_000, b"{not json", b'{"prompts": [1]}', b"\x00" * 1000]
    i = 0
    while not stop.is_set():
        try:
            _post(url, bodies[i % len(bodies)])
        except OSError:
            pass
        i += 1


def _phase(url: str, seconds: float, normal: int, attackers: list, remote: bool) -> dict:
    stop, latencies, failures = threading.Event(), [], []
    threads = [threading.Thread(target=fn, args=(url, stop), daemon=True) for fn in attackers]
    threads += [
        threading.Thread(target=_normal, args=(url, stop, latencies, failures, remote), daemon=True)
        for _ in range(normal)
    ]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(10)
    ms = sorted(1e3 * x for x in latencies) or [float("nan")]

    def pct(q: float) -> float:
        return ms[min(len(ms) - 1, int(q * len(ms)))]

    return {
        "n": len(latencies),
        "req_per_s": round(len(latencies) / seconds, 1),
        "p50_ms": round(statistics.median(ms), 2),
        "p95_ms": round(pct(0.95), 2),
        "p99_ms": round(pct(0.99), 2),
        "max_ms": round(ms[-1], 2),
        "failed": len(failures),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=6.0, help="length of the attacked phase (alone: half)")
    ap.add_argument("--normal", type=int, default=3, help="normal clients")
    ap.add_argument("--client", choices=("urllib", "remote"), default="urllib", help="how normal clients send")
    args = ap.parse_args()
    attackers = [_slow] * 12 + [_oversized] * 3 + [_malformed] * 3
    with RewardServer(
        _score, token=TOKEN, max_request_bytes=1 << 20, request_timeout_s=2.0, max_connections=48
    ) as server:
        remote = args.client == "remote"
        if remote:  # the first call imports the client's HTTP library: not in the timed phases
            RemoteRewardClient(server.url, TOKEN).score(["p"], ["a"], ["a"])
        alone = _phase(server.url, args.seconds / 2, args.normal, [], remote)
        attacked = _phase(server.url, args.seconds, args.normal, attackers, remote)
        counts = dict(sorted(server.counts.items()))
    print(f"rl-rollout {rl_rollout.__version__}, {os.cpu_count()} CPUs, loopback, normal clients: {args.client}")
    print(f"normal clients alone:                                    {alone}")
    print(f"beside 12 slow, 3 oversized, 3 malformed clients:        {attacked}")
    print(f"server replies by status: {counts}")
    return 1 if alone["failed"] or attacked["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
