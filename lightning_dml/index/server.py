"""``lightning-dml serve``: an HTTP search service over an index folder, on LitServe (Lightning's serving library).

::

    lightning-dml serve --index DIR --port 8000 [--host 127.0.0.1] [--k 10] [--max_batch_size 8]
        [--batch_timeout 0.01] [--rerank SPEC] [--threshold T] [--adaptive N] [--max_image_bytes BYTES]
        [--max_image_pixels PIXELS] [--max_batch_bytes BYTES] [--max_batch_pixels PIXELS] [--body_timeout S]
        [--max_pending_bytes BYTES]

``--store milvus --uri URI``: ``--index`` names a gallery in a Milvus collection (:mod:`lightning_dml.index.stores`,
:mod:`lightning_dml.index.milvus`), served the same way; Milvus Lite (a ``.db`` URI) is opened by one process at a
time: its one model worker (``--workers_per_device 1``; ``serve`` closes it before the worker starts).

Endpoints:

* ``POST /search?k=K`` with the raw image file as the body (``Content-Type: image/jpeg`` or ``image/png``) answers
  ``{"results": [{"id", "path", "label", "score"}, ...]}`` best first: the ``results`` of ``lightning-dml search
  --index DIR --k K --format json`` for the same image (same embedding, index, re-ranking and cut). Optional
  query parameters ``threshold``, ``adaptive`` and ``rerank`` (as the search command's options) override the
  server's defaults for that request. With a calibrated index (``lightning-dml index calibrate``) each result has
  ``"match": true|false`` (:mod:`lightning_dml.index.calibrate`), and ``matches_only=true`` (or ``serve
  --matches_only``) answers the matches only (400 on an index without a threshold).
* A batch: ``POST /search?k=K`` with ``Content-Type: application/json`` and the body ``{"images": [BASE64, ...]}``
  (each a base64-encoded JPEG or PNG file, at most ``MAX_BATCH_IMAGES``) answers ``{"batch": [{"results": [...]},
  ...]}`` in the order given.
* ``GET /health`` answers 200 (``ok``) once the model worker has loaded the index and its model (503 before);
  ``GET /info`` (LitServe's: the server's devices, workers, timeout) and ``GET /`` are LitServe's own; the OpenAPI
  schema (``/openapi.json``) and the Swagger UI (``/docs``) are switched off.

Bounds, all checked before the model runs (:class:`RequestLimits`; the ``serve`` options of the same names): an
image file is at most ``max_image_bytes`` and ``max_image_pixels`` (width x height as its header declares it,
read before anything is decoded), a JSON batch at most ``MAX_BATCH_IMAGES`` images, ``max_batch_bytes`` of image
files and ``max_batch_pixels`` in total; the body limit follows from them (the raw body: ``max_image_bytes``; a
JSON body: the base64 size of ``max_batch_bytes`` plus ``JSON_OVERHEAD`` per image and ``JSON_SLACK``); the body
must arrive within ``body_timeout`` seconds; the bodies of the requests an API server process holds at once (read
and not yet answered) total at most ``max_pending_bytes`` (503 past it: retry); ``k`` is at most ``MAX_K`` and a
re-ranking's ``candidates`` at most ``MAX_K`` too (its other options within
:data:`~lightning_dml.index.rerank.RERANK_LIMITS`; ``candidates`` and ``n`` are clamped to the gallery size,
:meth:`~lightning_dml.index.rerank.Reranker.search`); the learned pairwise re-ranker's ``top_n`` at most
``MAX_PAIRWISE_TOP_N``, its pairs (images x ``top_n``) at most ``MAX_PAIRWISE_PAIRS`` per request (413), and a
request may use the server's own re-ranker folder (``serve --rerank pairwise:model=DIR``) only
(:func:`check_served_rerank`).

Bad requests get a 4xx JSON answer ``{"error": "..."}`` naming the problem, and never reach the model, so one bad
request never fails the requests batched with it and the server keeps serving: wrong ``Content-Type`` (415), an
empty body (400), a body over its limit (413), a body that does not arrive in time (408), a body that is not an
image (400), a corrupt or truncated image (400), an image format other than JPEG/PNG (415), an image over the pixel
limits (413), a bad query parameter (400: ``k`` outside ``1..MAX_K``, a bad ``rerank`` / ``threshold`` /
``adaptive``), a bad JSON batch (400, also one nested too deeply). Every other error answer, on every route
(LitServe's and FastAPI's 404, 405, 422, 504 timeouts, 503, 500), has the same shape ``{"error": "..."}``
(:class:`JSONErrorMiddleware`, in front of every route). The checks run in
:class:`SearchRequestMiddleware` (an ASGI middleware given to ``LitServer(middlewares=...)``), which also turns the
raw image body into the JSON payload LitServe's request handler reads; decoding runs in a thread, off the event
loop, at most ``DECODE_SLOTS`` images at a time per API server process. Should a search still fail in the model
worker, only the requests of the failing option group get a 500 JSON error; the others of the batch are answered.

Request batching: LitServe collects up to ``--max_batch_size`` requests (waiting at most ``--batch_timeout``
seconds) and :class:`SearchAPI` embeds and searches the requests with the same options (``k``, ``rerank``,
``threshold``, ``adaptive``) together. Each image is decoded and turned into the model's input (resized and
cropped) one at a time, so a batch holds one full-size image at a time. Batching never changes an answer: the
embedding of an image does not depend on the others in its batch (eval mode), nor does a search, re-ranking (each
query's own universe) or cut (each query's own gaps).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import dataclasses
import http
import io
import json
import math
import os
import signal
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs

from lightning_dml.cli_parsing import CommandParser
from lightning_dml.errors import UserInputError
from lightning_dml.index.cut import CutOptionError, SearchCut
from lightning_dml.index.rerank import RerankOptionError, parse_rerank
from lightning_dml.index.stores import add_store_arguments, check_store, close_index, open_index

#: Largest accepted image file in bytes (``--max_image_bytes``; per image of a JSON batch)
MAX_IMAGE_BYTES = 10 * 1024 * 1024
#: Largest accepted image in pixels, width x height from its header (``--max_image_pixels``: 4096 x 4096)
MAX_IMAGE_PIXELS = 4096 * 4096
#: A JSON batch's defaults: at most this many times the per-image bytes and pixels in total
#: (``--max_batch_bytes``, ``--max_batch_pixels``)
BATCH_FACTOR = 4
#: Most images in one JSON batch request
MAX_BATCH_IMAGES = 64
#: Largest ``k`` a request may ask for, and largest re-ranking ``candidates``
MAX_K = 1000
#: Largest ``top_n`` of the learned pairwise re-ranker, and most (query, candidate) pairs it scores per request
MAX_PAIRWISE_TOP_N = 100
MAX_PAIRWISE_PAIRS = 1024
#: Seconds a request's body may take to arrive (``--body_timeout``)
BODY_TIMEOUT = 30.0
#: JSON body allowance beyond the base64 text: per image (quotes, comma, spaces) and per body (braces, key)
JSON_OVERHEAD = 16
JSON_SLACK = 1024
#: Images decoded at once per API server process (each up to ``max_image_pixels``)
DECODE_SLOTS = 2
#: Longest error message sent back (a message quotes what the client sent)
MAX_MESSAGE = 500
#: Accepted ``Content-Type`` of a raw image body, and the PIL formats they may hold
IMAGE_TYPES = ("image/jpeg", "image/png")
IMAGE_FORMATS = ("JPEG", "PNG")
SEARCH_PATH = "/search"


class ServeOptionError(UserInputError, ValueError):
    """A ``lightning-dml serve`` option out of range."""


class BadRequest(Exception):
    """A request the server refuses: ``status`` (4xx) and a message naming the problem; ``close``: the body was not
    read to its end, so the connection is closed after the answer."""

    def __init__(self, status: int, message: str, close: bool = False) -> None:
        if len(message) > MAX_MESSAGE:
            message = message[: MAX_MESSAGE - 3] + "..."
        super().__init__(message)
        self.status = status
        self.message = message
        self.close = close


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What one request may cost before the model runs (module docstring; ``serve`` options of the same names)."""

    max_image_bytes: int = MAX_IMAGE_BYTES
    max_image_pixels: int = MAX_IMAGE_PIXELS
    max_batch_bytes: int = BATCH_FACTOR * MAX_IMAGE_BYTES
    max_batch_pixels: int = BATCH_FACTOR * MAX_IMAGE_PIXELS
    body_timeout: float = BODY_TIMEOUT
    max_pending_bytes: int = BATCH_FACTOR * (4 * (BATCH_FACTOR * MAX_IMAGE_BYTES // 3 + 64) + 2048)

    @classmethod
    def of(cls, max_image_bytes: int = MAX_IMAGE_BYTES, max_image_pixels: int = MAX_IMAGE_PIXELS,
           max_batch_bytes: int | None = None, max_batch_pixels: int | None = None,
           body_timeout: float = BODY_TIMEOUT, max_pending_bytes: int | None = None) -> RequestLimits:
        """The limits, the batch ones defaulting to ``BATCH_FACTOR`` times the per-image ones, the pending bytes to
        ``BATCH_FACTOR`` JSON bodies of the largest size."""
        limits = cls(int(max_image_bytes), int(max_image_pixels),
                     BATCH_FACTOR * int(max_image_bytes) if max_batch_bytes is None else int(max_batch_bytes),
                     BATCH_FACTOR * int(max_image_pixels) if max_batch_pixels is None else int(max_batch_pixels),
                     float(body_timeout))
        pending = BATCH_FACTOR * limits.json_body_bytes if max_pending_bytes is None else int(max_pending_bytes)
        return dataclasses.replace(limits, max_pending_bytes=pending)

    def check(self) -> None:
        """:class:`ServeOptionError` naming an option out of range."""
        for name in ("max_image_bytes", "max_image_pixels", "max_batch_bytes", "max_batch_pixels"):
            if getattr(self, name) < 1:
                raise ServeOptionError(f"--{name} {getattr(self, name)} must be >= 1")
        if self.max_batch_bytes < self.max_image_bytes or self.max_batch_pixels < self.max_image_pixels:
            raise ServeOptionError("--max_batch_bytes and --max_batch_pixels must be at least --max_image_bytes and "
                                   "--max_image_pixels (a batch of one image is a batch)")
        if not (math.isfinite(self.body_timeout) and self.body_timeout > 0):
            raise ServeOptionError(f"--body_timeout {self.body_timeout} must be a number of seconds > 0")
        if self.max_pending_bytes < max(self.max_image_bytes, self.json_body_bytes):
            raise ServeOptionError(f"--max_pending_bytes {self.max_pending_bytes} must be at least the largest body "
                                   f"({max(self.max_image_bytes, self.json_body_bytes)} bytes)")

    @property
    def json_body_bytes(self) -> int:
        """The largest JSON batch body: base64 of ``max_batch_bytes`` (4 characters per 3 bytes of each image,
        rounded up per image), ``JSON_OVERHEAD`` per image and ``JSON_SLACK``."""
        return 4 * (self.max_batch_bytes // 3 + MAX_BATCH_IMAGES) + (JSON_OVERHEAD * MAX_BATCH_IMAGES + JSON_SLACK)


# --------------------------------------------------------------------------------------------- request checks
def open_image(data: bytes, where: str, max_pixels: int) -> Any:
    """The PIL image of an encoded JPEG/PNG file, opened but not decoded (PIL reads the header only), after the
    checks of its format and of its declared size against ``max_pixels``; :class:`BadRequest` otherwise."""
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
        except (OSError, ValueError, SyntaxError) as e:
            raise BadRequest(400, f"{where} is not a readable image: {e}") from None
    if image.format not in IMAGE_FORMATS:
        raise BadRequest(415, f"{where} is a {image.format} image; send JPEG or PNG")
    width, height = image.size
    if width * height > max_pixels:
        raise BadRequest(413, f"{where} is {width} x {height} = {width * height} pixels, over the limit of "
                              f"{max_pixels} pixels (lightning-dml serve --max_image_pixels)")
    return image


def decode_image(data: bytes, where: str = "body", max_pixels: int = MAX_IMAGE_PIXELS) -> Any:
    """The PIL image of an encoded JPEG/PNG file, fully decoded (so a truncated file fails here) once its header
    passed :func:`open_image`, or :class:`BadRequest` naming what is wrong."""
    from PIL import Image

    image = open_image(data, where, max_pixels)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image.load()
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise BadRequest(413, f"{where}: image too large to decode: {e}") from None
        except (OSError, ValueError, SyntaxError, EOFError) as e:
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


def parse_query(query_string: str, defaults: dict[str, Any], metric: str = "cosine",
                calibrated: bool | None = None) -> dict[str, Any]:
    """The per-request options from the query string (``k``, ``threshold``, ``adaptive``, ``rerank``) over the
    server's ``defaults``; :class:`BadRequest` (400) naming a bad or unknown parameter, a re-ranking the index's
    ``metric`` does not allow, or one whose ``candidates`` exceed ``MAX_K``."""
    params = parse_qs(query_string, keep_blank_values=True)
    unknown = sorted(set(params) - {"k", "threshold", "adaptive", "rerank", "matches_only"})
    if unknown:
        raise BadRequest(400, f"unknown query parameter(s) {', '.join(unknown)}; accepted: k, threshold, adaptive, "
                              "rerank, matches_only")
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
            check_served_rerank(rerank, parse_rerank(defaults.get("rerank")))
    except (CutOptionError, RerankOptionError) as e:
        raise BadRequest(400, f"query parameter: {e}") from None
    out.update(threshold=cut.threshold, adaptive=cut.adaptive, rerank=None if rerank is None else rerank.spec())
    if "matches_only" in params:  # calibrated thresholds (lightning_dml.index.calibrate)
        raw = params["matches_only"][0].strip().lower()
        if raw not in ("true", "false", "1", "0"):
            raise BadRequest(400, f"query parameter matches_only={raw!r} must be true or false")
        out["matches_only"] = raw in ("true", "1")
    if out.get("matches_only") and calibrated is False:
        raise BadRequest(400, "query parameter matches_only: the index has no calibrated threshold (lightning-dml "
                              "index calibrate)")
    return out


def check_served_rerank(rerank: Any, served: Any = None) -> None:
    """:class:`~lightning_dml.index.rerank.RerankOptionError` for a re-ranking whose ``candidates`` exceed this
    server's ``MAX_K`` (k-reciprocal's work grows with ``(candidates + 1)^3`` per query, DBA's by one search per
    candidate; the other options are bounded by ``RERANK_LIMITS`` and by the gallery size). The learned pairwise
    re-ranker (:mod:`lightning_dml.index.pairwise`): ``top_n`` at most ``MAX_PAIRWISE_TOP_N`` (one model call per
    pair), and only the re-ranker folder the server was started with (``served``, its ``--rerank``): a request
    never makes the server read another folder."""
    from lightning_dml.index.pairwise import PairwiseRerank

    if isinstance(rerank, PairwiseRerank):
        if rerank.top_n > MAX_PAIRWISE_TOP_N:
            raise RerankOptionError(f"--rerank pairwise: top_n={rerank.top_n} over this server's limit of "
                                    f"{MAX_PAIRWISE_TOP_N}")
        mine = served.model if isinstance(served, PairwiseRerank) else None
        if mine is None or os.path.realpath(rerank.model) != os.path.realpath(mine):
            raise RerankOptionError(f"--rerank pairwise: model={rerank.model} is not this server's re-ranker: a request "
                                    "may re-rank with the folder of serve --rerank pairwise:model=DIR only"
                                    + (f" ({mine})" if mine else " (none)"))
        rerank = rerank.first
    candidates = getattr(rerank, "candidates", None)
    if candidates is not None and candidates > MAX_K:
        raise RerankOptionError(f"--rerank {rerank.name}: candidates={candidates} over this server's limit of {MAX_K}")


def check_pairs(options: dict[str, Any], images: int) -> None:
    """A 413 :class:`BadRequest` when a request's pairwise re-ranking would score more than ``MAX_PAIRWISE_PAIRS``
    (query, candidate) pairs (``top_n`` per image), before the model runs."""
    from lightning_dml.index.pairwise import PairwiseRerank

    rerank = parse_rerank(options.get("rerank"))
    if isinstance(rerank, PairwiseRerank) and images * rerank.top_n > MAX_PAIRWISE_PAIRS:
        raise BadRequest(413, f"{images} image(s) x top_n={rerank.top_n} = {images * rerank.top_n} pairs to re-rank, "
                              f"over this server's limit of {MAX_PAIRWISE_PAIRS} per request")


class SearchRequestMiddleware:
    """Pure ASGI middleware in front of LitServe's ``POST /search``: checks a request (content type, size, body,
    image, query parameters; :class:`RequestLimits`), answers a bad one with a 4xx JSON error, and passes a good one
    on as the JSON payload ``{"images": [BASE64...], "single": bool, "k", "threshold", "adaptive", "rerank"}`` that
    :class:`SearchAPI` decodes."""

    def __init__(self, app: Any, *, defaults: dict[str, Any], max_image_bytes: int = MAX_IMAGE_BYTES,
                 limits: RequestLimits | None = None, metric: str = "cosine", path: str = SEARCH_PATH,
                 calibrated: bool | None = None) -> None:
        self.app = app
        self.defaults = defaults
        self.metric = metric
        self.calibrated = calibrated  # None: not known here (the model worker refuses matches_only then)
        self.limits = RequestLimits.of(max_image_bytes) if limits is None else limits
        self.path = path
        self._decode_slots: asyncio.Semaphore | None = None
        self.pending = 0  # body bytes of the requests read and not yet answered (this process)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != self.path or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        held = [0, 0]  # body bytes counted as pending; 1 once the body was read to its end
        try:
            await self._search(scope, receive, send, held)
        finally:
            self.pending -= held[0]

    def _hold(self, held: list[int], n: int) -> None:
        """Counts ``n`` more body bytes of a request as pending; a 503 when that passes ``max_pending_bytes``."""
        if self.pending + n > self.limits.max_pending_bytes:
            raise BadRequest(503, f"server busy: request bodies of {self.pending} bytes pending, the limit is "
                                  f"{self.limits.max_pending_bytes} (lightning-dml serve --max_pending_bytes); retry",
                             close=True)
        self.pending += n
        held[0] += n

    async def _search(self, scope: dict, receive: Any, send: Any, held: list[int]) -> None:
        try:
            payload = await self._payload(scope, receive, held)
        except BadRequest as e:  # a body left unread (or partly read) closes the connection after the answer
            await _send_json(send, e.status, {"error": e.message}, close=e.close or not held[1])
            return
        body = json.dumps(payload).encode()
        del payload
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"content-type", b"content-length")]
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        sent = False

        async def replay() -> dict:
            nonlocal sent, body
            if sent:
                return await receive()  # after the body: wait for the disconnect, as the server would
            sent = True
            message, body = {"type": "http.request", "body": body, "more_body": False}, b""
            return message

        await self.app({**scope, "headers": headers}, replay, send)

    async def _payload(self, scope: dict, receive: Any, held: list[int]) -> dict[str, Any]:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        content_type = headers.get("content-type", "").split(";")[0].strip().lower()
        options = parse_query(scope.get("query_string", b"").decode("latin-1"), self.defaults, self.metric,
                              self.calibrated)
        if content_type in IMAGE_TYPES:
            limit, single, option = self.limits.max_image_bytes, True, "--max_image_bytes"
        elif content_type == "application/json":
            limit, single, option = self.limits.json_body_bytes, False, "--max_batch_bytes"
        else:
            shown = content_type or "(none)"
            raise BadRequest(415, f"Content-Type {shown} not accepted: send the image file as the body with "
                                  f"Content-Type {' or '.join(IMAGE_TYPES)}, or a JSON batch (application/json)")
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BadRequest(413, f"body of {int(declared)} bytes exceeds the limit of {limit} bytes "
                                  f"(lightning-dml serve {option})", close=True)
        data = await _read_body(receive, limit, self.limits.body_timeout, option, lambda n: self._hold(held, n))
        held[1] = 1
        if not data:
            raise BadRequest(400, "empty body: send the image file as the request body")
        if single:
            await self._decode(decode_image, data, "body", self.limits.max_image_pixels)
            images = [base64.b64encode(data).decode("ascii")]
        else:
            images = await self._batch_images(data)
        check_pairs(options, len(images))
        return {"images": images, "single": single, **options}

    async def _decode(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` in a thread, at most ``DECODE_SLOTS`` at a time in this process."""
        if self._decode_slots is None:
            self._decode_slots = asyncio.Semaphore(DECODE_SLOTS)
        async with self._decode_slots:
            return await asyncio.to_thread(fn, *args)

    async def _batch_images(self, data: bytes) -> list[str]:
        """The base64 images of a JSON batch body after every check: the JSON, each image's base64, bytes and
        header (format, pixels), the batch's bytes and pixels (all headers before any decoding), then each image
        decoded in full, one at a time."""
        raws, images = await asyncio.to_thread(self._batch_files, data)
        for i, raw in enumerate(raws):
            await self._decode(decode_image, raw, f"images[{i}]", self.limits.max_image_pixels)
        return images

    def _batch_files(self, data: bytes) -> tuple[list[bytes], list[str]]:
        try:
            doc = json.loads(data)
        except RecursionError:
            raise BadRequest(400, "JSON batch body is nested too deeply; send {\"images\": [BASE64, ...]}") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadRequest(400, f"JSON batch body is not valid JSON: {e}") from None
        images = doc.get("images") if isinstance(doc, dict) else None
        if not isinstance(images, list) or not images or not all(isinstance(x, str) for x in images):
            raise BadRequest(400, 'JSON batch body must be {"images": [BASE64, ...]} with at least one image')
        if len(images) > MAX_BATCH_IMAGES:
            raise BadRequest(413, f"JSON batch of {len(images)} images exceeds the limit of {MAX_BATCH_IMAGES}")
        raws, total = [], 0
        for i, text in enumerate(images):
            try:
                raw = base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError):
                raise BadRequest(400, f"images[{i}] is not valid base64") from None
            if not raw:
                raise BadRequest(400, f"images[{i}] is empty")
            if len(raw) > self.limits.max_image_bytes:
                raise BadRequest(413, f"images[{i}] of {len(raw)} bytes exceeds the limit of "
                                      f"{self.limits.max_image_bytes} bytes (lightning-dml serve --max_image_bytes)")
            total += len(raw)
            if total > self.limits.max_batch_bytes:
                raise BadRequest(413, f"JSON batch: images[0..{i}] hold {total} bytes, over the limit of "
                                      f"{self.limits.max_batch_bytes} bytes (lightning-dml serve --max_batch_bytes)")
            raws.append(raw)
        pixels = 0
        for i, raw in enumerate(raws):  # headers only: cheap, and before any image is decoded
            width, height = open_image(raw, f"images[{i}]", self.limits.max_image_pixels).size
            pixels += width * height
            if pixels > self.limits.max_batch_pixels:
                raise BadRequest(413, f"JSON batch: images[0..{i}] hold {pixels} pixels, over the limit of "
                                      f"{self.limits.max_batch_pixels} pixels (lightning-dml serve --max_batch_pixels)")
        return raws, images


async def _read_body(receive: Any, limit: int, timeout: float, option: str = "--max_image_bytes",
                     hold: Any = None) -> bytes:
    """The request body, at most ``limit`` bytes (413 past it), all of it within ``timeout`` seconds (408);
    ``hold(n)`` is told of each chunk's size as it arrives (and may refuse it)."""
    chunks, total = [], 0
    deadline = time.monotonic() + timeout
    while True:
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise BadRequest(408, f"body not received within {timeout:g} s ({total} bytes came; lightning-dml serve "
                                  "--body_timeout)", close=True) from None
        if message["type"] == "http.disconnect":
            raise BadRequest(400, "client disconnected before the body was complete", close=True)
        chunk = message.get("body", b"")
        total += len(chunk)
        if total > limit:
            raise BadRequest(413, f"body exceeds the limit of {limit} bytes (lightning-dml serve {option})",
                             close=True)
        if hold is not None:
            hold(len(chunk))
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _send_json(send: Any, status: int, content: dict, close: bool = False) -> None:
    body = json.dumps(content).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:  # the rest of the body is not read: the server closes the connection after the answer
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


#: the most bytes of an error answer that :class:`JSONErrorMiddleware` reads to rewrite it (longer ones: cut)
MAX_ERROR_BODY = 64 * 1024


def error_message(status: int, content_type: str, body: bytes) -> str:
    """The one-line ``error`` of an answer with ``status`` >= 400 from its body: the ``error`` of a JSON
    ``{"error": ...}``, FastAPI's ``{"detail": ...}`` (a string, or the validation errors as ``where: what; ...``),
    else the text itself; an empty body gives the status's name (``Not Found``)."""
    text = body.decode("utf-8", "replace").strip()
    if content_type.startswith("application/json"):
        try:
            doc = json.loads(text)
        except ValueError:
            doc = None
        if isinstance(doc, dict):
            detail = doc.get("error", doc.get("detail"))
            if isinstance(detail, list):  # FastAPI's validation errors: [{"loc": [...], "msg": ...}, ...]
                detail = "; ".join(
                    f"{'.'.join(str(p) for p in d.get('loc', ()))}: {d.get('msg', d)}" if isinstance(d, dict)
                    else str(d) for d in detail
                )
            if detail is not None:
                text = detail if isinstance(detail, str) else json.dumps(detail)
    if not text:
        try:
            text = http.HTTPStatus(status).phrase
        except ValueError:
            text = f"HTTP {status}"
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


class JSONErrorMiddleware:
    """Every error answer of the server (status >= 400, on every route: LitServe's and FastAPI's own 404, 405, 422,
    504 timeouts, 500s and plain-text answers, and :class:`SearchRequestMiddleware`'s 4xx) as one JSON shape,
    ``{"error": "<one line>"}`` with ``Content-Type: application/json`` (:func:`error_message`); the status and the
    other headers (``Allow``, ``Connection: close``, ``Retry-After``) are kept. An exception before any answer
    is a 500 ``{"error": "internal server error ..."}`` (and goes on to the server's log). Answers below 400 pass
    unchanged."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: dict[str, Any] = {}  # the start message of an error answer, while its body is read
        chunks: list[bytes] = []
        started = False

        async def rewrite(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] < 400:
                    await send(message)
                else:
                    held["start"] = message
                return
            if message["type"] != "http.response.body" or "start" not in held:
                await send(message)
                return
            if sum(map(len, chunks)) < MAX_ERROR_BODY:
                chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            start = held.pop("start")
            given = start.get("headers", [])
            headers = [(k, v) for k, v in given if k.lower() not in (b"content-type", b"content-length")]
            ctype = next((v.decode("latin-1").lower() for k, v in given if k.lower() == b"content-type"), "")
            body = b"" if scope.get("method") == "HEAD" else json.dumps(
                {"error": error_message(start["status"], ctype, b"".join(chunks)[:MAX_ERROR_BODY])}).encode()
            headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        try:
            await self.app(scope, receive, rewrite)
        except Exception as error:
            if not started:
                await _send_json(send, 500, {"error": f"internal server error ({type(error).__name__}; see the "
                                                      "server's log)"})
            raise


# --------------------------------------------------------------------------------------------- the LitAPI
try:  # LitServe is the `serve` extra: the module imports without it, `lightning-dml serve` names the install
    import litserve as ls

    _LitAPI: type = ls.LitAPI
except ImportError:  # pragma: no cover - exercised only without the extra
    ls = None
    _LitAPI = object


def model_input(embedder: Any, image: Any) -> Any:
    """The model's input tensor of a PIL image (as :func:`as_loaded` gives it): the index's preprocessing, as the
    index's :class:`~lightning_dml.index.embed.ImageEmbedder` applies it to a PIL image (its ``mode`` and
    ``transform``); ``tests/test_serve_bounds.py`` checks the embedding equals ``index.embed_images``'s."""
    return embedder.transform(image.convert(embedder.mode) if image.mode != embedder.mode else image)


class SearchAPI(_LitAPI):  # type: ignore[misc, valid-type]
    """LitServe API of ``POST /search``: loads the index and its model in each worker (``setup``: a missing or
    broken model fails the start), decodes the payloads of :class:`SearchRequestMiddleware` one image at a time
    into the model's input, embeds a batch of requests and searches it, one group of requests with the same options
    at a time (a group that fails answers its own requests with a 500 JSON error, not the others)."""

    def __init__(self, index_dir: str, *, max_batch_size: int = 8, batch_timeout: float = 0.01,
                 limits: RequestLimits | None = None, store: str = "faiss", uri: str | None = None,
                 runtime: str = "torch") -> None:
        super().__init__(max_batch_size=max_batch_size, batch_timeout=batch_timeout, api_path=SEARCH_PATH)
        self.index_dir = str(index_dir)
        self.runtime = runtime  # torch, or onnx: the folder's ONNX model on ONNX Runtime (lightning_dml.onnx.serve)
        self.store, self.uri = store, uri  # where the gallery is (lightning_dml.index.stores)
        self.limits = RequestLimits() if limits is None else limits
        self.index: Any = None
        self.embedder: Any = None

    def setup(self, device: str) -> None:
        # LitServe's device: "cpu" or "cuda:<i>"; the index puts its model on the first GPU torch sees
        self.index = open_index(self.index_dir, self.store, self.uri, device="cpu" if str(device) == "cpu" else "cuda")
        if self.runtime == "onnx":
            from lightning_dml.onnx.serve import ServedOnnxModel

            self.embedder = ServedOnnxModel(self.index, device)
        else:
            self.embedder = self.index.embedder  # the model, loaded now: a broken one fails here, not in a search

    def decode_request(self, request: dict) -> dict:
        # the middleware checked every image; each is decoded again (the limits again) and at once turned into
        # the model's small input, so that a batch never holds more than one full-size decoded image
        try:
            pixels = [model_input(self.embedder, as_loaded(decode_image(base64.b64decode(text), f"images[{i}]",
                                                                        self.limits.max_image_pixels)))
                      for i, text in enumerate(request["images"])]
        except BadRequest as e:
            return {**request, "images": [], "error": e.message, "status": e.status}
        except Exception as e:  # noqa: BLE001 - this request alone fails, not its batch
            return {**request, "images": [], "error": _failure("decoding", e), "status": 500}
        return {**request, "images": pixels}

    def batch(self, inputs: list[dict]) -> list[dict]:
        return list(inputs)

    def predict(self, x: list[dict]) -> list[dict]:
        import torch

        from lightning_dml.index.search import search_embeddings

        # the requests of a batch with the same options are embedded and searched together, as `lightning-dml
        # search` does (search_images: the same model, preprocessing, search, re-ranking, cut and rows)
        groups: dict[tuple, list[int]] = {}
        out: list[dict] = [{}] * len(x)
        for r, request in enumerate(x):
            if "error" in request:
                out[r] = {"error": request["error"], "status": request["status"]}
                continue
            key = (request["k"], request["rerank"], request["threshold"], request["adaptive"],
                   bool(request.get("matches_only", False)))
            groups.setdefault(key, []).append(r)
        step = max(1, int(getattr(self.embedder, "batch_size", 64)))
        for (k, rerank, threshold, adaptive, matches_only), members in groups.items():
            try:
                pixels = [p for r in members for p in x[r]["images"]]
                with torch.no_grad():
                    queries = torch.cat([
                        self.embedder.model(torch.stack(pixels[s : s + step]).to(self.embedder.device)).float()
                        for s in range(0, len(pixels), step)
                    ])
                found = search_embeddings(self.index, queries, k, rerank, SearchCut(threshold, adaptive),
                                          matches_only, query_inputs=torch.stack(pixels) if rerank else None)
            except Exception as e:  # noqa: BLE001 - the requests of this group fail, not the others of the batch
                for r in members:
                    out[r] = {"error": _failure("search", e), "status": 500}
                continue
            start = 0
            for r in members:
                rows = found[start : start + len(x[r]["images"])]
                start += len(rows)
                out[r] = {"results": rows[0]} if x[r]["single"] else {"batch": [{"results": o} for o in rows]}
        return out

    def unbatch(self, output: list[dict]) -> list[dict]:
        return output

    def encode_response(self, output: dict) -> Any:
        if "error" in output:  # this request's own error status (LitServe passes a Response on unchanged)
            from starlette.responses import JSONResponse

            return JSONResponse({"error": output["error"]}, status_code=int(output["status"]))
        return output


def _failure(what: str, error: Exception) -> str:
    return " ".join(f"{what} failed: {type(error).__name__}: {error}".split())[:MAX_MESSAGE]


def build_server(
    index_dir: str,
    *,
    k: int = 10,
    rerank: str | None = None,
    threshold: float | None = None,
    adaptive: float | None = None,
    max_batch_size: int = 8,
    batch_timeout: float = 0.01,
    limits: RequestLimits | None = None,
    accelerator: str = "auto",
    workers_per_device: int = 1,
    timeout: float = 30.0,
    store: str = "faiss",
    uri: str | None = None,
    metric: str = "cosine",
    matches_only: bool = False,
    calibrated: bool | None = None,
    runtime: str = "torch",
) -> Any:
    """The ``LitServer`` of an index folder (``server.run(host=..., port=...)`` starts it); ``metric``: the index's
    (a request's re-ranking is checked against it before it reaches the model); ``limits``: what a request may
    cost (default :class:`RequestLimits`). LitServe's OpenAPI schema and Swagger UI are switched off."""
    if ls is None:
        raise ServeOptionError("lightning-dml serve needs LitServe: pip install 'lightning-dml[serve]'")
    limits = RequestLimits() if limits is None else limits
    limits.check()
    defaults = {"k": int(k), "rerank": rerank, "threshold": threshold, "adaptive": adaptive,
                "matches_only": bool(matches_only)}
    api = SearchAPI(index_dir, max_batch_size=max_batch_size, batch_timeout=batch_timeout, limits=limits,
                    store=store, uri=uri, runtime=runtime)
    return ls.LitServer(
        api,
        accelerator=accelerator,
        workers_per_device=workers_per_device,
        timeout=timeout,
        disable_openapi_url=True,  # no /openapi.json, hence no /docs either (FastAPI serves /docs from the schema)
        middlewares=[(SearchRequestMiddleware, {"defaults": defaults, "limits": limits, "metric": metric,
                                                "calibrated": calibrated}),
                     JSONErrorMiddleware],  # outside SearchRequestMiddleware: every route's answers
    )


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="lightning-dml serve",
        description="HTTP search service (LitServe) over an index folder: POST /search?k=K with a JPEG/PNG body "
        "answers the top-k results as JSON; GET /health answers 200. See docs/serving.md.",
    )
    p.add_argument("--index", required=True, help="index folder (lightning-dml index build --out)")
    add_store_arguments(p)
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1; 0.0.0.0: all)")
    p.add_argument("--k", type=int, default=10, help="results per query unless the request says ?k= (default 10)")
    p.add_argument("--rerank", default=None, help="default re-ranking (as lightning-dml search --rerank)")
    p.add_argument("--threshold", default=None, help="default similarity threshold (as search --threshold)")
    p.add_argument("--adaptive", default=None, help="default adaptive cut N (as search --adaptive)")
    p.add_argument("--matches_only", action="store_true", help="by default answer only the results that match "
                   "under the index's calibrated threshold (as search --matches_only; ?matches_only=false: all)")
    p.add_argument("--max_batch_size", type=int, default=8, help="requests embedded together (default 8)")
    p.add_argument("--batch_timeout", type=float, default=0.01,
                   help="seconds to wait for a batch to fill (default 0.01)")
    p.add_argument("--max_image_bytes", type=int, default=MAX_IMAGE_BYTES,
                   help=f"largest image file in bytes, raw body or one image of a batch (default {MAX_IMAGE_BYTES}); "
                   "larger: 413")
    p.add_argument("--max_image_pixels", type=int, default=MAX_IMAGE_PIXELS,
                   help=f"largest image in pixels, width x height from its header, checked before decoding (default "
                   f"{MAX_IMAGE_PIXELS} = 4096 x 4096); larger: 413")
    p.add_argument("--max_batch_bytes", type=int, default=None,
                   help=f"most bytes of image files in one JSON batch (default {BATCH_FACTOR} x --max_image_bytes); "
                   "the JSON body limit is its base64 size plus a small allowance")
    p.add_argument("--max_batch_pixels", type=int, default=None,
                   help=f"most pixels of the images of one JSON batch (default {BATCH_FACTOR} x --max_image_pixels)")
    p.add_argument("--max_pending_bytes", type=int, default=None,
                   help=f"most body bytes of requests read and not yet answered, per API server process (default "
                   f"{BATCH_FACTOR} JSON bodies of the largest size); more: 503, retry")
    p.add_argument("--body_timeout", type=float, default=BODY_TIMEOUT,
                   help=f"seconds a request's body may take to arrive (default {BODY_TIMEOUT:g}); slower: 408 and the "
                   "connection closed")
    p.add_argument("--accelerator", default="auto", choices=("auto", "cpu", "cuda", "mps"),
                   help="where the model runs (default auto: a GPU when there is one)")
    p.add_argument("--workers_per_device", type=int, default=1, help="model worker processes per device")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds a request may wait (default 30)")
    p.add_argument("--log_level", default="warning", help="uvicorn log level (default warning)")
    p.add_argument("--runtime", choices=("torch", "onnx"), default="torch",
                   help="torch (default) or onnx: the index's embedding_model.onnx on ONNX Runtime (index build "
                   "--runtime onnx writes it), searched as with torch")
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


