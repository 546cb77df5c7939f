"""Where the benchmark datasets come from: :data:`RESOURCES`, data-module name -> archives (URL, name, checksum).

``download: true`` on a data module fetches its entry's archives into ``root``, verifies them and unpacks them
(:func:`lightning_dml.download.fetch_dataset`); ``LIGHTNING_DML_RESOURCES`` overrides entries (see
:func:`lightning_dml.download.load_overrides`). Sources of every fact:

* CUB-200-2011: the Caltech DATA record https://data.caltech.edu/records/65de6-vp158 (``CUB_200_2011.tgz``,
  which unpacks to ``CUB_200_2011/`` and ``attributes.txt``). The md5 ``97eceeb196236b17998738112f37df78`` is the
  one the widely used loaders pin for this archive (e.g. ContinualAI/avalanche's ``CUB200`` dataset and the
  torchvision-style ``Cub2011`` loaders derived from TDeVries/cub2011_dataset); the archive's former address at
  www.vision.caltech.edu is listed as a mirror (same file, same md5).
* Stanford Online Products: the official project page http://cvgl.stanford.edu/projects/lifted_struct/ links
  ``ftp://cs.stanford.edu/cs/cvgl/Stanford_Online_Products.zip`` (unpacks to ``Stanford_Online_Products/``). The
  authors publish no checksum; the md5 ``7f73d41a2f44250d4779881525aea32e`` is the one third-party loaders pin
  for this archive (vadimkantorov/metriclearningbench ``stanford_online_products.py``, former
  pytorch-metric-learning ``SOPDataset``), and the data module's count checks (59,551 / 60,502 images, 11,318 /
  11,316 classes) run after extraction. FTP has no ranged requests: an interrupted transfer restarts.
* Cars196: the official page https://ai.stanford.edu/~jkrause/cars/car_dataset.html no longer serves the files
  (torchvision's ``StanfordCars`` says so: https://pytorch.org/vision/stable/generated/torchvision.datasets.StanfordCars.html
  and pytorch/vision#7681): no automatic download; the error names the files to place.
* In-Shop: served from a Google Drive folder linked on
  http://mmlab.ie.cuhk.edu.hk/projects/DeepFashion/InShopRetrieval.html (a web drive, not a plain URL): no
  automatic download; the error names the files to place.
"""

from __future__ import annotations

from lightning_dml.download import DatasetResource, RemoteFile, resolve_entry

__all__ = ["RESOURCES", "dataset_resource"]

#: data-module name -> :class:`~lightning_dml.download.DatasetResource` (page, archives, manual instructions)
RESOURCES: dict[str, DatasetResource] = {
    "cub200": DatasetResource(
        dataset="CUB-200-2011",
        page="https://data.caltech.edu/records/65de6-vp158",
        archives=(
            RemoteFile(
                url="https://data.caltech.edu/records/65de6-vp158/files/CUB_200_2011.tgz",
                file_name="CUB_200_2011.tgz",
                md5="97eceeb196236b17998738112f37df78",
                mirrors=("http://www.vision.caltech.edu/visipedia-data/CUB-200-2011/CUB_200_2011.tgz",),
            ),
        ),
    ),
    "sop": DatasetResource(
        dataset="Stanford Online Products",
        page="http://cvgl.stanford.edu/projects/lifted_struct/",
        archives=(
            RemoteFile(
                url="ftp://cs.stanford.edu/cs/cvgl/Stanford_Online_Products.zip",
                file_name="Stanford_Online_Products.zip",
                md5="7f73d41a2f44250d4779881525aea32e",
            ),
        ),
    ),
    "cars196": DatasetResource(
        dataset="Cars196",
        page="https://ai.stanford.edu/~jkrause/cars/car_dataset.html",
        manual=(
            "the official URL no longer serves the files (torchvision's StanfordCars refuses to download it too). "
            "Get cars_annos.mat and car_ims.tgz (the all-in-one release; unpack car_ims.tgz into car_ims/) from a "
            "copy of the release, e.g. one linked from the official page's archive or a Kaggle copy, or set "
            "LIGHTNING_DML_RESOURCES to a mirror you trust (with its md5 or sha256)."
        ),
    ),
    "inshop": DatasetResource(
        dataset="In-Shop",
        page="http://mmlab.ie.cuhk.edu.hk/projects/DeepFashion/InShopRetrieval.html",
        manual=(
            "the files are served from a Google Drive folder (In-shop Clothes Retrieval Benchmark), which needs a "
            "browser. Download Img/img.zip and Eval/list_eval_partition.txt from the page's link, unzip img.zip "
            "(it holds img/) and put list_eval_partition.txt next to img/, in <root>/InShop/."
        ),
    ),
}


def dataset_resource(name: str) -> DatasetResource:
    """``RESOURCES[name]`` with the fields the ``LIGHTNING_DML_RESOURCES`` file sets for ``name`` replaced."""
    return resolve_entry(RESOURCES, name, "datasets", DatasetResource)
