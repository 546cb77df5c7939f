"""Issue 26 s.3: ``lightning-dml serve`` bounds what one request may cost before the model runs (pixels, bytes,
body time, JSON depth, re-ranking options), a hostile request never fails its batch-mates, and a broken model
stops the server at start. The middleware and the model worker's code in process; one loopback server per module
for the end-to-end cases (a stalled body, a huge image, hostile and good requests batched together)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch
from PIL import Image

pytest.importorskip("litserve")
from starlette.testclient import TestClient  # noqa: E402

from lightning_dml.index import server as S  # noqa: E402
from tests.test_serve import _free_port, _request, _same_results, echo_app, index_dir  # noqa: E402,F401

DEFAULTS = {"k": 5, "rerank": None, "threshold": None, "adaptive": None}
#: small limits, so that the hostile cases stay cheap: 300 x 300 pixels per image, 2 such images per batch
LIMITS = S.RequestLimits.of(max_image_bytes=200_000, max_image_pixels=90_000, max_batch_bytes=400_000,
                            max_batch_pixels=180_000, body_timeout=1.5)


def png(size: tuple[int, int], color: int = 90) -> bytes:
    buf = io.BytesIO()
    Image.new("L", size, color).save(buf, format="PNG")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def client():
    app = S.SearchRequestMiddleware(echo_app, defaults=DEFAULTS, limits=LIMITS)
    with TestClient(app) as c:
        yield c


# --------------------------------------------------------------------------------------------- the middleware
BOUNDS = [
    # (name, body, content type, query, status, message)
    ("pixels over the limit", png((301, 300)), "image/png", "", 413,
     r"body is 301 x 300 = 90300 pixels, over the limit of 90000 pixels \(lightning-dml serve --max_image_pixels\)"),
    ("8000 x 8000 png (a few KB on the wire)", png((8000, 8000)), "image/png", "", 413, "8000 x 8000 = 64000000"),
    ("batch image over the pixel limit", {"images": [b64(png((20, 20))), b64(png((400, 400)))]}, "application/json",
     "", 413, r"images\[1\] is 400 x 400"),
    ("batch over the pixel limit", {"images": [b64(png((300, 300)))] * 3}, "application/json", "", 413,
     r"images\[0\.\.2\] hold 270000 pixels, over the limit of 180000 pixels .*--max_batch_pixels"),
    # a body within its limit (the base64 of 400000 bytes and a small allowance) whose files are over it
    ("batch over the byte limit", {"images": [b64(os.urandom(133_500))] * 3}, "application/json", "", 413,
     r"images\[0\.\.2\] hold 400500 bytes, over the limit of 400000 bytes .*--max_batch_bytes"),
    ("json body over its limit", b"{" + b" " * (LIMITS.json_body_bytes + 1) + b"}", "application/json", "", 413,
     rf"exceeds the limit of {LIMITS.json_body_bytes} bytes \(lightning-dml serve --max_batch_bytes\)"),
    ("deep json", b"[" * 100_000 + b"]" * 100_000, "application/json", "", 400, "nested too deeply"),
    ("deep json in images", b'{"images": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "application/json", "", 400,
     "nested too deeply"),
    ("malformed base64", {"images": ["aGVsbG8=", "%%%"]}, "application/json", "", 400, r"images\[1\] is not valid"),
    ("huge candidates", png((20, 20)), "image/png", "?rerank=kreciprocal:candidates=1000000", 400,
     r"candidates=1000000 outside \[1, 10000\]"),
    ("candidates over the server's k limit", png((20, 20)), "image/png", "?rerank=dba:candidates=5000", 400,
     "candidates=5000 over this server's limit of 1000"),
    ("huge aqe n", png((20, 20)), "image/png", "?rerank=aqe:n=1000000", 400, r"n=1000000 outside \[1, 1000\]"),
    ("huge k1", png((20, 20)), "image/png", "?rerank=kreciprocal:k1=99999", 400, r"k1=99999 outside \[1, 1000\]"),
    ("huge k", png((20, 20)), "image/png", "?k=1000000", 400, r"k=1000000 outside 1\.\.1000"),
    ("long option echoed short", png((20, 20)), "image/png", "?rerank=aqe:n=" + "9" * 5000, 400, r"\.\.\.$"),
    ("infinite threshold", png((20, 20)), "image/png", "?threshold=inf", 400, "threshold"),
]


@pytest.mark.parametrize("name,body,ctype,query,status,match", BOUNDS, ids=[b[0] for b in BOUNDS])
def test_middleware_refuses_over_limit_requests_with_4xx_json(client, name, body, ctype, query, status, match):
    import re

    content = json.dumps(body).encode() if isinstance(body, dict) else body
    r = client.post("/search" + query, content=content, headers={"Content-Type": ctype})
    assert r.status_code == status, r.text[:300]
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert re.search(match, error), error
    assert len(error) <= S.MAX_MESSAGE
    good = client.post("/search", content=png((20, 20)), headers={"Content-Type": "image/png"})
    assert good.status_code == 200


def test_middleware_limits_at_the_edge_pass(client):
    """The limits are inclusive: an image of exactly max_image_pixels, a batch of exactly max_batch_pixels."""
    r = client.post("/search", content=png((300, 300)), headers={"Content-Type": "image/png"})
    assert r.status_code == 200, r.text
    r = client.post("/search", json={"images": [b64(png((300, 300)))] * 2})
    assert r.status_code == 200, r.text[:300]
    assert len(r.json()["images"]) == 2


def test_json_body_limit_follows_from_the_image_limits():
    """Default: 4 x 10 MiB of image files per batch, base64 + a small allowance: ~53 MiB, not 853 MiB."""
    default = S.RequestLimits()
    assert default.max_batch_bytes == 4 * S.MAX_IMAGE_BYTES and default.max_batch_pixels == 4 * S.MAX_IMAGE_PIXELS
    base64_size = 4 * -(-default.max_batch_bytes // 3)
    assert base64_size < default.json_body_bytes <= base64_size + 64 * 1024
    # a batch of the largest files the limits allow fits the body limit
    body = json.dumps({"images": [b64(b"x" * default.max_image_bytes)] * S.BATCH_FACTOR}).encode()
    assert len(body) <= default.json_body_bytes
    with pytest.raises(S.ServeOptionError, match="--max_batch_bytes and --max_batch_pixels must be at least"):
        S.RequestLimits.of(max_image_bytes=100, max_batch_bytes=50).check()
    with pytest.raises(S.ServeOptionError, match="--body_timeout 0.0"):
        S.RequestLimits.of(body_timeout=0).check()


def _asgi_call(app, scope: dict, receive) -> list[dict]:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def _scope(headers: list[tuple[bytes, bytes]]) -> dict:
    return {"type": "http", "method": "POST", "path": "/search", "query_string": b"", "headers": headers}


def test_middleware_times_out_a_stalled_body_and_closes_the_connection():
    """A client that declares a body and never sends it gets a 408 within --body_timeout, with Connection: close."""
    app = S.SearchRequestMiddleware(echo_app, defaults=DEFAULTS, limits=LIMITS)

    async def stalled() -> dict:
        await asyncio.sleep(3600)
        return {}

    t0 = time.monotonic()
    sent = _asgi_call(app, _scope([(b"content-type", b"image/png"), (b"content-length", b"100000")]), stalled)
    elapsed = time.monotonic() - t0
    assert 1.4 < elapsed < 5, elapsed
    assert sent[0]["status"] == 408 and (b"connection", b"close") in sent[0]["headers"]
    assert "body not received within 1.5 s" in json.loads(sent[1]["body"])["error"]


def test_middleware_slow_trickle_is_cut_at_the_deadline():
    """A body sent a byte at a time never resets the clock: the deadline is for the whole body."""
    app = S.SearchRequestMiddleware(echo_app, defaults=DEFAULTS, limits=LIMITS)

    async def trickle() -> dict:
        await asyncio.sleep(0.2)
        return {"type": "http.request", "body": b"x", "more_body": True}

    t0 = time.monotonic()
    sent = _asgi_call(app, _scope([(b"content-type", b"image/png")]), trickle)
    assert time.monotonic() - t0 < 5 and sent[0]["status"] == 408


def test_middleware_declared_length_over_the_limit_is_refused_unread():
    app = S.SearchRequestMiddleware(echo_app, defaults=DEFAULTS, limits=LIMITS)

    async def never() -> dict:
        raise AssertionError("the body of a request declared too large must not be read")

    sent = _asgi_call(app, _scope([(b"content-type", b"image/png"), (b"content-length", b"10000000")]), never)
    assert sent[0]["status"] == 413 and (b"connection", b"close") in sent[0]["headers"]


def test_middleware_bounds_the_pending_body_bytes():
    """The bodies held at once (read, not yet answered) total at most max_pending_bytes: past it a 503 JSON error;
    the count returns to 0 once a request is answered, refused or cut."""
    limits = S.RequestLimits.of(max_image_bytes=1000, max_batch_bytes=1000, max_pending_bytes=2000)
    app = S.SearchRequestMiddleware(echo_app, defaults=DEFAULTS, limits=limits)
    data = png((8, 8))

    def body_of(payload: bytes):
        async def receive() -> dict:
            return {"type": "http.request", "body": payload, "more_body": False}

        return receive

    headers = [(b"content-type", b"image/png")]
    sent = _asgi_call(app, _scope(headers), body_of(data))
    assert sent[0]["status"] == 200 and app.pending == 0
    app.pending = 2000 - len(data) + 1  # other requests' bodies held
    sent = _asgi_call(app, _scope(headers), body_of(data))
    assert sent[0]["status"] == 503 and (b"connection", b"close") in sent[0]["headers"]
    assert "server busy" in json.loads(sent[1]["body"])["error"] and app.pending == 2000 - len(data) + 1
    app.pending = 2000 - len(data)
    assert _asgi_call(app, _scope(headers), body_of(data))[0]["status"] == 200
    assert app.pending == 2000 - len(data)
    assert S.RequestLimits() == S.RequestLimits.of()  # the field defaults are the derived ones
    with pytest.raises(S.ServeOptionError, match="--max_pending_bytes 10 must be at least the largest body"):
        S.RequestLimits.of(max_pending_bytes=10).check()


def test_middleware_closes_the_connection_only_when_the_body_was_left_unread():
    """A refusal before the body is read (wrong content type, bad query) closes the connection, so that the unread
    body is never taken for the next request; a refusal after reading it (not an image) keeps the connection."""
    app = S.SearchRequestMiddleware(echo_app, defaults=DEFAULTS, limits=LIMITS)

    async def body() -> dict:
        return {"type": "http.request", "body": b"not an image", "more_body": False}

    for headers, query, status, close in [([(b"content-type", b"text/plain")], b"", 415, True),
                                          ([(b"content-type", b"image/png")], b"k=0", 400, True),
                                          ([(b"content-type", b"image/png")], b"", 400, False)]:
        sent = _asgi_call(app, {**_scope(headers), "query_string": query}, body)
        assert sent[0]["status"] == status
        assert ((b"connection", b"close") in sent[0]["headers"]) is close, (status, query)


# --------------------------------------------------------------------------------------------- the model worker
class FakeEmbedder:
    """Stands in for the index's ImageEmbedder: grayscale pixels, a mean-pooling "model"."""

    mode = "L"
    device = torch.device("cpu")
    batch_size = 2

    @staticmethod
    def transform(image):
        return torch.tensor(list(image.resize((4, 4)).getdata()), dtype=torch.float32).reshape(1, 4, 4) / 255

    @staticmethod
    def model(batch):
        return torch.stack([batch.mean((1, 2, 3)), batch.std((1, 2, 3))], 1) + torch.tensor([0.0, 1.0])


