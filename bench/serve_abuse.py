"""Bounded abuse run of ``lightning-dml serve``: concurrent clients over 127.0.0.1 mixing good and hostile requests;
errors of the good requests (must be 0), the largest memory of each server process, latency of the good requests.

Starts ``lightning-dml serve --index DIR`` on a free port of 127.0.0.1 (its own process group; ``--body_timeout``
short, so that stalled bodies end quickly), fetches the answer of every good request alone, then runs ``--rounds``
rounds of ``--clients`` threads, each sending ``--requests`` requests, every other one hostile (in turn: an
8000 x 8000 PNG, a JSON batch over the pixel limit, a JSON body nested 100,000 deep, malformed base64, huge
re-ranking options, a body declared over the limit, a body that stalls, a corrupt PNG, a wrong content type), and
the good ones in turn a raw image, a JSON batch of two images, and ``rerank=aqe:n=1000`` / ``kreciprocal:
candidates=1000`` (options past the gallery, clamped to it). A background thread reads the resident memory of each
of the server's processes every 0.1 s (``/proc``: Linux). Everything is bounded: requests per client, rounds, each
request's timeout and ``--max_seconds`` for the whole run. Prints one JSON line and a markdown table::

    python bench/serve_abuse.py --index /tmp/glyphs_index --images /tmp/queries --clients 8 --requests 40

Reported per round: good requests, their errors (a status other than 200, or an answer other than the one the
same request got alone: must be 0), p50 / p99 latency of the good requests (ms), hostile requests by status and
their errors (a 5xx, no answer, or a 2xx), wall time; and the largest RSS (MiB) of each server process over the
run, with the RSS of each before the run. The figures depend on the machine and its load (``uptime`` is printed).
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve as base  # noqa: E402  (bench/serve.py: free_port, wait_health, query_images)


def png(size: tuple[int, int], color: int = 90) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", size, color).save(buf, format="PNG")
    return buf.getvalue()


def process_rss(pid: int) -> dict[int, tuple[str, float]]:
    """``{pid: (role, RSS MiB)}`` of ``pid`` (the ``serve`` main process) and its descendants, from ``/proc``.
    Roles from the command lines: the model worker is spawned (``spawn_main``), multiprocessing's resource tracker
    is named; the processes forked from the main one are LitServe's multiprocessing manager (forked first) and its
    uvicorn API server (forked after it), told apart by that order (their pids)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    out, todo = {}, [pid]
    forked = 0
    while todo:
        p = todo.pop(0)
        todo.extend(sorted(children.get(p, [])))
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{p}/status") as f:
                rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
        if p == pid:
            role = "main (lightning-dml serve)"
        elif "resource_tracker" in cmd:
            role = "resource tracker"
        elif "spawn_main" in cmd or "multiprocessing-fork" in cmd:
            role = "model worker"
        else:
            role = "multiprocessing manager" if forked == 0 else "API server (uvicorn)"
            forked += 1
        out[p] = (role, rss / 1024)
    return out


class RssMonitor(threading.Thread):
    """Samples :func:`process_rss` of a process tree every ``interval`` s; ``peak``: ``{pid: (name, max MiB)}``."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak: dict[int, tuple[str, float]] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for p, (name, mib) in process_rss(self.pid).items():
                if mib > self.peak.get(p, ("", 0.0))[1]:
                    self.peak[p] = (name, mib)
            self.stop.wait(self.interval)


def send(port: int, method: str, path: str, body: bytes, ctype: str, timeout: float) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": ctype})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def raw_request(port: int, head: bytes, body: bytes, timeout: float) -> tuple[int, bytes]:
    """Sends ``head`` and ``body`` as they are (a declared length the body does not fill: the server must answer
    and close); the status and the answer's bytes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head + body)
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
    try:
        return int(data.split(b" ", 2)[1]), data
    except (IndexError, ValueError):
        return 0, data


