"""``lightning-dml serve`` (lightning_dml/index/server.py): the request checks of the middleware (in process, every
bad-request case), and the real server over loopback HTTP against ``lightning-dml search``'s answer."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image

pytest.importorskip("litserve")
from starlette.testclient import TestClient  # noqa: E402

from lightning_dml.index import server as S  # noqa: E402

DEFAULTS = {"k": 5, "rerank": None, "threshold": None, "adaptive": None}


def image_bytes(fmt: str = "PNG", size: tuple[int, int] = (16, 12), color: int = 90) -> bytes:
    buf = io.BytesIO()
    Image.new("L", size, color).save(buf, format=fmt)
    return buf.getvalue()


async def echo_app(scope, receive, send):
    """Stands in for LitServe: answers 200 with the JSON payload it received."""
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            await send({"type": msg["type"] + ".complete"})
            if msg["type"] == "lifespan.shutdown":
                return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    headers = dict(scope["headers"])
    if scope["path"] == "/search":
        assert headers[b"content-type"] == b"application/json"
        assert int(headers[b"content-length"]) == len(body)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture()
def client():
    app = S.SearchRequestMiddleware(echo_app, defaults=DEFAULTS, max_image_bytes=4096)
    with TestClient(app) as c:
        yield c


def test_middleware_passes_a_good_image_on_as_json(client):
    data = image_bytes()
    r = client.post("/search?k=3&threshold=0.5&adaptive=2&rerank=aqe:n=3", content=data,
                    headers={"Content-Type": "image/png"})
    assert r.status_code == 200
    payload = r.json()
    assert base64.b64decode(payload["images"][0]) == data
    assert payload["single"] is True and payload["k"] == 3 and payload["threshold"] == 0.5
    assert payload["adaptive"] == 2.0 and payload["rerank"] == "aqe:alpha=3.0,n=3"
    r = client.post("/search", content=image_bytes("JPEG"), headers={"Content-Type": "image/jpeg; charset=x"})
    assert r.status_code == 200 and r.json()["k"] == 5 and r.json()["rerank"] is None


def test_middleware_json_batch(client):
    imgs = [base64.b64encode(image_bytes(c)).decode() for c in ("PNG", "JPEG")]
    r = client.post("/search?k=2", json={"images": imgs})
    assert r.status_code == 200 and r.json()["images"] == imgs and r.json()["single"] is False


def test_middleware_refuses_a_rerank_the_index_metric_does_not_allow():
    app = S.SearchRequestMiddleware(echo_app, defaults=DEFAULTS, metric="euclidean")
    with TestClient(app) as c:
        r = c.post("/search?rerank=aqe", content=image_bytes(), headers={"Content-Type": "image/png"})
        assert r.status_code == 400 and "needs the cosine metric" in r.json()["error"]
        r = c.post("/search?rerank=kreciprocal", content=image_bytes(), headers={"Content-Type": "image/png"})
        assert r.status_code == 200


def test_middleware_leaves_other_paths_alone(client):
    assert client.get("/health").status_code == 200  # echo app answers
    assert client.post("/other", content=b"x", headers={"Content-Type": "text/plain"}).status_code == 200


def test_middleware_limits_a_chunked_body_without_content_length(client):
    """A streamed body (no Content-Length) is cut off at the limit while it is read."""
    r = client.post("/search", content=iter([b"\x89PNG" + b"0" * 3000, b"0" * 3000]),
                    headers={"Content-Type": "image/png"})
    assert r.status_code == 413 and "exceeds the limit of 4096" in r.json()["error"]
    assert client.post("/search", content=image_bytes(), headers={"Content-Type": "image/png"}).status_code == 200


def _truncated_png() -> bytes:
    data = image_bytes(size=(40, 40))
    return data[: len(data) // 2]


BAD = [
    ("wrong content type", b"abc", {"Content-Type": "text/plain"}, "", 415, "Content-Type text/plain not accepted"),
    ("no content type", b"abc", {}, "", 415, r"Content-Type \(none\)"),
    ("empty body", b"", {"Content-Type": "image/png"}, "", 400, "empty body"),
    ("not an image", b"hello, not an image", {"Content-Type": "image/jpeg"}, "", 400, "not an image"),
    ("corrupt image", "truncated", {"Content-Type": "image/png"}, "", 400, "corrupt PNG image"),
    ("too large", b"\x89PNG" + b"0" * 5000, {"Content-Type": "image/png"}, "", 413, "exceeds the limit of 4096"),
    ("gif", "gif", {"Content-Type": "image/png"}, "", 415, "GIF image; send JPEG or PNG"),
    ("bad k", "png", {"Content-Type": "image/png"}, "?k=0", 400, r"k=0 outside 1\.\.1000"),
    ("k not int", "png", {"Content-Type": "image/png"}, "?k=ten", 400, "k='ten' is not an integer"),
    ("bad rerank", "png", {"Content-Type": "image/png"}, "?rerank=magic", 400, "unknown method 'magic'"),
    ("bad threshold", "png", {"Content-Type": "image/png"}, "?threshold=high", 400, "--threshold 'high'"),
    ("unknown param", "png", {"Content-Type": "image/png"}, "?top=3", 400, "unknown query parameter.*top"),
    ("bad json", b"{not json", {"Content-Type": "application/json"}, "", 400, "not valid JSON"),
    ("json no images", b'{"x": 1}', {"Content-Type": "application/json"}, "", 400, '"images"'),
    ("json bad base64", b'{"images": ["%%%"]}', {"Content-Type": "application/json"}, "", 400,
     r"images\[0\] is not valid base64"),
    ("json not image", json.dumps({"images": [base64.b64encode(b"nope").decode()]}).encode(),
     {"Content-Type": "application/json"}, "", 400, r"images\[0\] is not an image"),
]


@pytest.mark.parametrize("name,body,headers,query,status,match", BAD, ids=[b[0] for b in BAD])
def test_middleware_bad_requests_get_4xx_json(client, name, body, headers, query, status, match):
    import re

    if body == "truncated":
        body = _truncated_png()
    elif body == "gif":
        body = image_bytes("GIF")
    elif body == "png":
        body = image_bytes()
    r = client.post("/search" + query, content=body, headers=headers)
    assert r.status_code == status, r.text
    assert re.search(match, r.json()["error"]), r.json()
    # the next good request is served
    good = client.post("/search", content=image_bytes(), headers={"Content-Type": "image/png"})
    assert good.status_code == 200


# --------------------------------------------------------------------------------------------- the real server
import http.client  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GLYPHS = ROOT / "configs" / "glyphs.yaml"
MAX_IMAGE_BYTES = 300_000


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory) -> Path:
    """A flat index of a 3-class image-folder gallery (12 PNGs and 3 JPEGs) under a random-init Glyphs model
    (SmallConvNet width 8, 16-d), built by ``build_index`` (exported model beside it)."""
    pytest.importorskip("faiss")
    from lightning_dml.cli import build_cli
    from lightning_dml.index import build_index

    root = tmp_path_factory.mktemp("serve_index")
    torch.manual_seed(0)
    cli = build_cli(["--config", str(GLYPHS), "--trainer.logger=false", "--trainer.callbacks=[]",
                     "--model.backbone.init_args.width=8", "--model.embedding_dim=16"], run=False)
    import pytorch_lightning as pl

    torch.save({"state_dict": cli.model.state_dict(), "hyper_parameters": dict(cli.model.hparams),
                "pytorch-lightning_version": pl.__version__}, root / "m.ckpt")
    cfg = yaml.safe_load(GLYPHS.read_text())
    cfg["model"]["backbone"]["init_args"]["width"] = 8
    cfg["model"]["embedding_dim"] = 16
    (root / "config.yaml").write_text(yaml.safe_dump(cfg))
    rng = np.random.default_rng(0)
    for c in range(3):
        folder = root / "gallery" / f"class{c}"
        folder.mkdir(parents=True)
        for i in range(5):
            pixels = (rng.random((32, 32)) * 90 + 50 * c + (np.arange(32) * i)[None, :] % 40).astype("uint8")
            Image.fromarray(pixels, "L").save(folder / (f"img{i}.jpg" if i == 4 else f"img{i}.png"))
    build_index(root / "config.yaml", root / "m.ckpt", root / "gallery", "flat", out=root / "index",
                accelerator="cpu", progress=False)
    return root / "index"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(port: int, method: str, path: str, body: bytes | None = None, ctype: str | None = None,
             timeout: float = 120) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": ctype} if ctype else {})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, (json.loads(data) if data[:1] in (b"{", b"[") else {"text": data.decode()})
    finally:
        conn.close()


@pytest.fixture(scope="module")
def server(index_dir, tmp_path_factory):
    """``lightning-dml serve`` in its own process group on a free port; stopped by SIGTERM after the tests, which
    must end every process of the group (the model worker and API server too) within 30 s."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve_log") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_dml", "serve", "--index", str(index_dir), "--port", str(port),
             "--accelerator", "cpu", "--max_batch_size", "4", "--batch_timeout", "0.05", "--k", "4",
             "--max_image_bytes", str(MAX_IMAGE_BYTES)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path_factory.mktemp("serve_cwd"),
            # the thread count of this process, so that both embed with the same kernels: a random-init model puts
            # the gallery at near-equal scores, where a last-bit difference could reorder re-ranked results
            env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())},
        )
    try:
        deadline = time.monotonic() + 300  # generous: a busy 2-core machine starts torch in two processes
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
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)  # as `kill`: the server must stop its own workers too
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        deadline = time.monotonic() + 30  # the workers leave with the server
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
        else:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("server processes still running 30 s after the server stopped")