class FakeIndex:
    """An index of 3 items whose search fails for k=3 (stands in for any failure inside one option group)."""

    metric = "cosine"
    manifest = types.SimpleNamespace(calibration=None)  # not calibrated: no match flags

    def search(self, queries, k):
        if k == 3:
            raise RuntimeError("simulated failure in the search")
        n = queries.shape[0]
        return torch.ones(n, k), torch.arange(k).repeat(n, 1)

    def __len__(self):
        return 3

    def results(self, scores, ids):
        return [[{"id": int(i), "score": float(s)} for s, i in zip(srow, irow) if i >= 0]
                for srow, irow in zip(scores, ids)]


def _api() -> S.SearchAPI:
    api = S.SearchAPI("unused", limits=LIMITS)
    api.index, api.embedder = FakeIndex(), FakeEmbedder()
    return api


def _request_payload(k: int, *images: bytes, single: bool = True) -> dict:
    return {"images": [b64(x) for x in images], "single": single, "k": k, "rerank": None, "threshold": None,
            "adaptive": None}


def test_a_failing_group_fails_only_its_own_requests():
    """Issue 26 s.3: a request whose search fails (here: the group with k=3) answers 500 JSON; the good requests
    of the same batch get the answer they get alone."""
    api = _api()
    good, bad = _request_payload(2, png((10, 10))), _request_payload(3, png((10, 10), 30))
    batch = [good, bad, _request_payload(2, png((10, 10), 200), png((12, 12)), single=False)]
    out = api.predict(api.batch([api.decode_request(r) for r in batch]))
    alone = [api.predict([api.decode_request(r)])[0] for r in (good, batch[2])]
    assert out[0] == alone[0] and out[2] == alone[1]
    assert out[0]["results"] == [{"id": 0, "score": 1.0}, {"id": 1, "score": 1.0}]
    assert len(out[2]["batch"]) == 2
    response = api.encode_response(out[1])
    assert response.status_code == 500
    assert json.loads(response.body) == {"error": "search failed: RuntimeError: simulated failure in the search"}
    assert api.encode_response(out[0]) == out[0]


