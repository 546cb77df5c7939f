"""Bounded load test of ``lightning-dml serve``: concurrent clients over 127.0.0.1, latency, throughput, errors and
the server's memory before and after.

Starts ``lightning-dml serve --index DIR --port P`` (a free port) in its own process group, waits for ``GET
/health``, sends ``--warmup`` requests, reads the resident memory (RSS) of the server's whole process tree
(``/proc``: Linux), then runs ``--clients`` threads, each sending ``--requests`` ``POST /search?k=K`` requests (the
raw JPEG/PNG bytes of the query images, in turn) over its own keep-alive connection, reads the RSS again and
stops the server. Prints one JSON line and a markdown row::

    python bench/serve.py --index /tmp/glyphs_index --images /tmp/queries --clients 8 --requests 200

Reported: p50 / p99 / max latency (ms, per request, client side), requests per second (all requests over the wall
time of the loaded phase), errors (non-200 answers or failed connections; must be 0), RSS before / after (MiB, the
sum over the server's processes) and, for a memory check that is not one sample, the RSS after a second identical
round (``--rounds 2``): growth between rounds beyond noise would be a leak. The figures depend on the machine and
its load (print ``uptime`` beside them); ``--max_batch_size`` and ``--batch_timeout`` are passed to the server.

``--runtimes torch onnx`` measures the server with each model runtime (``serve --runtime``; ``onnx`` needs an index
built with ``index build --runtime onnx``, which holds both models) one after the other in the same run, on the
same machine: one result and one set of markdown rows per runtime.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

IMAGE_SUFFIXES = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and all its descendants (MiB), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def wait_health(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} before /health answered")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"/health did not answer 200 within {timeout} s")


def client(port: int, images: list[tuple[bytes, str]], n: int, k: int, offset: int, out: list, errors: list) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    for r in range(n):
        body, ctype = images[(offset + r) % len(images)]
        t0 = time.perf_counter()
        try:
            conn.request("POST", f"/search?k={k}", body=body, headers={"Content-Type": ctype})
            resp = conn.getresponse()
            data = resp.read()
            ok = resp.status == 200 and "results" in json.loads(data)
        except (OSError, http.client.HTTPException, ValueError) as e:
            ok = False
            errors.append(repr(e))
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        out.append(time.perf_counter() - t0)
        if not ok:
            errors.append(f"status {getattr(resp, 'status', '?')}")
    conn.close()


def load_round(port: int, images: list[tuple[bytes, str]], clients: int, requests: int, k: int) -> dict:
    latencies: list[float] = []
    errors: list[str] = []
    threads = [
        threading.Thread(target=client, args=(port, images, requests, k, c * 7, latencies, errors))
        for c in range(clients)
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ms = sorted(x * 1000 for x in latencies)
    return {
        "requests": len(ms),
        "errors": len(errors),
        "p50_ms": round(statistics.median(ms), 2),
        "p99_ms": round(ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))], 2),
        "max_ms": round(ms[-1], 2),
        "requests_per_s": round(len(ms) / wall, 1),
        "wall_s": round(wall, 2),
        "first_errors": errors[:3],
    }


def query_images(paths: list[str]) -> list[tuple[bytes, str]]:
    files: list[Path] = []
    for p in map(Path, paths):
        files.extend(sorted(f for f in p.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES) if p.is_dir() else [p])
    if not files:
        raise SystemExit(f"no JPEG/PNG images in {paths}")
    return [(f.read_bytes(), IMAGE_SUFFIXES[f.suffix.lower()]) for f in files]


def measure(a: argparse.Namespace, images: list[tuple[bytes, str]], runtime: str) -> dict:
    """Start the server with ``runtime``, load it (warm-up, ``a.rounds`` rounds), stop it; the result."""
    port = free_port()
    cmd = [sys.executable, "-m", "lightning_dml", "serve", "--index", a.index, "--port", str(port),
           "--max_batch_size", str(a.max_batch_size), "--batch_timeout", str(a.batch_timeout), "--accelerator", "cpu",
           "--runtime", runtime]
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        wait_health(port, proc, a.startup_timeout)
        warm = load_round(port, images, 1, a.warmup, a.k)
        rss_before = tree_rss_mib(proc.pid)
        rounds, rss = [], []
        for _ in range(a.rounds):
            rounds.append(load_round(port, images, a.clients, a.requests, a.k))
            rss.append(round(tree_rss_mib(proc.pid), 1))
    finally:
        proc.send_signal(signal.SIGINT)  # the server stops its workers itself (Ctrl+C)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return {
        "runtime": runtime, "clients": a.clients, "requests_per_client": a.requests, "k": a.k,
        "max_batch_size": a.max_batch_size, "batch_timeout": a.batch_timeout, "warmup_errors": warm["errors"],
        "rss_before_mib": round(rss_before, 1), "rss_after_mib": rss, "rounds": rounds,
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index", required=True)
    p.add_argument("--images", nargs="+", required=True, help="query image files or folders")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=200, help="requests per client and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--max_batch_size", type=int, default=8)
    p.add_argument("--batch_timeout", type=float, default=0.01)
    p.add_argument("--startup_timeout", type=float, default=300)
    p.add_argument("--runtimes", nargs="+", choices=("torch", "onnx"), default=["torch"],
                   help="the server's model runtime(s), measured one after the other (default torch)")
    a = p.parse_args(argv)
    images = query_images(a.images)
    results = [measure(a, images, runtime) for runtime in a.runtimes]
    for result in results:
        print(json.dumps(result))
    for result in results:
        for i, r in enumerate(result["rounds"]):
            print(f"| {result['runtime']} | {i + 1} | {a.clients} x {a.requests} | {r['p50_ms']} | {r['p99_ms']} | "
                  f"{r['requests_per_s']} | {r['errors']} | {result['rss_before_mib']} | {result['rss_after_mib'][i]} |")
    if any(r["errors"] for result in results for r in result["rounds"]) or any(x["warmup_errors"] for x in results):
        raise SystemExit("errors during the load test")
    result = results[0] if len(results) == 1 else {"runtimes": results}
    return result


if __name__ == "__main__":
    main()