def _search_command(capsys, index_dir: Path, images: list[Path], *options: str) -> list[dict]:
    from lightning_dml.cli import main

    capsys.readouterr()
    main(["search", "--index", str(index_dir), *options, *map(str, images)])
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def _same_results(got: list[dict], want: list[dict]) -> None:
    assert [(r["id"], r["path"], r["label"]) for r in got] == [(r["id"], r["path"], r["label"]) for r in want]
    assert [r["score"] for r in got] == pytest.approx([r["score"] for r in want], abs=1e-5)


def _queries(index_dir: Path) -> list[Path]:
    gallery = index_dir.parent / "gallery"
    return [gallery / "class0" / "img1.png", gallery / "class2" / "img3.png", gallery / "class1" / "img4.jpg"]


@pytest.mark.slow
@pytest.mark.parametrize("options", [(), ("threshold=0.99",), ("rerank=kreciprocal:k1=3,k2=2",),
                                     ("rerank=aqe:n=2", "adaptive=1")])
def test_server_answers_as_the_search_command(server, index_dir, capsys, options):
    queries = _queries(index_dir)
    flags = [f"--{o.split('=')[0]}={o.split('=', 1)[1]}" for o in options]
    # one image per forward pass, as the server embeds one request at a time here
    want = _search_command(capsys, index_dir, queries, "--k", "4", "--format", "json", "--batch_size", "1", *flags)
    assert [w["query"] for w in want] == [str(q) for q in queries]
    for query, expected in zip(queries, want):
        ctype = "image/jpeg" if query.suffix == ".jpg" else "image/png"
        status, answer = _request(server, "POST", "/search?k=4&" + "&".join(options), query.read_bytes(), ctype)
        assert status == 200, answer
        assert set(answer) == {"results"}
        _same_results(answer["results"], expected["results"])
    if not options:
        assert [r["path"] for r in want[0]["results"]][0] == str(queries[0])  # the image itself comes first