def requests_of(images: list[tuple[bytes, str]], k: int) -> tuple[list[tuple], list[tuple]]:
    """``(good, hostile)``: good ``(name, path, body, ctype)``; hostile ``(name, kind, payload)``."""
    b64 = [base64.b64encode(body).decode() for body, _ in images[:2]]
    first, ctype = images[0]
    good = [
        ("raw image", f"/search?k={k}", first, ctype),
        ("json batch of 2", f"/search?k={k}", json.dumps({"images": b64}).encode(), "application/json"),
        ("aqe:n=1000", f"/search?k={k}&rerank=aqe:n=1000", first, ctype),
        ("kreciprocal:candidates=1000", f"/search?k={k}&rerank=kreciprocal:candidates=1000", first, ctype),
    ]
    big = base64.b64encode(png((4096, 4096))).decode()
    hostile = [
        ("8000x8000 png", "http", (f"/search?k={k}", png((8000, 8000)), "image/png")),
        ("batch over the pixel limit", "http", (f"/search?k={k}", json.dumps({"images": [big] * 5}).encode(),
                                                "application/json")),
        ("json 100000 deep", "http", (f"/search?k={k}", b"[" * 100_000 + b"]" * 100_000, "application/json")),
        ("malformed base64", "http", (f"/search?k={k}", b'{"images": ["%%%not base64"]}', "application/json")),
        ("kreciprocal:candidates=1000000", "http", (f"/search?k={k}&rerank=kreciprocal:candidates=1000000", first,
                                                    ctype)),
        ("aqe:n=1000000", "http", (f"/search?k={k}&rerank=aqe:n=1000000", first, ctype)),
        ("declared 11 MB, no body", "raw", (b"POST /search HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                                            b"Content-Length: 11534336\r\n\r\n", b"")),
        ("stalled body", "raw", (b"POST /search HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                                 b"Content-Length: 100000\r\n\r\n", b"\x89PNG\r\n\x1a\n")),
        ("corrupt png", "http", (f"/search?k={k}", png((64, 64))[:60], "image/png")),
        ("wrong content type", "http", (f"/search?k={k}", first, "text/plain")),
    ]
    return good, hostile


def same_answer(got: dict, want: dict) -> bool:
    """The same results (ids, paths, labels, in order) with scores within 1e-5 (a forward pass over another batch
    may differ in the last bits)."""
    if set(got) != set(want):
        return False
    if "batch" in got:
        return len(got["batch"]) == len(want["batch"]) and all(
            same_answer(g, w) for g, w in zip(got["batch"], want["batch"]))
    g, w = got["results"], want["results"]
    return len(g) == len(w) and all(
        (a["id"], a["path"], a["label"]) == (b["id"], b["path"], b["label"]) and abs(a["score"] - b["score"]) <= 1e-5
        for a, b in zip(g, w))


def client(port: int, c: int, n: int, good: list, hostile: list, expected: dict, deadline: float, timeout: float,
           out: dict, lock: threading.Lock) -> None:
    for r in range(n):
        if time.monotonic() > deadline:
            return
        if (c + r) % 2 == 0:
            name, path, body, ctype = good[(c + r // 2) % len(good)]
            t0 = time.perf_counter()
            try:
                status, data = send(port, "POST", path, body, ctype, timeout)
                ok = status == 200 and same_answer(json.loads(data), expected[name])
            except (OSError, http.client.HTTPException, ValueError) as e:
                status, data, ok = 0, repr(e).encode(), False
            with lock:
                out["good_ms"].append((time.perf_counter() - t0) * 1000)
                if not ok:
                    out["good_errors"].append(f"{name}: {status} {data[:200]!r}")
        else:
            name, kind, payload = hostile[(c + r // 2) % len(hostile)]
            try:
                if kind == "http":
                    status, data = send(port, "POST", *payload, timeout)
                else:
                    status, data = raw_request(port, *payload, timeout)
            except (OSError, http.client.HTTPException) as e:
                status, data = 0, repr(e).encode()
            with lock:
                out["hostile"].setdefault(name, {}).setdefault(status, 0)
                out["hostile"][name][status] += 1
                if not 400 <= status < 500:
                    out["hostile_errors"].append(f"{name}: {status} {data[:200]!r}")


def abuse_round(port: int, clients: int, n: int, good: list, hostile: list, expected: dict, deadline: float,
                timeout: float) -> dict:
    out: dict = {"good_ms": [], "good_errors": [], "hostile": {}, "hostile_errors": []}
    lock = threading.Lock()
    threads = [threading.Thread(target=client, args=(port, c, n, good, hostile, expected, deadline, timeout, out,
                                                     lock)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ms = sorted(out["good_ms"])
    return {
        "good": len(ms), "good_errors": len(out["good_errors"]),
        "good_p50_ms": round(statistics.median(ms), 1) if ms else None,
        "good_p99_ms": round(ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))], 1) if ms else None,
        "hostile": sum(sum(v.values()) for v in out["hostile"].values()),
        "hostile_errors": len(out["hostile_errors"]),
        "hostile_statuses": {name: {str(s): c for s, c in v.items()} for name, v in sorted(out["hostile"].items())},
        "wall_s": round(time.perf_counter() - t0, 1),
        "first_errors": (out["good_errors"] + out["hostile_errors"])[:3],
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index", required=True)
    p.add_argument("--images", nargs="+", required=True, help="query image files or folders (the first two used)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=40, help="requests per client and round (half of them hostile)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--body_timeout", type=float, default=2.0, help="the server's --body_timeout (stalled bodies)")
    p.add_argument("--request_timeout", type=float, default=60.0, help="a client's timeout per request")
    p.add_argument("--max_seconds", type=float, default=600.0, help="the whole run stops sending after this")
    p.add_argument("--startup_timeout", type=float, default=300)
    a = p.parse_args(argv)
    images = base.query_images(a.images)
    good, hostile = requests_of(images, a.k)
    port = base.free_port()
    cmd = [sys.executable, "-m", "lightning_dml", "serve", "--index", a.index, "--port", str(port), "--host",
           "127.0.0.1", "--accelerator", "cpu", "--body_timeout", str(a.body_timeout)]
    log = open(os.path.join(tempfile.mkdtemp(prefix="serve_abuse_"), "serve.log"), "w+")
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    monitor = RssMonitor(proc.pid)
    try:
        base.wait_health(port, proc, a.startup_timeout)
        expected = {}
        for name, path, body, ctype in good:  # each good request's answer alone
            status, data = send(port, "POST", path, body, ctype, a.request_timeout)
            if status != 200:
                raise SystemExit(f"good request {name!r} answered {status} alone: {data[:300]!r}")
            expected[name] = json.loads(data)
        before = {p: (name, round(mib, 1)) for p, (name, mib) in process_rss(proc.pid).items()}
        monitor.start()
        deadline = time.monotonic() + a.max_seconds
        rounds = [abuse_round(port, a.clients, a.requests, good, hostile, expected, deadline, a.request_timeout)
                  for _ in range(a.rounds)]
        alive = send(port, "GET", "/health", b"", "text/plain", 10)[0]
    except BaseException:
        log.flush()
        log.seek(0)
        print(log.read()[-4000:], file=sys.stderr)  # the server's own output
        raise
    finally:
        monitor.stop.set()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if monitor.is_alive():
        monitor.join(5)
    log.seek(0)
    server_log = log.read()
    log.close()
    processes = [{"pid": p, "process": name, "rss_before_mib": before.get(p, ("", None))[1],
                  "rss_peak_mib": round(mib, 1)} for p, (name, mib) in sorted(monitor.peak.items())]
    result = {"clients": a.clients, "requests_per_client": a.requests, "rounds": rounds, "health_after": alive,
              "processes": processes, "body_timeout": a.body_timeout,
              "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    print(json.dumps(result))
    print("| round | good | good errors | good p50 ms | good p99 ms | hostile | hostile 4xx | hostile errors "
          "| wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, r in enumerate(rounds):
        print(f"| {i + 1} | {r['good']} | {r['good_errors']} | {r['good_p50_ms']} | {r['good_p99_ms']} | "
              f"{r['hostile']} | {r['hostile'] - r['hostile_errors']} | {r['hostile_errors']} | {r['wall_s']} |")
    print("| process | RSS before (MiB) | largest RSS (MiB) |\n|---|---:|---:|")
    for row in processes:
        print(f"| {row['process']} | {row['rss_before_mib']} | {row['rss_peak_mib']} |")
    if any(r["good_errors"] or r["hostile_errors"] for r in rounds) or alive != 200:
        print(server_log[-4000:], file=sys.stderr)
        raise SystemExit("errors during the abuse run")
    return result


if __name__ == "__main__":
    main()
