"""``lightning-dml serve``: an HTTP search service over an index folder, on LitServe (Lightning's serving library).

::

    lightning-dml serve --index DIR --port 8000 [--host 127.0.0.1] [--k 10] [--max_batch_size 8]
        [--batch_timeout 0.01] [--rerank SPEC] [--threshold T] [--adaptive N] [--max_image_bytes BYTES]

Endpoints:

* ``POST /search?k=K`` with the raw image file as the body (``Content-Type: image/jpeg`` or ``image/png``) answers
  ``{"results": [{"id", "path", "label", "score"}, ...]}`` best first: the ``results`` of ``lightning-dml search
  --index DIR --k K --format json`` for the same image (same embedding, index, re-ranking and cut). Optional
  query parameters ``threshold``, ``adaptive`` and ``rerank`` (as the search command's options) override the
  server's defaults for that request.
* A batch: ``POST /search?k=K`` with ``Content-Type: application/json`` and the body ``{"images": [BASE64, ...]}``
  (each a base64-encoded JPEG or PNG file, at most ``MAX_BATCH_IMAGES``) answers ``{"batch": [{"results": [...]},
  ...]}`` in the order given.
* ``GET /health`` answers 200 (``ok``) once the index is loaded.

Bad requests get a 4xx JSON answer ``{"error": "..."}`` naming the problem, and never reach the model, so one bad
request never fails the requests batched with it and the server keeps serving: wrong ``Content-Type`` (415), an
empty body (400), a body over ``--max_image_bytes`` (default 10 MiB, per image; 413), a body that is not an image
(400), a corrupt or truncated image (400), an image format other than JPEG/PNG (415), an image over PIL's
decompression-bomb limit (413), a bad query parameter (400: ``k`` outside ``1..MAX_K``, a bad ``rerank`` /
``threshold`` / ``adaptive``), a bad JSON batch (400). The checks run in :class:`SearchRequestMiddleware` (an ASGI
middleware given to ``LitServer(middlewares=...)``), which also turns the raw image body into the JSON payload
LitServe's request handler reads; decoding runs in a thread, off the event loop.

Request batching: LitServe collects up to ``--max_batch_size`` requests (waiting at most ``--batch_timeout``
seconds) and :class:`SearchAPI` embeds and searches the requests with the same options (``k``, ``rerank``,
``threshold``, ``adaptive``) together. Batching never changes an answer: the embedding of an image does not depend on the
others in its batch (eval mode), nor does a search, re-ranking (each query's own universe) or cut (each query's own
gaps).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import io
import json
import os
import signal
import sys
import warnings
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs

from lightning_dml.errors import UserInputError
from lightning_dml.index.cut import CutOptionError, SearchCut
from lightning_dml.index.rerank import RerankOptionError, parse_rerank

#: Largest accepted image body in bytes (``--max_image_bytes``; per image of a JSON batch)
MAX_IMAGE_BYTES = 10 * 1024 * 1024
#: Most images in one JSON batch request
MAX_BATCH_IMAGES = 64
#: Largest ``k`` a request may ask for
MAX_K = 1000
#: Accepted ``Content-Type`` of a raw image body, and the PIL formats they may hold
IMAGE_TYPES = ("image/jpeg", "image/png")
IMAGE_FORMATS = ("JPEG", "PNG")
SEARCH_PATH = "/search"


class ServeOptionError(UserInputError, ValueError):
    """A ``lightning-dml serve`` option out of range."""


class BadRequest(Exception):
    """A request the server refuses: ``status`` (4xx) and a message naming the problem."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# --------------------------------------------------------------------------------------------- request checks
def decode_image(data: bytes, where: str = "body") -> Any:
    """The PIL image of an encoded JPEG/PNG file, fully decoded (so a truncated file fails here), or
    :class:`BadRequest` naming what is wrong."""
    from PIL import Image, UnidentifiedImageError

    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data))
        except UnidentifiedImageError:
            raise BadRequest(400, f"{where} is not an image ({len(data)} bytes that PIL cannot identify as JPEG "
                                  "or PNG)") from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise BadRequest(413, f"{where}: image too large to decode: {e}") from None
        if image.format not in IMAGE_FORMATS:
            raise BadRequest(415, f"{where} is a {image.format} image; send JPEG or PNG")
        try:
            image.load()
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise BadRequest(413, f"{where}: image too large to decode: {e}") from None
        except (OSError, ValueError, SyntaxError) as e:
            raise BadRequest(400, f"{where} is a corrupt {image.format} image: {e}") from None
    return image