@pytest.mark.slow
def test_server_json_batch_and_concurrent_requests(server, index_dir, capsys):
    queries = _queries(index_dir)
    want = _search_command(capsys, index_dir, queries, "--k", "3")
    body = json.dumps({"images": [base64.b64encode(q.read_bytes()).decode() for q in queries]}).encode()
    status, answer = _request(server, "POST", "/search?k=3", body, "application/json")
    assert status == 200, answer
    for got, expected in zip(answer["batch"], want):
        _same_results(got["results"], expected["results"])
    # concurrent clients: requests batched together by LitServe get their own answers
    failures: list[str] = []

    def client(c: int) -> None:
        for r in range(4):
            i = (c + r) % len(queries)
            ctype = "image/jpeg" if queries[i].suffix == ".jpg" else "image/png"
            status, answer = _request(server, "POST", "/search?k=3", queries[i].read_bytes(), ctype)
            try:
                assert status == 200
                _same_results(answer["results"], want[i]["results"])
            except AssertionError as e:
                failures.append(f"client {c} request {r}: {status} {answer} {e}")

    threads = [threading.Thread(target=client, args=(c,)) for c in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:3]


@pytest.mark.slow
def test_server_bad_requests_then_good_ones(server, index_dir):
    good = _queries(index_dir)[0].read_bytes()
    cases = [
        ("wrong content type", good, "text/plain", 415, "Content-Type text/plain"),
        ("empty body", b"", "image/png", 400, "empty body"),
        ("not an image", b"<html>hello</html>", "image/png", 400, "not an image"),
        ("corrupt image", good[: len(good) // 2], "image/png", 400, "corrupt PNG"),
        ("too large", b"\xff\xd8\xff" + b"0" * MAX_IMAGE_BYTES, "image/jpeg", 413, f"limit of {MAX_IMAGE_BYTES}"),
        ("bad k", good, "image/png", 400, "k=0"),
    ]
    for name, body, ctype, status, text in cases:
        path = "/search?k=0" if name == "bad k" else "/search?k=2"
        got_status, answer = _request(server, "POST", path, body, ctype)
        assert got_status == status, (name, answer)
        assert text in answer["error"], (name, answer)
        ok_status, ok = _request(server, "POST", "/search?k=2", good, "image/png")
        assert ok_status == 200 and len(ok["results"]) == 2, (name, ok)
    assert _request(server, "GET", "/health")[0] == 200


@pytest.mark.parametrize(
    "args,message",
    [
        (["--port", "70000"], "--port 70000 outside 0..65535"),
        (["--k", "0"], "--k 0 outside 1..1000"),
        (["--rerank", "nope"], "unknown method 'nope'"),
        (["--threshold", "x"], "--threshold 'x' is not a number"),
        (["--batch_timeout", "40"], "--batch_timeout 40.0 must be >= 0 and below --timeout 30.0"),
        ([], "no_index does not exist"),  # no index folder: reported before any worker starts
    ],
)
def test_serve_command_errors_are_one_line(tmp_path, capsys, args, message):
    from lightning_dml.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--index", str(tmp_path / "no_index"), *args])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lightning-dml: error: ") and message in err[0], err


def test_serve_command_rejects_aqe_on_a_euclidean_index(tmp_path, capsys):
    pytest.importorskip("faiss")
    from lightning_dml.cli import main
    from lightning_dml.index import EmbeddingIndex

    EmbeddingIndex.build(torch.randn(6, 4), {"paths": [f"{i}.png" for i in range(6)], "labels": ["a"] * 6},
                         metric="euclidean").save(tmp_path / "idx")
    with pytest.raises(SystemExit):
        main(["serve", "--index", str(tmp_path / "idx"), "--rerank", "aqe"])
    assert "needs the cosine metric" in capsys.readouterr().err


@pytest.mark.slow
def test_load_test_script_runs_without_errors(index_dir, capsys):
    """bench/serve.py end to end on the test index: its own server, a few concurrent requests, 0 errors, memory
    figures read from /proc."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "bench" / "serve.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--index", str(index_dir), "--images", str(index_dir.parent / "gallery"), "--clients", "2",
                         "--requests", "5", "--rounds", "1", "--warmup", "2", "--k", "3"])
    assert result["rounds"][0]["requests"] == 10 and result["rounds"][0]["errors"] == 0
    assert result["warmup_errors"] == 0 and result["rss_before_mib"] > 0 and result["rss_after_mib"][0] > 0


@pytest.mark.slow
def test_abuse_script_runs_with_zero_good_errors(index_dir):
    """bench/serve_abuse.py end to end on the test index: hostile requests of every kind answered 4xx, the good
    ones as alone (0 errors), a peak RSS for every server process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_serve_abuse", ROOT / "bench" / "serve_abuse.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--index", str(index_dir), "--images", str(index_dir.parent / "gallery"), "--clients", "2",
                         "--requests", "20", "--rounds", "1", "--k", "3", "--body_timeout", "1"])
    (r,) = result["rounds"]
    assert r["good"] == 20 and r["good_errors"] == 0 and r["hostile"] == 20 and r["hostile_errors"] == 0
    assert set(r["hostile_statuses"]) >= {"stalled body", "json 100000 deep", "8000x8000 png"}
    assert result["health_after"] == 200
    roles = {p["process"] for p in result["processes"]}
    assert {"main (lightning-dml serve)", "model worker", "API server (uvicorn)"} <= roles
    assert all(p["rss_peak_mib"] > 0 for p in result["processes"])
