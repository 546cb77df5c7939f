"""In-Shop Clothes Retrieval (Liu et al., DeepFashion, CVPR 2016): train / query / gallery.

3,997 items (25,882 images) train; 14,218 query and 12,612 gallery images of 3,985 items (SPEC 1.1). The test
dataset holds the query and gallery images together and tells which is which (``query_mask``,
``gallery_mask``; items ``(image, label, index, is_query, is_gallery)``), so evaluation ranks every query
against the gallery only (MS paper, In-Shop protocol), with nothing removed from the ranking.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lightning_dml.data.files import ImageFilesDataModule, SplitFiles, find_top_folder, read_whitespace_table

INSHOP_LAYOUT = """\
  <root>/<top>/      with <top> one of: InShop, inshop, In-shop, In-shop Clothes Retrieval Benchmark, DeepFashion,
                     or root pointing at this folder
    list_eval_partition.txt     (or Eval/list_eval_partition.txt) line 1: number of images; line 2:
                                image_name item_id evaluation_status; then
                                img/<GENDER>/<Category>/id_XXXXXXXX/NN_K_view.jpg  id_XXXXXXXX  train|query|gallery
    img/...                     the images"""

_TOP_NAMES = ["InShop", "inshop", "In-shop", "In-shop Clothes Retrieval Benchmark", "DeepFashion"]
_LIST = "list_eval_partition.txt"


class InShopDataModule(ImageFilesDataModule):
    """In-Shop Clothes Retrieval: train items train; the test split is query + gallery, evaluated query vs gallery.

    Labels are the item ids (``id_00000001`` -> 1). The ``test_dataset`` exposes boolean ``query_mask`` and
    ``gallery_mask`` tensors and its items are ``(image, label, index, is_query, is_gallery)``; ``DMLModule``
    passes the two flags to ``RetrievalMetrics.update(..., query_mask=, gallery_mask=)``.

    Args:
        root: folder holding the In-Shop top folder, or that folder itself.
        **kwargs: see :class:`~lightning_dml.data.files.ImageFilesDataModule`.
    """

    dataset_name = "In-Shop"
    layout = INSHOP_LAYOUT
    resource_name = "inshop"
    expected_counts = {"train": 25882, "query": 14218, "gallery": 12612, "train classes": 3997, "test classes": 3985}

    def find_top(self) -> Path:
        return find_top_folder(self.root, _TOP_NAMES, [_LIST, f"Eval/{_LIST}"], self.dataset_name, self.layout)

    def read_splits(self, top: Path) -> dict[str, SplitFiles]:
        path = top / _LIST if (top / _LIST).is_file() else top / "Eval" / _LIST
        rows = read_whitespace_table(path, 3, self.dataset_name, skip=2)
        # image names contain no spaces in the release; the last two fields are item id and status
        parsed = []
        for first, second, third in rows:
            fields = f"{first} {second} {third}".rsplit(maxsplit=2)
            image, item, status = fields
            if status not in ("train", "query", "gallery"):
                raise ValueError(f"{self.dataset_name}: {path}: unknown evaluation_status {status!r} in {fields}")
            if not item.startswith("id_") or not item[3:].isdigit():
                raise ValueError(f"{self.dataset_name}: {path}: item id {item!r} is not of the form id_NNNNNNNN")
            parsed.append((top / image, int(item[3:]), status))
        status = np.asarray([p[2] for p in parsed])
        labels = np.asarray([p[1] for p in parsed], dtype=np.int64)
        paths = [p[0] for p in parsed]
        train = np.flatnonzero(status == "train")
        test = np.flatnonzero(status != "train")
        for needed in ("query", "gallery"):  # In-Shop is evaluated query vs gallery: both must be listed
            if not (status == needed).any():
                raise ValueError(
                    f"{self.dataset_name}: {path} lists no '{needed}' image; In-Shop evaluation ranks the query "
                    f"images against the gallery images, so both are needed. Expected layout:\n{self.layout}"
                )
        return {
            "train": SplitFiles([paths[i] for i in train], labels[train]),
            "test": SplitFiles(
                [paths[i] for i in test],
                labels[test],
                query_mask=status[test] == "query",
                gallery_mask=status[test] == "gallery",
            ),
        }
