"""A user's own data on the first day (issue 27 s.2): a ``val/`` folder is not silently ignored, and
``--data.help CSVDataModule`` says what ``root`` is."""

from __future__ import annotations

import warnings

import pytest

from lightning_dml.data import ImageFolderDataModule
from tests.fixtures_data import make_image_folder

SMALL = {"classes_per_batch": 2, "samples_per_class": 2, "num_workers": 0, "image_size": 16, "eval_batch_size": 8}


@pytest.mark.parametrize("name", ["val", "valid", "validation"])
def test_a_validation_folder_of_a_class_folder_tree_is_said_to_be_ignored(name, tmp_path):
    top = make_image_folder(tmp_path / "tree", train_classes=2, test_classes=2, images_per_class=2)
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        ImageFolderDataModule(top, **SMALL).setup("fit")
    assert not [w for w in quiet if "is ignored" in str(w.message)]
    (top / name / "some_class").mkdir(parents=True)
    with pytest.warns(UserWarning, match=rf"folder {name}/ is ignored: ImageFolderDataModule reads train/ and test/ "
                      r"only .* split 'validation' rows \(CSVDataModule"):
        dm = ImageFolderDataModule(top, **SMALL)
        dm.setup("fit")
    assert "some_class" not in dm.class_names


def test_csv_data_module_help_says_root_is_the_table_file(capsys):
    from lightning_dml.cli import build_cli

    with pytest.raises(SystemExit):
        build_cli(["fit", "--data.help", "CSVDataModule"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--data.root ROOT the table file (``.csv``, ``.tsv``, ``.parquet``)" in text