def as_loaded(image: Any) -> Any:
    """The steps of :func:`lightning_dml.data.image_list.load_image` (what ``lightning-dml search`` reads a query
    file with) before its conversion to the model's mode, which the index's embedder does: 8 bits first
    (:func:`~lightning_dml.data.image_list.to_8bit`), a palette image with transparency through ``RGBA``; so an
    uploaded file gives the pixels of the same file searched from disk."""
    from lightning_dml.data.image_list import to_8bit

    image = to_8bit(image)
    if image.mode in ("P", "PA") and "transparency" in image.info:
        image = image.convert("RGBA")
    return image


def parse_query(query_string: str, defaults: dict[str, Any], metric: str = "cosine") -> dict[str, Any]:
    """The per-request options from the query string (``k``, ``threshold``, ``adaptive``, ``rerank``) over the
    server's ``defaults``; :class:`BadRequest` (400) naming a bad or unknown parameter, or a re-ranking the index's
    ``metric`` does not allow."""
    params = parse_qs(query_string, keep_blank_values=True)
    unknown = sorted(set(params) - {"k", "threshold", "adaptive", "rerank"})
    if unknown:
        raise BadRequest(400, f"unknown query parameter(s) {', '.join(unknown)}; accepted: k, threshold, adaptive, "
                              "rerank")
    for name, values in params.items():
        if len(values) > 1:
            raise BadRequest(400, f"query parameter {name!r} given {len(values)} times")
    out = dict(defaults)
    if "k" in params:
        raw = params["k"][0]
        try:
            k = int(raw)
        except ValueError:
            raise BadRequest(400, f"query parameter k={raw!r} is not an integer") from None
        if not 1 <= k <= MAX_K:
            raise BadRequest(400, f"query parameter k={k} outside 1..{MAX_K}")
        out["k"] = k
    try:
        cut = SearchCut.parse(params.get("threshold", [out["threshold"]])[0],
                              params.get("adaptive", [out["adaptive"]])[0])
        rerank = parse_rerank(params.get("rerank", [out["rerank"]])[0])
        if rerank is not None:
            rerank.check_metric(metric)
    except (CutOptionError, RerankOptionError) as e:
        raise BadRequest(400, f"query parameter: {e}") from None
    out.update(threshold=cut.threshold, adaptive=cut.adaptive, rerank=None if rerank is None else rerank.spec())
    return out


class SearchRequestMiddleware:
    """Pure ASGI middleware in front of LitServe's ``POST /search``: checks a request (content type, size, body,
    image, query parameters), answers a bad one with a 4xx JSON error, and passes a good one on as the JSON payload
    ``{"images": [BASE64...], "single": bool, "k", "threshold", "adaptive", "rerank"}`` that :class:`SearchAPI`
    decodes."""

    def __init__(self, app: Any, *, defaults: dict[str, Any], max_image_bytes: int = MAX_IMAGE_BYTES,
                 metric: str = "cosine", path: str = SEARCH_PATH) -> None:
        self.app = app
        self.defaults = defaults
        self.metric = metric
        self.max_image_bytes = int(max_image_bytes)
        self.path = path

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != self.path or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            payload = await self._payload(scope, receive)
        except BadRequest as e:
            await _send_json(send, e.status, {"error": e.message})
            return
        body = json.dumps(payload).encode()
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"content-type", b"content-length")]
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if sent:
                return await receive()  # after the body: wait for the disconnect, as the server would
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app({**scope, "headers": headers}, replay, send)

    async def _payload(self, scope: dict, receive: Any) -> dict[str, Any]:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        content_type = headers.get("content-type", "").split(";")[0].strip().lower()
        options = parse_query(scope.get("query_string", b"").decode("latin-1"), self.defaults, self.metric)
        if content_type in IMAGE_TYPES:
            limit, single = self.max_image_bytes, True
        elif content_type == "application/json":
            limit, single = (self.max_image_bytes * 4 // 3 + 64) * MAX_BATCH_IMAGES, False
        else:
            shown = content_type or "(none)"
            raise BadRequest(415, f"Content-Type {shown} not accepted: send the image file as the body with "
                                  f"Content-Type {' or '.join(IMAGE_TYPES)}, or a JSON batch (application/json)")
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BadRequest(413, f"body of {int(declared)} bytes exceeds the limit of {limit} bytes "
                                  f"(lightning-dml serve --max_image_bytes)")
        data = await _read_body(receive, limit)
        if not data:
            raise BadRequest(400, "empty body: send the image file as the request body")
        if single:
            await asyncio.to_thread(decode_image, data)
            images = [base64.b64encode(data).decode("ascii")]
        else:
            images = await asyncio.to_thread(self._batch_images, data)
        return {"images": images, "single": single, **options}

    def _batch_images(self, data: bytes) -> list[str]:
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadRequest(400, f"JSON batch body is not valid JSON: {e}") from None
        images = doc.get("images") if isinstance(doc, dict) else None
        if not isinstance(images, list) or not images or not all(isinstance(x, str) for x in images):
            raise BadRequest(400, 'JSON batch body must be {"images": [BASE64, ...]} with at least one image')
        if len(images) > MAX_BATCH_IMAGES:
            raise BadRequest(413, f"JSON batch of {len(images)} images exceeds the limit of {MAX_BATCH_IMAGES}")
        for i, text in enumerate(images):
            try:
                raw = base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError):
                raise BadRequest(400, f"images[{i}] is not valid base64") from None
            if not raw:
                raise BadRequest(400, f"images[{i}] is empty")
            if len(raw) > self.max_image_bytes:
                raise BadRequest(413, f"images[{i}] of {len(raw)} bytes exceeds the limit of {self.max_image_bytes} "
                                      "bytes (lightning-dml serve --max_image_bytes)")
            decode_image(raw, where=f"images[{i}]")
        return images


