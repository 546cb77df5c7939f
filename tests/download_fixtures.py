"""A loopback HTTP server for the download tests and archives in the datasets' official formats.

* :class:`FileServer`: ``http.server`` on 127.0.0.1 (port 0, in a thread) serving in-memory files, with HTTP
  ``Range`` support (206 + ``Content-Range``), a request log, and switches to drop a connection halfway (the
  first ``n`` responses of a file send half of it, then close), to answer with an error status, or to wait
  before answering.
* :func:`cub_archive` / :func:`sop_archive`: ``CUB_200_2011.tgz`` (``CUB_200_2011/`` with ``images.txt``,
  ``image_class_labels.txt``, ``classes.txt``, ``bounding_boxes.txt``, ``train_test_split.txt``, ``images/``, and
  ``attributes.txt`` beside it, as in the Caltech archive) and ``Stanford_Online_Products.zip``
  (``Stanford_Online_Products/`` with ``Ebay_train.txt``, ``Ebay_test.txt``, ``Ebay_info.txt`` and the
  ``<super>_final/`` image folders), built from :mod:`tests.fixtures_data`.
* :func:`write_overrides`: a ``LIGHTNING_DML_RESOURCES`` file; :func:`restore_switches`: an autouse fixture (import it)
  restoring the offline/debug switches that ``main(--offline)`` and ``set_offline()`` write into ``os.environ``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import threading
import time
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures_data import make_cub200, make_sop


class FileServer:
    """Serves ``files`` (name -> bytes) at ``http://127.0.0.1:<port>/<name>``; see the module docstring."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.requests: list[tuple[str, str | None]] = []  # (name, Range header)
        self.drop: dict[str, int] = {}  # name -> number of responses still to cut off halfway
        self.status: dict[str, int] = {}  # name -> error status to answer with
        self.delay = 0.0  # seconds to wait before sending a file (lets concurrent clients overlap)
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                name = self.path.lstrip("/")
                server.requests.append((name, self.headers.get("Range")))
                if name in server.status or name not in server.files:
                    self.send_error(server.status.get(name, 404))
                    return
                data = server.files[name]
                time.sleep(server.delay)
                start = 0
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes=") and rng.endswith("-"):
                    start = int(rng[len("bytes="):-1])
                    if start >= len(data):
                        self.send_error(416)
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                body = data[start:]
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                if server.drop.get(name, 0) > 0:
                    server.drop[name] -= 1
                    body = body[: len(body) // 2]
                    self.close_connection = True
                self.wfile.write(body)
                self.wfile.flush()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FileServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/{name}"

    def count(self, name: str) -> int:
        return sum(1 for n, _ in self.requests if n == name)


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tar_gz(folder: Path, names: list[str]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name in names:
            tar.add(folder / name, arcname=name)
    return buffer.getvalue()


def cub_archive(workdir: Path, images_per_class: int = 2) -> bytes:
    """``CUB_200_2011.tgz`` in the Caltech archive's layout (200 classes, ``images_per_class`` tiny JPEGs each)."""
    folder = Path(workdir) / "cub_src"
    if not (folder / "CUB_200_2011" / "images.txt").is_file():
        make_cub200(folder, images_per_class=images_per_class)
        (folder / "attributes.txt").write_text("1 has_bill_shape::curved_(up_or_down)\n2 has_bill_shape::dagger\n")
    return _tar_gz(folder, ["attributes.txt", "CUB_200_2011"])


def sop_archive(workdir: Path) -> bytes:
    """``Stanford_Online_Products.zip`` in the official layout (a small number of products)."""
    folder = Path(workdir) / "sop_src"
    top = make_sop(folder, train_classes=8, test_classes=6, images_per_class=2)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(top.rglob("*")):
            archive.write(path, path.relative_to(folder).as_posix())
    return buffer.getvalue()


def write_overrides(path: Path, weights: dict[str, Any] | None = None, datasets: dict[str, Any] | None = None) -> Path:
    """Write a ``LIGHTNING_DML_RESOURCES`` JSON file and return its path."""
    content = {k: v for k, v in (("weights", weights), ("datasets", datasets)) if v}
    Path(path).write_text(json.dumps(content, indent=1))
    return Path(path)


@pytest.fixture(autouse=True)
def restore_switches():
    """main(--offline/--debug) and set_offline() write os.environ: restore the switches after each test."""
    names = ("LIGHTNING_DML_OFFLINE", "LIGHTNING_DML_DEBUG", "HF_HUB_OFFLINE")
    saved = {name: os.environ.get(name) for name in names}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


__all__ = ["FileServer", "cub_archive", "md5", "restore_switches", "sha256", "sop_archive", "write_overrides"]
