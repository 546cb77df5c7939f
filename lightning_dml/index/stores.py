"""Where a gallery is stored: ``--store faiss`` (default: an index folder, :class:`~lightning_dml.index.EmbeddingIndex`)
or ``--store milvus --uri URI`` (a Milvus collection, :class:`~lightning_dml.index.milvus.MilvusIndex`: a server
``http://host:19530`` or a Milvus Lite database ``./gallery.db``). With ``milvus``, ``--index`` (and ``index build``'s
``--out``) name the collection.

:func:`add_store_arguments` gives a command's parser the options, :func:`check_store` checks them before any work,
:func:`open_index` opens the gallery either way (what ``search``, ``serve``, ``index add`` and ``index evaluate``
call), :func:`close_index` lets another process open a Milvus Lite database again.
"""

from __future__ import annotations

import argparse
from typing import Any

from lightning_dml.errors import UserInputError

__all__ = ["STORES", "StoreOptionError", "add_store_arguments", "check_store", "close_index", "milvus_add_command",
           "milvus_build_command", "open_index"]

STORES = ("faiss", "milvus")


class StoreOptionError(UserInputError, ValueError):
    """``--store`` / ``--uri`` that do not go together."""


def add_store_arguments(parser: argparse.ArgumentParser, *, build: bool = False) -> None:
    """``--store`` and ``--uri`` (and with ``build``, ``--model_dir``) on a command's parser."""
    parser.add_argument("--store", choices=STORES, default="faiss",
                        help="faiss: --index is an index folder (default); milvus: --index names a collection of the "
                             "Milvus at --uri (docs/serving.md 'Milvus')")
    parser.add_argument("--uri", default=None, help="with --store milvus: a Milvus server (http://host:19530) or a "
                        "Milvus Lite database file (./gallery.db)")
    if build:
        parser.add_argument("--model_dir", default=None, help="with --store milvus: the local folder the exported "
                            "model is written to (default: URI.models beside a Milvus Lite .db; needed for a server)")


def check_store(args: argparse.Namespace) -> None:
    """One :class:`StoreOptionError` for ``--uri`` without ``--store milvus`` or the reverse, for ``--runtime onnx``
    with ``milvus`` (an index folder's ONNX model), and for several ``serve`` workers on a Milvus Lite database (one
    process opens it at a time)."""
    if args.store == "milvus" and not args.uri:
        raise StoreOptionError("--store milvus needs --uri (http://host:19530, or ./gallery.db for Milvus Lite)")
    if args.store != "milvus" and (args.uri or getattr(args, "model_dir", None)):
        raise StoreOptionError("--uri and --model_dir go with --store milvus")
    if args.store == "milvus" and getattr(args, "runtime", "torch") != "torch":
        raise StoreOptionError("--runtime onnx works on an index folder (its embedding_model.onnx): leave it out with "
                               "--store milvus")
    local = args.store == "milvus" and not str(args.uri).startswith(("http://", "https://", "tcp://", "grpc://"))
    if local and getattr(args, "workers_per_device", 1) > 1:
        raise StoreOptionError(f"--uri {args.uri} is a Milvus Lite database, which one process opens at a time: "
                               "--workers_per_device 1 (or a Milvus server)")


def open_index(index: str, store: str = "faiss", uri: str | None = None, device: str = "cpu") -> Any:
    """The gallery ``index``: an index folder (``faiss``, :meth:`EmbeddingIndex.load`) or the collection ``index``
    at ``uri`` (``milvus``, :meth:`MilvusIndex.open`); both have the same search API."""
    if store == "milvus":
        from lightning_dml.index.milvus import MilvusIndex

        if not uri:
            raise StoreOptionError("--store milvus needs --uri")
        return MilvusIndex.open(uri, index, device=device)
    if store != "faiss":
        raise StoreOptionError(f"--store {store!r}: one of {', '.join(STORES)}")
    if uri:
        raise StoreOptionError("--uri goes with --store milvus")
    from lightning_dml.index.index import EmbeddingIndex

    return EmbeddingIndex.load(index, device=device)


def close_index(index: Any) -> None:
    """Close a Milvus gallery (a Milvus Lite database is open in one process at a time); nothing for a folder."""
    close = getattr(index, "close", None)
    if close is not None:
        close()


def milvus_build_command(args: argparse.Namespace, kind_options: dict[str, Any]) -> None:
    """``lightning-dml index build --store milvus``: :func:`~lightning_dml.index.milvus.build_milvus_index` into the
    collection ``--out`` at ``--uri`` (a FLAT Milvus index: ``--kind flat``, no kind options, one shard)."""
    import os

    from lightning_dml.index.milvus import MilvusIndex, build_milvus_index, connect, is_local_uri, release

    if args.kind != "flat" or kind_options or args.shards != 1:
        raise StoreOptionError("--store milvus stores a FLAT Milvus collection (exact search): --kind flat without "
                               "--shards or kind options (--nlist, --vectors, ...)")
    if args.batch_size < 1 or args.num_workers < 0:
        raise StoreOptionError("--batch_size must be >= 1, --num_workers >= 0")
    if args.model_dir is None and not is_local_uri(args.uri):
        raise StoreOptionError(f"--uri {args.uri}: give --model_dir, a local folder for the exported model (a Milvus "
                               "server holds vectors, not models)")
    if os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0":
        # before the embedding: the store answers and the name is free (or --overwrite); the other DDP ranks never
        # open it (Milvus Lite opens a database in one process)
        client = connect(args.uri)
        try:
            MilvusIndex.check_name_free(client, args.uri, args.out, args.overwrite)
        finally:  # not held idle through the embedding (its gRPC channel would be dropped meanwhile)
            client.close()
            release(args.uri)
    index = build_milvus_index(
        args.config, args.ckpt_path, args.gallery, uri=args.uri, collection=args.out, model_dir=args.model_dir,
        split=args.split, replace=args.overwrite, accelerator=args.accelerator, devices=args.devices,
        strategy=args.strategy, num_workers=args.num_workers, batch_size=args.batch_size,
        progress=args.progress_bar,
    )
    if index is not None:
        print(f"lightning-dml index: {len(index)} items indexed (flat, {index.metric}, size {index.dim}) in Milvus "
              f"collection {args.out} at {args.uri}; exported model {index.manifest.model}")
        index.close()


def milvus_add_command(args: argparse.Namespace) -> None:
    """``lightning-dml index add --store milvus``: :func:`~lightning_dml.index.milvus.add_milvus_gallery`."""
    from lightning_dml.index.milvus import MilvusIndex, add_milvus_gallery

    index = MilvusIndex.open(args.uri, args.index, device=args.device)
    counts = add_milvus_gallery(index, args.gallery, split=args.split)
    print(f"lightning-dml index: {counts['added']} added, {counts['updated']} re-embedded (changed files), "
          f"{counts['unchanged']} unchanged in Milvus collection {args.index} at {args.uri}")
    index.close()