async def _read_body(receive: Any, limit: int) -> bytes:
    chunks, total = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BadRequest(400, "client disconnected before the body was complete")
        chunk = message.get("body", b"")
        total += len(chunk)
        if total > limit:
            raise BadRequest(413, f"body exceeds the limit of {limit} bytes (lightning-dml serve --max_image_bytes)")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _send_json(send: Any, status: int, content: dict) -> None:
    body = json.dumps(content).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


# --------------------------------------------------------------------------------------------- the LitAPI
try:  # LitServe is the `serve` extra: the module imports without it, `lightning-dml serve` names the install
    import litserve as ls

    _LitAPI: type = ls.LitAPI
except ImportError:  # pragma: no cover - exercised only without the extra
    ls = None
    _LitAPI = object


class SearchAPI(_LitAPI):  # type: ignore[misc, valid-type]
    """LitServe API of ``POST /search``: loads the index in each worker (``setup``), decodes the payloads of
    :class:`SearchRequestMiddleware`, embeds a batch of requests in one forward pass and searches it."""

    def __init__(self, index_dir: str, *, max_batch_size: int = 8, batch_timeout: float = 0.01) -> None:
        super().__init__(max_batch_size=max_batch_size, batch_timeout=batch_timeout, api_path=SEARCH_PATH)
        self.index_dir = str(index_dir)
        self.index: Any = None

    def setup(self, device: str) -> None:
        from lightning_dml.index import EmbeddingIndex

        # LitServe's device: "cpu" or "cuda:<i>"; the index puts its model on the first GPU torch sees
        self.index = EmbeddingIndex.load(self.index_dir, device="cpu" if str(device) == "cpu" else "cuda")

    def decode_request(self, request: dict) -> dict:
        # the middleware checked every image; decoding the same bytes again cannot fail
        return {**request, "images": [as_loaded(decode_image(base64.b64decode(s))) for s in request["images"]]}

    def batch(self, inputs: list[dict]) -> list[dict]:
        return list(inputs)

    def predict(self, x: list[dict]) -> list[dict]:
        from lightning_dml.index.search import search_images

        # the requests of a batch with the same options are embedded and searched together, exactly as
        # `lightning-dml search` does (its search_images): same embedding, search, re-ranking, cut and rows
        groups: dict[tuple, list[tuple[int, int]]] = {}
        for r, request in enumerate(x):
            key = (request["k"], request["rerank"], request["threshold"], request["adaptive"])
            groups.setdefault(key, []).extend((r, j) for j in range(len(request["images"])))
        rows: list[list[Any]] = [[None] * len(request["images"]) for request in x]
        for (k, rerank, threshold, adaptive), members in groups.items():
            images = [x[r]["images"][j] for r, j in members]
            found = search_images(self.index, images, k, rerank, SearchCut(threshold, adaptive),
                                  batch_size=len(images))
            for (r, j), result in zip(members, found):
                rows[r][j] = result
        return [{"results": out[0]} if request["single"] else {"batch": [{"results": o} for o in out]}
                for request, out in zip(x, rows)]

    def unbatch(self, output: list[dict]) -> list[dict]:
        return output

    def encode_response(self, output: dict) -> dict:
        return output


