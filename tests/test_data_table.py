"""CSVDataModule and the shared table reader: open-metric-learning's format loads unchanged, every column reaches
the items, names map to ids, validation/test splits, label sets, and one error naming row and column for each kind
of bad table."""

from __future__ import annotations

import csv
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_dml.data import CSVDataModule, ImageFolderDataModule, TableError
from lightning_dml.data.table import (
    compact_labels,
    encode_label_sets,
    encode_names,
    parse_image_table,
    queries_without_relevant_item,
    read_raw_table,
)
from lightning_dml.errors import UserInputError
from tests.fixtures_data import write_jpeg
from tests.fixtures_table import OML_COLUMNS, SIZE, make_oml_table, write_rows

SMALL = {"classes_per_batch": 2, "samples_per_class": 2, "num_workers": 0, "image_size": 16, "eval_batch_size": 8}


def _setup(module, stage: str = "fit") -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module.setup(stage)
    return [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def oml(tmp_path_factory):
    return make_oml_table(tmp_path_factory.mktemp("oml"))


def _table(tmp_path: Path, rows: list[dict], columns: tuple[str, ...], images: int = 0, name: str = "t.csv") -> Path:
    """A table at ``tmp_path/name`` over images ``img/0.jpg .. img/<images - 1>.jpg`` (written when missing)."""
    for i in range(images):
        if not (tmp_path / f"img/{i}.jpg").exists():
            write_jpeg(tmp_path / f"img/{i}.jpg", (10 * i % 250, 40, 90), SIZE)
    return write_rows(tmp_path / name, rows, columns)


def _rows(label_column: list[object], splits: list[str], **columns: list[object]) -> list[dict]:
    rows = [{"path": f"img/{i}.jpg", "label": label, "split": split} for i, (label, split) in enumerate(zip(label_column, splits))]
    for name, values in columns.items():
        for row, value in zip(rows, values):
            row[name] = value
    return rows


# ------------------------------------------------------------------------------------------------ OML's format
def test_an_oml_table_loads_unchanged(oml):
    """A table written in OML's documented format, as pandas writes it (label first, ``True``/``False`` flags, empty
    flags on train rows, float box columns with empty cells), gives every row's path, label, split, flags, category,
    sequence and box to the items."""
    header = oml.file.read_text().splitlines()[0]
    assert header == ",".join(OML_COLUMNS)  # exactly OML's columns, in its order
    assert ",train,,,dresses," in oml.file.read_text() and "2.0,22.0,3.0,18.0" in oml.file.read_text()
    dm = CSVDataModule(oml.file, **SMALL)
    assert not _setup(dm)  # a well-formed table: no warning
    assert dm.class_names == [str(label) for label in range(14)]  # integer labels, numeric order
    assert dm.category_names == ["dresses", "shoes"]
    # OML's tables have train and validation rows: validation rows evaluate, for validation and test alike
    assert dm.test_as_val and dm.val_dataset is dm.test_dataset and not dm.has_validation_split
    train_rows = [r for r in oml.rows if r["split"] == "train"]
    eval_rows = [r for r in oml.rows if r["split"] == "validation"]
    assert len(dm.train_dataset) == len(train_rows) and len(dm.test_dataset) == len(eval_rows)
    by_path = {oml.file.parent / r["path"]: r for r in oml.rows}
    for dataset, evaluation in ((dm.train_dataset, False), (dm.test_dataset, True)):
        for i, path in enumerate(dataset.paths):
            row = by_path[path]
            assert dm.class_names[int(dataset.labels[i])] == str(row["label"])
            assert dm.category_names[int(dataset.category[i])] == row["category"]
            assert dm.sequence_names[int(dataset.sequence[i])] == row["sequence"]
            box = dataset.boxes[i]
            if row["x_1"] is None:
                assert np.isnan(box).all()
            else:
                assert box.tolist() == [row["x_1"], row["y_1"], row["x_2"], row["y_2"]]  # left, top, right, bottom
            if evaluation:
                assert bool(dataset.query_mask[i]) == row["is_query"] and bool(dataset.gallery_mask[i]) == row["is_gallery"]
    # evaluation items are 7-tuples that collate; training items stay (image, label, index)
    batch = next(iter(dm.test_dataloader()))
    assert len(batch) == 7
    image, labels, index, is_query, is_gallery, sequence, category = batch
    assert labels.shape == (8,) and is_query.dtype == torch.bool
    assert torch.equal(is_query, dm.test_dataset.query_mask[index])
    assert torch.equal(sequence, dm.test_dataset.sequence[index]) and torch.equal(category, dm.test_dataset.category[index])
    assert len(dm.train_dataset[0]) == 3


def test_a_box_crops_the_image(tmp_path):
    """``x_1, y_1, x_2, y_2`` = left, top, right, bottom with right and bottom exclusive (PIL's crop, as OML does)."""
    array = np.zeros((20, 24, 3), dtype=np.uint8)
    array[5:15, 4:10] = 255
    from PIL import Image

    (tmp_path / "img").mkdir()
    Image.fromarray(array).save(tmp_path / "img/0.png")
    for i in (1, 2, 3):
        write_jpeg(tmp_path / f"img/{i}.jpg", (200, 0, 0), SIZE)
    rows = [{"path": "img/0.png", "label": 0, "split": "train", "x_1": 4, "y_1": 5, "x_2": 10, "y_2": 15}]
    rows += [{"path": f"img/{i}.jpg", "label": i % 2, "split": s} for i, s in ((1, "train"), (2, "test"), (3, "test"))]
    dm = CSVDataModule(_table(tmp_path, rows, ("path", "label", "split", "x_1", "y_1", "x_2", "y_2")), **SMALL)
    _setup(dm)
    dm.train_dataset.transform = None
    crop = np.asarray(dm.train_dataset[0][0])
    assert crop.shape == (10, 6, 3) and crop.min() == 255  # exactly the white rectangle


# ------------------------------------------------------------------------------------------------ splits
def test_validation_and_test_rows_validate_and_test(tmp_path):
    labels = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    splits = ["train"] * 4 + ["validation"] * 4 + ["test"] * 4
    file = _table(tmp_path, _rows(labels, splits), ("path", "label", "split"), images=12)
    dm = CSVDataModule(file, **SMALL)
    _setup(dm)
    assert dm.has_validation_split and not dm.test_as_val and dm.hparams["test_as_val"] is False
    assert [p.name for p in dm.val_dataset.paths] == ["4.jpg", "5.jpg", "6.jpg", "7.jpg"]
    assert [p.name for p in dm.test_dataset.paths] == ["8.jpg", "9.jpg", "10.jpg", "11.jpg"]
    assert dm.split_datasets["validation"] is dm.val_dataset
    with pytest.raises(TableError, match="has validation rows, and val_classes_fraction=0.5 would validate"):
        CSVDataModule(file, **SMALL, val_classes_fraction=0.5).setup("fit")
    # train and test only: validation as every data module does it (here: classes held out of the training rows)
    test_only = _table(tmp_path, _rows(labels, ["train"] * 8 + ["test"] * 4), ("path", "label", "split"), name="b.csv")
    held = CSVDataModule(test_only, **{**SMALL, "classes_per_batch": 2}, val_classes_fraction=0.5)
    _setup(held)
    assert len(held.val_dataset) == 4 and len(held.train_dataset) == 4 and len(held.test_dataset) == 4
    assert not held.test_as_val


def test_paths_relative_to_images_root_or_absolute(tmp_path):
    images = tmp_path / "data"
    for i in range(6):
        write_jpeg(images / f"img/{i}.jpg", (30 * i, 10, 10), SIZE)
    rows = _rows([0, 0, 1, 1, 2, 2], ["train"] * 4 + ["test"] * 2)
    rows[5]["path"] = str(images / "img/5.jpg")  # absolute
    table = write_rows(tmp_path / "tables" / "t.csv", rows, ("path", "label", "split"))
    with pytest.raises(TableError, match=r"(?s)5 problems:.*row 2, column 'path': no file [^\n]*tables/img/0\.jpg"):
        CSVDataModule(table, **SMALL).setup("fit")  # relative to the table's folder by default
    dm = CSVDataModule(table, images_root=str(images), **SMALL)
    _setup(dm)
    assert dm.test_dataset.paths == [images / "img/4.jpg", images / "img/5.jpg"]


# ------------------------------------------------------------------------------------------------ names, sets
def test_names_map_to_ids_in_sorted_order():
    ids, names = encode_names(["b", None, "10", "2", "a", "2"])
    assert names == ["2", "10", "a", "b"] and ids.tolist() == [3, -1, 1, 0, 2, 0]
    sets, classes = encode_label_sets([("x", "1"), ("1",), (), ("y", "x", "1")])
    assert classes == ["1", "x", "y"]
    assert sets.tolist() == [[0, 1, -1], [0, -1, -1], [-1, -1, -1], [0, 1, 2]]
    assert compact_labels(sets[[1]]).tolist() == [0]  # every row one label: plain labels
    assert compact_labels(sets[[0, 1]]).tolist() == [[0, 1], [0, -1]]  # narrowed to the largest set
    assert compact_labels(sets[[1, 2]]).shape == (2, 1)  # an empty set stays a set (relevant to nothing)


def test_string_labels_and_integers_written_as_floats(tmp_path):
    rows = _rows(["cat", "cat", "dog", "dog", "12.0", "12", "7", "7.0"], ["train"] * 4 + ["test"] * 4,
                 category=["pets", "pets", "pets", "pets", "3.0", "3", "", ""])
    dm = CSVDataModule(_table(tmp_path, rows, ("path", "label", "split", "category"), images=8), **SMALL)
    _setup(dm)
    assert dm.class_names == ["7", "12", "cat", "dog"]
    assert dm.test_dataset.labels.tolist() == [1, 1, 0, 0]  # 12.0 is 12, 7.0 is 7
    assert dm.category_names == ["3", "pets"] and dm.test_dataset.category.tolist() == [0, 0, -1, -1]


def test_label_sets_column(tmp_path):
    rows = _rows(["a", "a", "b", "b", "c", "c", "d", "d"], ["train"] * 4 + ["validation"] * 4,
                 labels=["a;x", "a", "b;x", "b", "c;y", "c", "d;y", ""])
    file = _table(tmp_path, rows, ("path", "label", "labels", "split"), images=8)
    dm = CSVDataModule(file, **SMALL)
    _setup(dm)
    names = dm.class_names
    assert names == ["a", "b", "c", "d", "x", "y"]
    train = [[names[i] for i in row if i >= 0] for row in dm.train_dataset.labels.tolist()]
    assert train == [["a", "x"], ["a"], ["b", "x"], ["b"]]
    test = [[names[i] for i in row if i >= 0] for row in dm.test_dataset.labels.tolist()]
    assert test == [["c", "y"], ["c"], ["d", "y"], ["d"]]  # an empty labels cell: the row's label
    with pytest.raises(ValueError, match="has label sets .* use sampler: label_sets"):
        next(iter(dm.train_dataloader()))
    sets = CSVDataModule(file, **SMALL, sampler="label_sets")
    _setup(sets)
    batch = next(iter(sets.train_dataloader()))
    assert batch[1].shape == (4, 2)  # P x K items, label sets padded to the split's largest set
    evaluation = next(iter(sets.test_dataloader()))
    assert len(evaluation) == 7 and evaluation[1].shape == (4, 2)
    # a label set that does not hold the row's label, and one written as a list
    bad = _rows(["a", "a", "b"], ["train", "train", "test"], labels=["x;y", "[1, 2]", "b"])
    with pytest.raises(TableError) as error:
        CSVDataModule(_table(tmp_path, bad, ("path", "label", "labels", "split"), name="bad.csv"), **SMALL).setup()
    message = str(error.value)
    assert "2 problems" in message
    assert "row 2, column 'labels': the label set 'x;y' does not contain the row's label 'a'" in message
    assert "row 3, column 'labels': unparsable label set '[1, 2]': write the labels separated by ';'" in message


def test_labels_column_alone_and_empty_sets(tmp_path):
    rows = [{"path": f"img/{i}.jpg", "labels": s, "split": sp}
            for i, (s, sp) in enumerate([("1;2", "train"), ("1", "train"), ("2", "train"), ("2;3", "train"),
                                          ("4", "test"), ("4;5", "test"), ("", "test")])]
    dm = CSVDataModule(_table(tmp_path, rows, ("path", "labels", "split"), images=7), **SMALL, sampler="label_sets")
    messages = _setup(dm)
    assert dm.test_dataset.labels.tolist() == [[3, -1], [3, 4], [-1, -1]]  # the distractor: relevant to nothing
    assert any("1 of 3 test queries have no relevant gallery item" in m for m in messages)
    rows[1]["labels"] = ""
    with pytest.raises(TableError, match="row 3, column 'labels': empty label: every training item needs a class"):
        CSVDataModule(_table(tmp_path, rows, ("path", "labels", "split"), name="e.csv"), **SMALL).setup()


# ------------------------------------------------------------------------------------------------ warnings
def test_queries_without_a_relevant_gallery_item_are_counted_in_a_warning(tmp_path):
    # validation: label 5 only as a query; label 6 twice but both in one sequence; label 7 fine
    rows = _rows([0, 0, 1, 1, 5, 6, 6, 7, 7], ["train"] * 4 + ["validation"] * 5,
                 is_query=[None] * 4 + [True, True, True, True, True],
                 is_gallery=[None] * 4 + [False, True, True, True, True],
                 sequence=[None] * 4 + ["s1", "s2", "s2", "s3", "s4"])
    dm = CSVDataModule(_table(tmp_path, rows, ("path", "label", "split", "is_query", "is_gallery", "sequence"),
                              images=9), **SMALL)
    messages = _setup(dm)
    assert [m for m in messages if "queries have no relevant gallery item" in m] == [
        f"image table {dm.root}: 3 of 5 validation queries have no relevant gallery item (their label is absent "
        "from the gallery, or only on items of their own sequence); they count as misses in recall@K and as 0 in "
        "precision@K and mrr (docs/metrics.md)"
    ]


def test_the_count_of_unanswerable_queries_equals_a_brute_force():
    rng = np.random.default_rng(3)
    for trial in range(30):
        n = int(rng.integers(2, 40))
        width = int(rng.integers(1, 4))
        labels = rng.integers(-1, 6, size=(n, width))
        labels = labels if trial % 3 else labels[:, 0].clip(0)
        is_query, is_gallery = rng.random(n) < 0.7, rng.random(n) < 0.7
        sequence = rng.integers(-1, 4, size=n)
        sets = [set(np.atleast_1d(row)[np.atleast_1d(row) >= 0].tolist()) for row in labels]
        expected = sum(
            not any(is_gallery[g] and g != q and (sequence[q] < 0 or sequence[g] != sequence[q]) and sets[q] & sets[g]
                    for g in range(n))
            for q in range(n) if is_query[q]
        )
        assert queries_without_relevant_item(labels, is_query, is_gallery, sequence) == expected


# ------------------------------------------------------------------------------------------------ bad tables
BAD = {
    "unknown split": (lambda r: r[2].update(split="valid"),
                      "row 4, column 'split': unknown split 'valid'; expected train, validation, test"),
    "missing file": (lambda r: r[1].update(path="img/nothere.jpg"), "row 3, column 'path': no file "),
    "x_2 <= x_1": (lambda r: r[0].update(x_1=8, x_2=8), "row 2, column 'x_2': x_2 = 8 is not right of x_1 = 8"),
    "y_2 <= y_1": (lambda r: r[0].update(y_1=9, y_2=3), "row 2, column 'y_2': y_2 = 3 is not below y_1 = 9"),
    "negative box": (lambda r: r[3].update(x_1=-2), "row 5, column 'x_1': negative box coordinate -2"),
    "box outside": (lambda r: r[4].update(x_2=SIZE[0] + 1),
                    f"row 6, column 'x_2': the box (1, 1, {SIZE[0] + 1}, 10) reaches outside the {SIZE[0]}x{SIZE[1]} image"),
    "box not a number": (lambda r: r[0].update(y_2="ten"), "row 2, column 'y_2': 'ten' is not a number"),
    "partial box": (lambda r: r[0].update(y_2=None), "row 2, column 'y_2': empty while other box columns are set"),
    "duplicate": (lambda r: r[4].update(path="img/1.jpg", x_1=1, y_1=1, x_2=10, y_2=10),
                  "row 6, column 'path': {dir}/img/1.jpg is listed again (first at row 3) with the same box"),
    "bad flag": (lambda r: r[4].update(is_query="maybe"),
                 "row 6, column 'is_query': 'maybe' is not a flag; expected true/false, 1/0 or yes/no"),
    "neither query nor gallery": (lambda r: r[5].update(is_query=False, is_gallery="0"),
                                  "row 7, column 'is_query': is_query and is_gallery are both false"),
    "empty label": (lambda r: r[0].update(label=""), "row 2, column 'label': empty label"),
    "empty path": (lambda r: r[0].update(path=""), "row 2, column 'path': empty path"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_table_is_one_error_naming_row_and_column(tmp_path, case):
    damage, expected = BAD[case]
    rows = _rows([0, 0, 1, 1, 2, 2], ["train"] * 4 + ["test"] * 2,
                 x_1=[1] * 6, y_1=[1] * 6, x_2=[10] * 6, y_2=[10] * 6, is_query=[None] * 6, is_gallery=[None] * 6)
    damage(rows)
    columns = ("path", "label", "split", "is_query", "is_gallery", "x_1", "y_1", "x_2", "y_2")
    file = _table(tmp_path, rows, columns, images=6)
    with pytest.raises(TableError) as error:
        CSVDataModule(file, **SMALL).setup("fit")
    message = str(error.value)
    assert isinstance(error.value, UserInputError) and isinstance(error.value, ValueError)
    assert message.startswith(f"image table {file}: a problem:\n  "), message
    assert expected.format(dir=tmp_path) in message, message


def test_every_problem_of_a_table_in_one_error(tmp_path):
    rows = _rows([0, 0, 1, 1, 2, 2, 3], ["train", "trian", "train", "train", "test", "tset", "test"])
    rows[2]["label"] = ""
    file = _table(tmp_path, rows, ("path", "label", "split"), images=7)
    with pytest.raises(TableError) as error:
        CSVDataModule(file, **SMALL).setup()
    lines = str(error.value).splitlines()
    assert lines[0] == f"image table {file}: 3 problems:"
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        "row 3, column 'split'", "row 4, column 'label'", "row 7, column 'split'"
    ]
    many = _rows(list(range(14)), ["x"] * 14)
    with pytest.raises(TableError, match=r"14 problems:(\n  row \d+, column 'split'[^\n]*){10}\n  \.\.\. and 4 more$"):
        CSVDataModule(_table(tmp_path, many, ("path", "label", "split"), images=14, name="m.csv"), **SMALL).setup()


def test_structural_errors_name_the_columns_and_rows(tmp_path):
    (tmp_path / "a.csv").write_text("label,path\n1,img/0.jpg\n")
    with pytest.raises(TableError, match=r"missing required column split; the columns found are label, path"):
        CSVDataModule(tmp_path / "a.csv", **SMALL).setup()
    (tmp_path / "b.csv").write_text("path,split\nimg/0.jpg,train\n")
    with pytest.raises(TableError, match=r"missing required column label \(or labels\); the columns found are path"):
        CSVDataModule(tmp_path / "b.csv", **SMALL).setup()
    (tmp_path / "c.csv").write_text("path,label,split,x_1,x_2\nimg/0.jpg,1,train,1,2\n")
    with pytest.raises(TableError, match="box columns x_1, x_2 without y_1, y_2"):
        CSVDataModule(tmp_path / "c.csv", **SMALL).setup()
    (tmp_path / "d.csv").write_text("path,label,split\nimg/0.jpg,1,train\nimg/1.jpg,1\n\nimg/2.jpg,1,train,x\n")
    with pytest.raises(TableError, match=r"wrong number of fields:\n  row 3: 2 fields, the header has 3 .*\n  row 5: 4"):
        CSVDataModule(tmp_path / "d.csv", **SMALL).setup()
    (tmp_path / "e.csv").write_text("img/0.jpg,1,train\n")
    with pytest.raises(TableError, match="row 1 must be a header naming the columns"):
        CSVDataModule(tmp_path / "e.csv", **SMALL).setup()
    (tmp_path / "f.csv").write_text("path,label,path,split\n")
    with pytest.raises(TableError, match="column 'path' appears twice"):
        CSVDataModule(tmp_path / "f.csv", **SMALL).setup()
    with pytest.raises(Exception, match="is not a file; root must be the table"):
        CSVDataModule(tmp_path / "none.csv", **SMALL).setup()
    for i in range(4):
        write_jpeg(tmp_path / f"img/{i}.jpg", (1, 2, 3), SIZE)
    (tmp_path / "g.csv").write_text("path,label,split\nimg/0.jpg,1,train\nimg/1.jpg,1,train\n")
    with pytest.raises(TableError, match="no validation or test rows: nothing to evaluate"):
        CSVDataModule(tmp_path / "g.csv", **SMALL).setup()
    (tmp_path / "h.csv").write_text("path,label,split\nimg/0.jpg,1,test\n")
    with pytest.raises(TableError, match="no train rows"):
        CSVDataModule(tmp_path / "h.csv", **SMALL).setup()


def test_a_bad_table_through_the_cli_is_one_line_without_traceback(tmp_path, capsys, monkeypatch):
    from lightning_dml.cli import main

    monkeypatch.setattr(sys, "argv", ["lightning-dml"])
    rows = _rows([0, 0, 1, 1], ["train", "train", "tset", "test"])
    file = _table(tmp_path, rows, ("path", "label", "split"), images=4)
    config = Path(__file__).resolve().parents[1] / "configs" / "glyphs_table.yaml"
    with pytest.raises(SystemExit) as exit_status:
        main(["fit", "--config", str(config), "--data.init_args.root", str(file), "--trainer.logger", "false",
              f"--trainer.default_root_dir={tmp_path}"])
    assert exit_status.value.code == 1
    err = capsys.readouterr().err
    assert f"lightning-dml: error: image table {file}: a problem:\n  row 4, column 'split': unknown split 'tset'" in err
    assert "Traceback" not in err


# ------------------------------------------------------------------------------------------------ Parquet, folder
def test_parquet_gives_the_same_datasets_as_csv(oml, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    shutil.copytree(oml.file.parent / "images", tmp_path / "images")
    with oml.file.open() as handle:
        records = list(csv.DictReader(handle))

    def typed(column: str, text: str):
        if text == "":
            return None
        if column in ("is_query", "is_gallery"):
            return text == "True"
        if column in ("x_1", "x_2", "y_1", "y_2"):
            return float(text)
        return int(text) if column == "label" else text

    table = pa.table({c: [typed(c, r[c]) for r in records] for c in OML_COLUMNS})
    pq.write_table(table, tmp_path / "df.parquet")
    csv_dm, pq_dm = CSVDataModule(oml.file, **SMALL), CSVDataModule(tmp_path / "df.parquet", **SMALL)
    _setup(csv_dm), _setup(pq_dm)
    for name in ("train_dataset", "test_dataset"):
        a, b = getattr(csv_dm, name), getattr(pq_dm, name)
        assert [p.relative_to(oml.file.parent) for p in a.paths] == [p.relative_to(tmp_path) for p in b.paths]
        for field in ("labels", "sequence", "category", "query_mask", "gallery_mask"):
            if getattr(a, field) is None:
                assert getattr(b, field) is None, field
            else:
                assert torch.equal(getattr(a, field), getattr(b, field)), field
        np.testing.assert_array_equal(a.boxes, b.boxes)
    # Parquet rows are named by their 0-based index (as pandas shows them)
    bad = table.set_column(2, "split", pa.array(["train"] * (len(records) - 1) + ["valdation"]))
    pq.write_table(bad, tmp_path / "bad.parquet")
    with pytest.raises(TableError, match=f"row index {len(records) - 1}, column 'split': unknown split 'valdation'"):
        CSVDataModule(tmp_path / "bad.parquet", **SMALL).setup()


def test_image_folder_csv_uses_the_same_reader(tmp_path):
    """ImageFolderDataModule's CSV branch (``path,label,split`` with an optional header) reports a table's problems
    as CSVDataModule does."""
    for i in range(4):
        write_jpeg(tmp_path / f"img/{i}.jpg", (1, 2, 3), SIZE)
    (tmp_path / "list.csv").write_text("img/0.jpg,a,train\nimg/1.jpg,a,train\nimg/9.jpg,b,test\nimg/0.jpg,a,train\n")
    with pytest.raises(TableError) as error:
        ImageFolderDataModule(tmp_path / "list.csv", **SMALL).setup()
    message = str(error.value)
    assert "2 problems" in message and "row 3, column 'path': no file" in message
    assert "row 4, column 'path':" in message and "listed again (first at row 1)" in message
    raw = read_raw_table(tmp_path / "list.csv", headerless=("path", "label", "split"))
    assert raw.rows == [1, 2, 3, 4] and raw.columns == ["path", "label", "split"]
    with pytest.raises(TableError, match="unknown split 'validation'; expected train, test, query, gallery"):
        (tmp_path / "v.csv").write_text("path,label,split\nimg/0.jpg,a,validation\n")
        parse_image_table(read_raw_table(tmp_path / "v.csv"), ("train", "test", "query", "gallery"))


# ------------------------------------------------------------------------------------ one file, one item; no "nan" class
@pytest.mark.skipif(sys.platform == "win32", reason="symbolic links need privileges on Windows")
def test_the_same_image_through_a_symbolic_link_is_a_duplicate_naming_both_rows(tmp_path):
    rows = _rows([0, 0, 1, 1, 2, 2], ["train"] * 4 + ["test"] * 2)
    _table(tmp_path, rows, ("path", "label", "split"), images=6)
    (tmp_path / "alias").symlink_to(tmp_path / "img", target_is_directory=True)  # the same folder, another name
    (tmp_path / "img" / "link.jpg").symlink_to(tmp_path / "img" / "2.jpg")  # the same file, another name
    rows[4]["path"] = "alias/1.jpg"  # row 6 is row 3's file
    rows[5]["path"] = "img/link.jpg"  # row 7 is row 4's file
    file = _table(tmp_path, rows, ("path", "label", "split"), name="linked.csv")
    with pytest.raises(TableError) as error:
        CSVDataModule(file, **SMALL).setup("fit")
    message = str(error.value)
    real = (tmp_path / "img").resolve()
    assert "2 problems" in message, message
    assert (f"row 6, column 'path': {tmp_path}/alias/1.jpg is the file {tmp_path}/img/1.jpg of row 3 (both resolve "
            f"to {real}/1.jpg, through a symbolic link)") in message, message
    assert f"row 7, column 'path': {tmp_path}/img/link.jpg is the file {tmp_path}/img/2.jpg of row 4" in message
    # distinct files through a linked folder are distinct items
    rows[4]["path"], rows[5]["path"] = "alias/4.jpg", "alias/5.jpg"
    CSVDataModule(_table(tmp_path, rows, ("path", "label", "split"), name="fine.csv"), **SMALL).setup("fit")


@pytest.mark.skipif(sys.platform == "win32", reason="symbolic links need privileges on Windows")
def test_a_class_folder_linked_twice_is_one_error_naming_both_paths(tmp_path):
    from lightning_dml.data.files import DatasetLayoutError

    for split, classes in (("train", "ab"), ("test", "c")):
        for name in classes:
            for k in range(3):
                write_jpeg(tmp_path / split / name / f"{k}.jpg", (10 * k, 40, 90), SIZE)
    ImageFolderDataModule(tmp_path, **SMALL).setup("fit")
    (tmp_path / "test" / "d").symlink_to(tmp_path / "train" / "a", target_is_directory=True)
    with pytest.raises(DatasetLayoutError) as error:
        ImageFolderDataModule(tmp_path, **SMALL).setup("fit")
    message = str(error.value)
    assert isinstance(error.value, UserInputError)
    assert "3 image(s) reached twice through a symbolic link (test/d/0.jpg is train/a/0.jpg;" in message, message


@pytest.mark.parametrize("missing", ["nan", "NaN", "None", "NULL", "NA", "#N/A", "<NA>"])
def test_a_missing_value_written_as_text_is_an_error_not_a_class(tmp_path, missing):
    rows = _rows([0, missing, 1, missing, 2, missing], ["train"] * 4 + ["test"] * 2)
    file = _table(tmp_path, rows, ("path", "label", "split"), images=6)
    with pytest.raises(TableError) as error:
        CSVDataModule(file, **SMALL).setup("fit")
    message = str(error.value)
    assert message.startswith(f"image table {file}: 3 problems:"), message
    for row, what in ((3, "every training item needs a class"), (5, "every training item needs a class"),
                      (7, "leave the cell empty for an item without a label")):
        assert (f"row {row}, column 'label': {missing!r} is a missing value written as text, not a label name: "
                f"{what}") in message, message
    # the folder data module's CSV branch reads it alike
    (tmp_path / "list.csv").write_text(f"img/0.jpg,a,train\nimg/1.jpg,{missing},train\nimg/2.jpg,b,test\n")
    with pytest.raises(TableError, match=r"row 2, column 'label': .* is a missing value written as text"):
        ImageFolderDataModule(tmp_path / "list.csv", **SMALL).setup()


def test_missing_values_in_label_sets_categories_and_sequences_name_their_columns(tmp_path):
    rows = _rows([0, 0, 1, 1, 2, 2], ["train"] * 4 + ["test"] * 2, labels=["0", "0;nan", "1", "1", "2", "None"],
                 category=["x", "x", "y", "None", "z", "z"], sequence=[None, None, None, None, "s", "NaN"])
    file = _table(tmp_path, rows, ("path", "label", "labels", "split", "category", "sequence"), images=6)
    with pytest.raises(TableError) as error:
        CSVDataModule(file, **SMALL).setup("fit")
    message = str(error.value)
    assert "4 problems" in message, message
    assert "row 3, column 'labels': '0;nan' holds a missing value written as text" in message
    assert "row 7, column 'labels': 'None' holds a missing value written as text" in message
    assert "row 5, column 'category': 'None' is a missing value written as text, not a category name" in message
    assert "row 7, column 'sequence': 'NaN' is a missing value written as text, not a sequence name" in message
    # names that only contain such text are names
    rows = _rows(["nano", "nano", "Nonesuch", "Nonesuch", "na1", "na1"], ["train"] * 4 + ["test"] * 2)
    module = CSVDataModule(_table(tmp_path, rows, ("path", "label", "split"), name="ok.csv"), **SMALL)
    _setup(module)
    assert module.class_names == ["Nonesuch", "na1", "nano"]