def test_a_request_that_fails_to_decode_fails_alone():
    api = _api()
    big = _request_payload(2, png((400, 400)))  # past the worker's own pixel check too
    out = api.predict([api.decode_request(r) for r in (big, _request_payload(2, png((10, 10))))])
    assert out[0]["status"] == 413 and "400 x 400" in out[0]["error"]
    assert out[1]["results"][0]["id"] == 0
    assert api.encode_response(out[0]).status_code == 413


def test_model_input_embeds_as_the_index_does(index_dir):
    """The worker turns each decoded image into the model's input at once (one full-size image at a time): the
    same embedding as ``index.embed_images`` of the same PIL image."""
    from lightning_dml.index import EmbeddingIndex

    index = EmbeddingIndex.load(index_dir)
    images = [S.as_loaded(Image.open(p)) for p in sorted((index_dir.parent / "gallery").rglob("*.*"))[:4]]
    embedder = index.embedder
    with torch.no_grad():
        got = embedder.model(torch.stack([S.model_input(embedder, im) for im in images])).float()
    torch.testing.assert_close(got, index.embed_images(images), rtol=0, atol=0)


# --------------------------------------------------------------------------------------------- start-up
def _model_file(folder: Path) -> Path:
    from lightning_dml.index import EmbeddingIndex

    return folder / EmbeddingIndex.load(folder).manifest.model


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_serve_refuses_to_start_with_a_broken_model(index_dir, tmp_path, capsys, damage):
    """Issue 26 s.3: /health answered 200 for an index whose model was missing or truncated while every search
    failed; now ``serve`` stops before starting, in one line."""
    from lightning_dml.cli import main

    broken = tmp_path / "index"
    shutil.copytree(index_dir, broken)
    model = _model_file(broken)
    if damage == "truncated":
        model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    else:
        model.unlink()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--index", str(broken), "--port", str(_free_port()), "--accelerator", "cpu"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lightning-dml: error: "), err
    assert "Traceback" not in err[0] and (model.name in err[0] or str(broken) in err[0]), err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--max_image_pixels", "0"], "--max_image_pixels 0 must be >= 1"),
        (["--max_image_bytes", "100", "--max_batch_bytes", "10"], "--max_batch_bytes and --max_batch_pixels"),
        (["--body_timeout", "nan"], "--body_timeout nan must be"),
        (["--rerank", "kreciprocal:candidates=2000"], "candidates=2000 over this server's limit of 1000"),
    ],
)
def test_serve_limit_options_errors_are_one_line(tmp_path, capsys, args, message):
    from lightning_dml.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--index", str(tmp_path / "no_index"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