def build_server(
    index_dir: str,
    *,
    k: int = 10,
    rerank: str | None = None,
    threshold: float | None = None,
    adaptive: float | None = None,
    max_batch_size: int = 8,
    batch_timeout: float = 0.01,
    max_image_bytes: int = MAX_IMAGE_BYTES,
    accelerator: str = "auto",
    workers_per_device: int = 1,
    timeout: float = 30.0,
    metric: str = "cosine",
) -> Any:
    """The ``LitServer`` of an index folder (``server.run(host=..., port=...)`` starts it); ``metric``: the index's
    (a request's re-ranking is checked against it before it reaches the model)."""
    if ls is None:
        raise ServeOptionError("lightning-dml serve needs LitServe: pip install 'lightning-dml[serve]'")
    defaults = {"k": int(k), "rerank": rerank, "threshold": threshold, "adaptive": adaptive}
    api = SearchAPI(index_dir, max_batch_size=max_batch_size, batch_timeout=batch_timeout)
    return ls.LitServer(
        api,
        accelerator=accelerator,
        workers_per_device=workers_per_device,
        timeout=timeout,
        middlewares=[(SearchRequestMiddleware,
                      {"defaults": defaults, "max_image_bytes": max_image_bytes, "metric": metric})],
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-dml serve",
        description="HTTP search service (LitServe) over an index folder: POST /search?k=K with a JPEG/PNG body "
        "answers the top-k results as JSON; GET /health answers 200. See docs/serving.md.",
    )
    p.add_argument("--index", required=True, help="index folder (lightning-dml index build --out)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1; 0.0.0.0: all)")
    p.add_argument("--k", type=int, default=10, help="results per query unless the request says ?k= (default 10)")
    p.add_argument("--rerank", default=None, help="default re-ranking (as lightning-dml search --rerank)")
    p.add_argument("--threshold", default=None, help="default similarity threshold (as search --threshold)")
    p.add_argument("--adaptive", default=None, help="default adaptive cut N (as search --adaptive)")
    p.add_argument("--max_batch_size", type=int, default=8, help="requests embedded together (default 8)")
    p.add_argument("--batch_timeout", type=float, default=0.01,
                   help="seconds to wait for a batch to fill (default 0.01)")
    p.add_argument("--max_image_bytes", type=int, default=MAX_IMAGE_BYTES,
                   help=f"largest image body in bytes (default {MAX_IMAGE_BYTES}); larger: 413")
    p.add_argument("--accelerator", default="auto", choices=("auto", "cpu", "cuda", "mps"),
                   help="where the model runs (default auto: a GPU when there is one)")
    p.add_argument("--workers_per_device", type=int, default=1, help="model worker processes per device")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds a request may wait (default 30)")
    p.add_argument("--log_level", default="warning", help="uvicorn log level (default warning)")
    return p


def _stop_handler(main_pid: int) -> Any:
    """SIGTERM handler: ``KeyboardInterrupt`` in the main process, so that LitServe stops its API server and model
    workers as on Ctrl+C (without it, a SIGTERM ends the main process and leaves the workers running). Processes
    LitServe forks inherit the handler: there it does what SIGTERM does by default (uvicorn re-raises the signal
    after its own graceful shutdown)."""

    def stop(signum: int, frame: Any) -> None:
        if os.getpid() != main_pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt

    return stop


def main(argv: Sequence[str] | None = None) -> None:
    """``lightning-dml serve ...``: checks the options and the index folder, then serves until interrupted."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if not 0 <= args.port <= 65535:
        raise ServeOptionError(f"--port {args.port} outside 0..65535")
    if not 1 <= args.k <= MAX_K:
        raise ServeOptionError(f"--k {args.k} outside 1..{MAX_K}")
    if args.max_batch_size < 1 or args.workers_per_device < 1:
        raise ServeOptionError("--max_batch_size and --workers_per_device must be >= 1")
    if args.batch_timeout < 0 or not args.timeout > args.batch_timeout:
        raise ServeOptionError(f"--batch_timeout {args.batch_timeout} must be >= 0 and below --timeout {args.timeout}")
    if args.max_image_bytes < 1:
        raise ServeOptionError(f"--max_image_bytes {args.max_image_bytes} must be >= 1")
    cut = SearchCut.parse(args.threshold, args.adaptive)
    rerank = parse_rerank(args.rerank)
    from lightning_dml.index import EmbeddingIndex

    index = EmbeddingIndex.load(args.index)  # a missing or broken folder is reported here, before any worker starts
    metric = index.metric
    if rerank is not None:
        rerank.check_metric(metric)
    del index
    server = build_server(
        args.index, k=args.k, rerank=None if rerank is None else rerank.spec(), threshold=cut.threshold,
        adaptive=cut.adaptive, max_batch_size=args.max_batch_size, batch_timeout=args.batch_timeout,
        max_image_bytes=args.max_image_bytes, accelerator=args.accelerator,
        workers_per_device=args.workers_per_device, timeout=args.timeout, metric=metric,
    )
    print(f"lightning-dml serve: {args.index} on http://{args.host}:{args.port} (POST /search, GET /health)",
          file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, _stop_handler(os.getpid()))  # `kill`: shut down as on Ctrl+C, workers included
    try:
        server.run(host=args.host, port=args.port, generate_client_file=False, log_level=args.log_level,
                   num_api_servers=1)
    except KeyboardInterrupt:  # Ctrl+C or SIGTERM: LitServe has stopped its processes
        print("lightning-dml serve: stopped", file=sys.stderr, flush=True)
