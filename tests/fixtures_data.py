"""Builders of small dataset trees in the benchmarks' official on-disk formats (tiny JPEGs, real list-file syntax).

Every builder writes under ``root`` and returns the dataset's *top folder* (the folder a user downloads), e.g.
``root / "CUB_200_2011"``. The data modules accept either ``root`` or the returned folder.

Images are small flat-colour JPEGs. Each image's background colour is :func:`class_color` of its class and, where
the format has bounding boxes (CUB, Cars), the box is filled with :data:`BOX_COLOR`, so a test can tell a cropped
image from a whole one. Counts are configurable; the defaults keep every class split of the real dataset (CUB:
200 classes, Cars: 196) with few images each, so a data module finds the right classes but warns that the image
counts differ from the papers'.

Public API (stable; other test files import it):

* :func:`make_cub200` -> ``root/CUB_200_2011``
* :func:`make_cars196` (``layout="annos"``: ``cars_annos.mat`` + ``car_ims/``; ``layout="devkit"``:
  ``devkit/`` + ``cars_train/`` + ``cars_test/``) -> ``root`` itself (Cars196 has no single top folder)
* :func:`make_sop` -> ``root/Stanford_Online_Products``
* :func:`make_inshop` -> ``root/InShop`` (``list_eval_partition.txt`` + ``img/``)
* :func:`make_image_folder` -> ``root/images`` (``train/<class>/*.jpg`` + ``test/<class>/*.jpg``)
* :func:`make_image_csv` -> the CSV file (``path,label,split``, paths relative to the CSV's folder)
* :func:`write_jpeg`, :func:`class_color`, :func:`corrupt_file`
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
from PIL import Image

#: Colour of the bounding-box region in CUB and Cars fixtures (the background is the class colour).
BOX_COLOR: tuple[int, int, int] = (250, 250, 250)

#: Default image size (width, height) of fixture images; not square, as in the real datasets.
DEFAULT_SIZE: tuple[int, int] = (40, 30)


def class_color(label: int) -> tuple[int, int, int]:
    """A deterministic, fairly saturated RGB colour for class ``label`` (never equal to :data:`BOX_COLOR`)."""
    rng = np.random.default_rng(1000 + int(label))
    r, g, b = (int(v) for v in rng.integers(0, 200, size=3))
    return r, g, b


def write_jpeg(
    path: Path,
    color: tuple[int, int, int],
    size: tuple[int, int] = DEFAULT_SIZE,
    box: tuple[int, int, int, int] | None = None,
    box_color: tuple[int, int, int] = BOX_COLOR,
    quality: int = 95,
    mode: str = "RGB",
) -> Path:
    """Write a flat-colour JPEG of ``size`` (width, height); ``box`` = ``(x1, y1, x2, y2)`` inclusive, 0-based."""
    path.parent.mkdir(parents=True, exist_ok=True)
    array = np.empty((size[1], size[0], 3), dtype=np.uint8)
    array[...] = color
    if box is not None:
        x1, y1, x2, y2 = box
        array[y1 : y2 + 1, x1 : x2 + 1] = box_color
    image = Image.fromarray(array)
    if mode != "RGB":
        image = image.convert(mode)
    image.save(path, format="JPEG", quality=quality, subsampling=0)
    return path


def corrupt_file(path: Path) -> Path:
    """Overwrite ``path`` with bytes no image decoder accepts (for the corrupt-image tests)."""
    Path(path).write_bytes(b"this is not an image\x00\x01\x02")
    return Path(path)


def _box(size: tuple[int, int], i: int) -> tuple[int, int, int, int]:
    """A box that leaves a margin on every side, varying a little with ``i``; 0-based inclusive corners."""
    w, h = size
    x1, y1 = 4 + i % 3, 3 + i % 2
    return x1, y1, w - 6 - i % 2, h - 5


# --------------------------------------------------------------------------------------------- CUB-200-2011
def make_cub200(
    root: Path | str,
    images_per_class: int | list[int] = 3,
    num_classes: int = 200,
    size: tuple[int, int] = DEFAULT_SIZE,
    grayscale_ids: tuple[int, ...] = (),
) -> Path:
    """Write ``root/CUB_200_2011`` in the official layout and return that folder.

    Files: ``classes.txt`` (``<class_id> <name>``), ``images.txt`` (``<image_id> <relative path>``),
    ``image_class_labels.txt`` (``<image_id> <class_id>``), ``bounding_boxes.txt`` (``<image_id> <x> <y> <width>
    <height>``, floats, 0-based pixel coordinates as in the release), ``train_test_split.txt`` (the *closed-set*
    split of the release, which zero-shot retrieval ignores) and ``images/<NNN.Name>/<Name>_<k>.jpg``.
    ``images_per_class`` may be a list (one count per class). Image ids in ``grayscale_ids`` are written as
    single-channel JPEGs (the release has a few).
    """
    top = Path(root) / "CUB_200_2011"
    (top / "images").mkdir(parents=True, exist_ok=True)
    counts = images_per_class if isinstance(images_per_class, list) else [images_per_class] * num_classes
    classes, images, labels, boxes, split = [], [], [], [], []
    image_id = 0
    for c in range(1, num_classes + 1):
        name = f"{c:03d}.Bird_{c}"
        classes.append(f"{c} {name}")
        for k in range(counts[c - 1]):
            image_id += 1
            rel = f"{name}/Bird_{c}_{k:04d}_{image_id}.jpg"
            x1, y1, x2, y2 = _box(size, image_id)
            mode = "L" if image_id in grayscale_ids else "RGB"
            write_jpeg(top / "images" / rel, class_color(c), size, (x1, y1, x2, y2), mode=mode)
            images.append(f"{image_id} {rel}")
            labels.append(f"{image_id} {c}")
            boxes.append(f"{image_id} {float(x1)} {float(y1)} {float(x2 - x1 + 1)} {float(y2 - y1 + 1)}")
            split.append(f"{image_id} {int(k % 2 == 0)}")
    for filename, lines in (
        ("classes.txt", classes),
        ("images.txt", images),
        ("image_class_labels.txt", labels),
        ("bounding_boxes.txt", boxes),
        ("train_test_split.txt", split),
    ):
        (top / filename).write_text("\n".join(lines) + "\n")
    return top


# --------------------------------------------------------------------------------------------- Cars196
def _mat_struct(rows: list[dict[str, object]], fields: list[str]) -> np.ndarray:
    """A MATLAB 1 x N struct array as scipy.io.savemat writes it (object fields)."""
    array = np.zeros((1, len(rows)), dtype=[(f, object) for f in fields])
    for i, row in enumerate(rows):
        for f in fields:
            value = row[f]
            if isinstance(value, str):
                array[0, i][f] = np.array([value])
            else:
                array[0, i][f] = np.array([[value]], dtype=np.uint8 if f in ("class", "test") else np.float64)
    return array


def _class_names(num_classes: int) -> np.ndarray:
    names = np.empty((1, num_classes), dtype=object)
    for c in range(num_classes):
        names[0, c] = np.array([f"Make{c + 1} Model{c + 1} {2000 + c % 13}"])
    return names


def make_cars196(
    root: Path | str,
    layout: str = "annos",
    images_per_class: int | list[int] = 3,
    num_classes: int = 196,
    size: tuple[int, int] = DEFAULT_SIZE,
    test_labels_in: str = "devkit",
) -> Path:
    """Write a Cars196 tree under ``root`` and return ``root`` (the folder holding the Cars files).

    ``layout="annos"``: ``cars_annos.mat`` (struct ``annotations`` with ``relative_im_path`` =
    ``car_ims/NNNNNN.jpg``, ``bbox_x1/y1/x2/y2`` (1-based, inclusive), ``class`` (1-based), ``test``, and
    ``class_names``) + ``car_ims/``.

    ``layout="devkit"``: ``devkit/cars_meta.mat`` (``class_names``), ``devkit/cars_train_annos.mat`` (struct
    ``annotations`` with ``bbox_*``, ``class``, ``fname``), ``cars_test_annos_withlabels.mat`` (the test labels,
    released separately; written to ``devkit/`` or, with ``test_labels_in="root"``, next to ``devkit/``),
    ``devkit/cars_test_annos.mat`` (the unlabelled test list), ``cars_train/NNNNN.jpg``, ``cars_test/NNNNN.jpg``.
    Every other image of a class goes to the official test half (which zero-shot retrieval ignores).
    """
    from scipy.io import savemat

    if layout not in ("annos", "devkit"):
        raise ValueError(f"layout must be 'annos' or 'devkit', got {layout!r}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    counts = images_per_class if isinstance(images_per_class, list) else [images_per_class] * num_classes
    annos, train_annos, test_annos = [], [], []
    n = 0
    for c in range(1, num_classes + 1):
        for k in range(counts[c - 1]):
            n += 1
            x1, y1, x2, y2 = _box(size, n)
            box = {"bbox_x1": x1 + 1, "bbox_y1": y1 + 1, "bbox_x2": x2 + 1, "bbox_y2": y2 + 1, "class": c}
            is_test = k % 2 == 1
            if layout == "annos":
                rel = f"car_ims/{n:06d}.jpg"
                write_jpeg(root / rel, class_color(c), size, (x1, y1, x2, y2))
                annos.append({**box, "relative_im_path": rel, "test": int(is_test)})
            else:
                part = test_annos if is_test else train_annos
                fname = f"{len(part) + 1:05d}.jpg"
                folder = "cars_test" if is_test else "cars_train"
                write_jpeg(root / folder / fname, class_color(c), size, (x1, y1, x2, y2))
                part.append({**box, "fname": fname})
    names = _class_names(num_classes)
    if layout == "annos":
        fields = ["relative_im_path", "bbox_x1", "bbox_y1", "bbox_x2", "bbox_y2", "class", "test"]
        savemat(root / "cars_annos.mat", {"annotations": _mat_struct(annos, fields), "class_names": names})
    else:
        devkit = root / "devkit"
        devkit.mkdir(exist_ok=True)
        fields = ["bbox_x1", "bbox_y1", "bbox_x2", "bbox_y2", "class", "fname"]
        savemat(devkit / "cars_meta.mat", {"class_names": names})
        savemat(devkit / "cars_train_annos.mat", {"annotations": _mat_struct(train_annos, fields)})
        unlabelled = [{k: v for k, v in a.items() if k != "class"} for a in test_annos]
        savemat(
            devkit / "cars_test_annos.mat",
            {"annotations": _mat_struct(unlabelled, [f for f in fields if f != "class"])},
        )
        where = devkit if test_labels_in == "devkit" else root
        savemat(where / "cars_test_annos_withlabels.mat", {"annotations": _mat_struct(test_annos, fields)})
    return root


# --------------------------------------------------------------------------------------------- SOP
_SOP_SUPER = ["bicycle", "cabinet", "chair", "coffee_maker", "fan", "kettle", "lamp", "mug", "sofa", "stapler",
              "table", "toaster"]


def make_sop(
    root: Path | str,
    train_classes: int = 12,
    test_classes: int = 12,
    images_per_class: int | list[int] = 3,
    size: tuple[int, int] = DEFAULT_SIZE,
) -> Path:
    """Write ``root/Stanford_Online_Products`` and return it.

    ``Ebay_train.txt`` / ``Ebay_test.txt``: a header ``image_id class_id super_class_id path`` then one line per
    image, ``class_id`` 1-based and continuing from train to test (the test classes follow the train classes),
    ``path`` = ``<super>_final/<product>_<k>.JPG`` as in the release. ``Ebay_info.txt`` lists both.
    """
    top = Path(root) / "Stanford_Online_Products"
    top.mkdir(parents=True, exist_ok=True)
    total = train_classes + test_classes
    counts = images_per_class if isinstance(images_per_class, list) else [images_per_class] * total
    header = "image_id class_id super_class_id path"
    lines: dict[str, list[str]] = {"train": [header], "test": [header]}
    info = ["image_id class_id super_class_id path"]
    image_id = 0
    for c in range(1, total + 1):
        split = "train" if c <= train_classes else "test"
        super_id = (c - 1) % len(_SOP_SUPER) + 1
        product = 111085122000 + c
        for k in range(counts[c - 1]):
            image_id += 1
            rel = f"{_SOP_SUPER[super_id - 1]}_final/{product}_{k}.JPG"
            write_jpeg(top / rel, class_color(c), size)
            line = f"{image_id} {c} {super_id} {rel}"
            lines[split].append(line)
            info.append(line)
    (top / "Ebay_train.txt").write_text("\n".join(lines["train"]) + "\n")
    (top / "Ebay_test.txt").write_text("\n".join(lines["test"]) + "\n")
    (top / "Ebay_info.txt").write_text("\n".join(info) + "\n")
    return top


# --------------------------------------------------------------------------------------------- In-Shop
def make_inshop(
    root: Path | str,
    train_items: int = 12,
    test_items: int = 10,
    images_per_item: int = 4,
    size: tuple[int, int] = DEFAULT_SIZE,
    list_in_eval_folder: bool = False,
    top_name: str = "InShop",
) -> Path:
    """Write ``root/<top_name>`` (In-shop Clothes Retrieval Benchmark) and return it.

    ``list_eval_partition.txt`` (or ``Eval/list_eval_partition.txt`` with ``list_in_eval_folder``): first line the
    number of images, second line ``image_name item_id evaluation_status``, then ``img/<GENDER>/<Category>/
    id_NNNNNNNN/NN_K_view.jpg  id_NNNNNNNN  train|query|gallery`` (whitespace-aligned as in the release).
    Train items have ``images_per_item`` train images; each test item has one or two query images, the rest
    gallery (so query and gallery share item ids, as in the benchmark).
    """
    top = Path(root) / top_name
    top.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, str, str]] = []
    categories = [("WOMEN", "Dresses"), ("MEN", "Denim"), ("WOMEN", "Blouses_Shirts")]
    views = ["front", "side", "back", "full", "additional"]
    for item in range(1, train_items + test_items + 1):
        item_id = f"id_{item:08d}"
        gender, category = categories[item % len(categories)]
        is_test = item > train_items
        num_query = 1 + item % 2 if is_test else 0
        for k in range(images_per_item):
            rel = f"img/{gender}/{category}/{item_id}/{k // 5 + 1:02d}_{k % 5 + 1}_{views[k % 5]}.jpg"
            write_jpeg(top / rel, class_color(item), size)
            status = "train" if not is_test else ("query" if k < num_query else "gallery")
            rows.append((rel, item_id, status))
    width = max(len(r[0]) for r in rows) + 4
    text = [str(len(rows)), "image_name item_id evaluation_status"]
    text += [f"{rel:<{width}}{item_id:<16}{status}" for rel, item_id, status in rows]
    folder = top / "Eval" if list_in_eval_folder else top
    folder.mkdir(exist_ok=True)
    (folder / "list_eval_partition.txt").write_text("\n".join(text) + "\n")
    return top


# --------------------------------------------------------------------------------------------- user images
def make_image_folder(
    root: Path | str,
    train_classes: int = 6,
    test_classes: int = 5,
    images_per_class: int = 3,
    size: tuple[int, int] = DEFAULT_SIZE,
    extension: str = ".jpg",
) -> Path:
    """Write ``root/images/train/<class>/*.jpg`` and ``root/images/test/<class>/*.jpg``; return ``root/images``.

    Train classes are named ``train_class_XX``, test classes ``test_class_XX`` (disjoint, zero-shot).
    """
    top = Path(root) / "images"
    label = 0
    for split, count in (("train", train_classes), ("test", test_classes)):
        for c in range(count):
            label += 1
            for k in range(images_per_class):
                write_jpeg(top / split / f"{split}_class_{c:02d}" / f"img_{k:03d}{extension}", class_color(label), size)
    return top


def make_image_csv(
    root: Path | str,
    train_classes: int = 6,
    test_classes: int = 5,
    images_per_class: int = 3,
    size: tuple[int, int] = DEFAULT_SIZE,
    header: bool = True,
    filename: str = "dataset.csv",
) -> Path:
    """Write images under ``root/csv_images/`` and a CSV ``path,label,split`` listing them; return the CSV path.

    ``path`` is relative to the CSV's folder, ``label`` a class name (strings like ``"cls_03"``), ``split``
    ``train`` or ``test``. With ``header`` the first row is ``path,label,split``.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rows = [("path", "label", "split")] if header else []
    label = 0
    for split, count in (("train", train_classes), ("test", test_classes)):
        for c in range(count):
            label += 1
            for k in range(images_per_class):
                rel = f"csv_images/cls_{label:02d}_{k}.jpg"
                write_jpeg(root / rel, class_color(label), size)
                rows.append((rel, f"cls_{label:02d}", split))
    path = root / filename
    with path.open("w", newline="") as handle:
        csv.writer(handle).writerows(rows)
    return path


__all__ = [
    "BOX_COLOR",
    "DEFAULT_SIZE",
    "class_color",
    "corrupt_file",
    "make_cars196",
    "make_cub200",
    "make_image_csv",
    "make_image_folder",
    "make_inshop",
    "make_sop",
    "write_jpeg",
]