# --------------------------------------------------------------------------------------------- the real server
def _rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants (bench/serve.py's reading of /proc)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_serve", Path(__file__).resolve().parents[1] / "bench" /
                                                  "serve.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.tree_rss_mib(pid)


@pytest.fixture(scope="module")
def server(index_dir, tmp_path_factory):
    """``lightning-dml serve`` with small limits and a batch window long enough for concurrent requests to share
    a batch; yields ``(port, pid)``."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve_bounds_log") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_dml", "serve", "--index", str(index_dir), "--port", str(port),
             "--accelerator", "cpu", "--max_batch_size", "4", "--batch_timeout", "0.3", "--k", "4",
             "--max_image_bytes", str(LIMITS.max_image_bytes), "--max_image_pixels", str(LIMITS.max_image_pixels),
             "--max_batch_bytes", str(LIMITS.max_batch_bytes), "--max_batch_pixels", str(LIMITS.max_batch_pixels),
             "--body_timeout", str(LIMITS.body_timeout)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            cwd=tmp_path_factory.mktemp("serve_bounds_cwd"),
            env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())},
        )
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if _request(port, "GET", "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"/health did not answer 200 in 300 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield port, proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything left of the group
        except ProcessLookupError:
            pass


def _good(index_dir: Path) -> bytes:
    return (index_dir.parent / "gallery" / "class0" / "img1.png").read_bytes()


def _concurrently(port: int, requests: list[tuple[str, bytes, str]]) -> list[tuple[int, dict]]:
    """The requests sent at the same moment (one thread each), answers in order."""
    out: list = [None] * len(requests)
    barrier = threading.Barrier(len(requests))

    def send(i: int) -> None:
        path, body, ctype = requests[i]
        barrier.wait()
        out[i] = _request(port, "POST", path, body, ctype)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.slow
def test_server_hostile_and_good_requests_together(server, index_dir):
    """Issue 26 s.3: `rerank=kreciprocal:candidates=1000000` was a 500 and failed the good request batched with it.
    Hostile requests sent at the same moment as good ones (a 0.3 s batch window) get their 4xx JSON; the good ones
    get the answer they get alone; options past the gallery (15 items) are clamped to it, not refused."""
    port, _ = server
    good = _good(index_dir)
    alone = _request(port, "POST", "/search?k=3", good, "image/png")
    alone_aqe = _request(port, "POST", "/search?k=3&rerank=aqe:n=15", good, "image/png")
    assert alone[0] == 200 and alone_aqe[0] == 200
    hostile = [
        ("/search?k=3&rerank=kreciprocal:candidates=1000000", good, "image/png"),
        ("/search?k=3&rerank=aqe:n=1000000", good, "image/png"),
        ("/search?k=3", png((8000, 8000)), "image/png"),
        ("/search?k=3", b"[" * 100_000 + b"]" * 100_000, "application/json"),
    ]
    answers = _concurrently(port, [*hostile, ("/search?k=3", good, "image/png"),
                                   ("/search?k=3&rerank=aqe:n=1000", good, "image/png"),
                                   ("/search?k=3&rerank=kreciprocal:candidates=1000", good, "image/png")])
    statuses = [a[0] for a in answers]
    assert statuses[:4] == [400, 400, 413, 400], answers[:4]
    assert all("error" in a[1] for a in answers[:4])
    assert statuses[4:] == [200, 200, 200], answers[4:]
    _same_results(answers[4][1]["results"], alone[1]["results"])
    _same_results(answers[5][1]["results"], alone_aqe[1]["results"])  # n=1000 on 15 items: n=15
    assert _request(port, "GET", "/health")[0] == 200


@pytest.mark.slow
def test_server_closes_stalled_bodies_and_keeps_flat_memory(server, index_dir):
    """20 connections that declare 100 KB and stall were held open without a timeout; each is now answered 408 and
    closed within --body_timeout (1.5 s here), the server's memory does not grow, and good requests are served."""
    port, pid = server
    good = _good(index_dir)
    assert _request(port, "POST", "/search?k=2", good, "image/png")[0] == 200
    before = _rss_mib(pid)
    socks = []
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"POST /search HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\nContent-Length: 100000\r\n\r\n"
                  + b"\x89PNG" + b"0" * 1000)
        socks.append(s)
    t0 = time.monotonic()
    assert _request(port, "POST", "/search?k=2", good, "image/png")[0] == 200  # served meanwhile
    for s in socks:
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break  # closed by the server
            data += chunk
        s.close()
        assert data.startswith(b"HTTP/1.1 408"), data[:200]
        assert b"body not received within 1.5 s" in data
    assert time.monotonic() - t0 < 10
    assert _rss_mib(pid) - before < 50
    assert _request(port, "POST", "/search?k=2", good, "image/png")[0] == 200


@pytest.mark.slow
def test_server_endpoints_served_and_not(server):
    """/health and /info are LitServe's; the OpenAPI schema and the Swagger UI are switched off."""
    port, _ = server
    assert _request(port, "GET", "/health") == (200, {"text": "ok"})
    status, info = _request(port, "GET", "/info")
    assert status == 200 and "server" in info
    assert _request(port, "GET", "/openapi.json")[0] == 404
    assert _request(port, "GET", "/docs")[0] == 404