def check_model(index: Any, where: str) -> None:
    """Loads the index's model (``index.embedder``, whatever its file format) so that a missing, truncated or
    refused model stops ``serve`` before it starts, in one line (:class:`ServeOptionError`), instead of a server
    whose ``/health`` is fine and whose every search fails."""
    try:
        index.embedder
    except UserInputError:
        raise
    except Exception as error:  # noqa: BLE001 - any loader failure (truncated archive, bad tensors) is one line
        detail = " ".join(f"{type(error).__name__}: {error}".split())[:MAX_MESSAGE]
        raise ServeOptionError(f"--index {where}: its model cannot be loaded ({detail})") from None


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
    limits = RequestLimits.of(args.max_image_bytes, args.max_image_pixels, args.max_batch_bytes,
                              args.max_batch_pixels, args.body_timeout, args.max_pending_bytes)
    limits.check()
    cut = SearchCut.parse(args.threshold, args.adaptive)
    rerank = parse_rerank(args.rerank)
    if rerank is not None:
        check_served_rerank(rerank, rerank)
    check_store(args)
    index = open_index(args.index, args.store, args.uri)  # a missing or broken index: reported before any worker
    metric = index.metric
    if rerank is not None:
        rerank.check_metric(metric)
        if hasattr(rerank, "check_index"):  # pairwise: its folder, base checkpoint and inputs, before serving
            rerank.check_index(index)
    from lightning_dml.index.calibrate import CalibrationError, check_calibration

    calibrated = check_calibration(index.manifest, args.index) is not None  # another checkpoint's: refused here
    if args.matches_only and not calibrated:
        raise CalibrationError(f"--matches_only: the index {args.index} has no calibrated threshold (lightning-dml "
                               "index calibrate)")
    check_model(index, args.index)
    if args.runtime == "onnx":  # its ONNX model loads, or serve stops here in one line
        from lightning_dml.onnx.serve import ServedOnnxModel

        ServedOnnxModel(index, "cpu")
    close_index(index)  # Milvus Lite: the model worker opens the database next
    del index
    server = build_server(
        args.index, k=args.k, rerank=None if rerank is None else rerank.spec(), threshold=cut.threshold,
        adaptive=cut.adaptive, max_batch_size=args.max_batch_size, batch_timeout=args.batch_timeout,
        limits=limits, accelerator=args.accelerator,
        workers_per_device=args.workers_per_device, timeout=args.timeout, metric=metric,
        store=args.store, uri=args.uri,
        matches_only=args.matches_only, calibrated=calibrated, runtime=args.runtime,
    )
    print(f"lightning-dml serve: {args.index} on http://{args.host}:{args.port} (POST /search, GET /health)",
          file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, _stop_handler(os.getpid()))  # `kill`: shut down as on Ctrl+C, workers included
    try:
        server.run(host=args.host, port=args.port, generate_client_file=False, log_level=args.log_level,
                   num_api_servers=1)
    except KeyboardInterrupt:  # Ctrl+C or SIGTERM: LitServe has stopped its processes
        print("lightning-dml serve: stopped", file=sys.stderr, flush=True)
