"""Bad input (issue 7): each case fails early with an error that names the problem, and nothing is written.

Data cases go through the data modules exactly as a run does (``setup`` then the loaders), on small fixture trees
in the official formats (tests/fixtures_data.py). Training cases go through ``Trainer.fit`` / the CLI and check
that the error comes before or at the first step and that no checkpoint was written.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_dml.callbacks import PeriodicCheckpoint
from lightning_dml.checks import check_training_batch
from lightning_dml.cli import build_cli
from lightning_dml.data import SOPDataModule
from lightning_dml.data.base import DMLDataModule, TensorImageDataset
from lightning_dml.data.cub import CUB200DataModule
from lightning_dml.data.files import DatasetLayoutError
from lightning_dml.data.image_list import CorruptImageError
from lightning_dml.data.inshop import InShopDataModule
from lightning_dml.data.samplers import BalancedClassSampler
from lightning_dml.input_checks import check_embeddings, check_finite, check_labels, check_per_row
from lightning_dml.losses import MultiSimilarityLoss, NPairLoss, build_loss
from lightning_dml.metrics import RetrievalMetrics
from lightning_dml.models import SmallConvNet, build_backbone
from lightning_dml.module import DMLModule
from tests.fixtures_data import corrupt_file, make_cub200, make_inshop, make_sop

SMALL = {"image_size": 16, "num_workers": 0, "eval_batch_size": 8, "check_counts": False}


def _sop(root: Path, **kwargs) -> SOPDataModule:
    return SOPDataModule(str(root), classes_per_batch=kwargs.pop("classes_per_batch", 4), samples_per_class=2,
                         **{**SMALL, **kwargs})


def _consume(loader) -> None:
    for _ in loader:
        pass


# ------------------------------------------------------------------------------------ dataset folders
def test_missing_root_names_the_folder_and_the_layout(tmp_path):
    missing = tmp_path / "no_such_folder"
    with pytest.raises(DatasetLayoutError, match=rf"(?s){missing}.*does not exist.*Ebay_train.txt"):
        _sop(missing).setup("fit")


def test_wrong_layout_names_the_missing_list_file(tmp_path):
    top = make_sop(tmp_path)
    (top / "Ebay_test.txt").unlink()
    with pytest.raises(DatasetLayoutError, match=r"(?s)Ebay_test\.txt.*Expected layout"):
        _sop(tmp_path).setup("fit")


def test_cub_folder_without_its_list_files(tmp_path):
    (tmp_path / "CUB_200_2011" / "images").mkdir(parents=True)
    with pytest.raises(DatasetLayoutError, match=r"(?s)CUB.*images\.txt"):
        CUB200DataModule(str(tmp_path), **SMALL).setup("fit")


def test_malformed_list_line_names_file_and_line(tmp_path):
    top = make_sop(tmp_path)
    lines = (top / "Ebay_train.txt").read_text().splitlines()
    lines[3] = "17 5"  # two fields instead of four
    (top / "Ebay_train.txt").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"Ebay_train\.txt line 4: expected 4 fields, got '17 5'"):
        _sop(tmp_path).setup("fit")


def test_malformed_cub_list_line(tmp_path):
    top = make_cub200(tmp_path, images_per_class=2, num_classes=6)
    lines = (top / "image_class_labels.txt").read_text().splitlines()
    lines[2] = "3"
    (top / "image_class_labels.txt").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"image_class_labels\.txt line 3"):
        CUB200DataModule(str(tmp_path), **SMALL).setup("fit")


def test_label_that_is_not_an_integer(tmp_path):
    top = make_sop(tmp_path)
    lines = (top / "Ebay_train.txt").read_text().splitlines()
    first = lines[1].split()
    lines[1] = " ".join([first[0], "chair", *first[2:]])
    (top / "Ebay_train.txt").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"Ebay_train\.txt.*class_id must be an integer"):
        _sop(tmp_path).setup("fit")


def test_non_integer_labels_reaching_sampler_loss_metric_or_training():
    with pytest.raises(ValueError, match="labels must be integers, got dtype float"):
        BalancedClassSampler([0.0, 1.0, 1.0, 0.0], classes_per_batch=2, samples_per_class=2)
    with pytest.raises(ValueError, match="integer"):
        MultiSimilarityLoss()(torch.randn(4, 8), torch.tensor([0.0, 1.0, 1.0, 0.0]))
    with pytest.raises(ValueError, match="labels must be an integer tensor, got dtype torch.float32"):
        RetrievalMetrics().update(torch.randn(4, 8), torch.tensor([0.0, 1.0, 1.0, 0.0]))
    with pytest.raises(ValueError, match=r"training labels \(class ids\) must be an integer tensor, got dtype .*float"):
        check_training_batch(MultiSimilarityLoss(), torch.tensor([0.0, 1.0, 1.0, 0.0]))


def test_shared_input_checks_name_the_problem_and_where():
    """lightning_dml.input_checks: the one implementation behind the loss, metric and training-batch checks."""
    w = "SomeLoss"
    cases = [
        (lambda: check_embeddings([1.0], where=w), r"SomeLoss: embeddings must be a torch.Tensor, got list"),
        (lambda: check_embeddings(torch.zeros(3), where=w), r"SomeLoss: embeddings must be a 2-D tensor \[N, D\]"),
        (lambda: check_embeddings(torch.zeros(3, 2, dtype=torch.long)), "must be a floating point tensor"),
        (lambda: check_embeddings(torch.zeros(0, 2)), r"embeddings is empty \(N = 0 rows\)"),
        (lambda: check_embeddings(torch.zeros(3, 0)), "dimension D = 0"),
        (lambda: check_labels(torch.zeros(3, 1, dtype=torch.long), 3), r"one entry per row of embeddings"),
        (lambda: check_labels(torch.zeros(2, dtype=torch.long), 3), "labels has 2 entries but embeddings has 3 rows"),
        (lambda: check_labels(torch.zeros(3, dtype=torch.bool), 3), "labels must be an integer tensor, got dtype"),
        (lambda: check_per_row(torch.zeros(3, dtype=torch.long), 3, "query_mask", kind="bool"), "query_mask .* bool"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    bad = torch.zeros(5, 2)
    bad[1, 0], bad[3, 1] = float("nan"), float("inf")
    with pytest.raises(ValueError, match=r"^W: x contain non-finite values \(NaN/Inf\) in 2 row\(s\), first at row 1$"):
        check_finite(bad, "x", where="W")
    check_finite(torch.full((2, 2), 3e38))  # a finite sum that overflows is not an error


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_unreadable_image_names_the_file(tmp_path, damage):
    top = make_sop(tmp_path, size=(40, 32))
    victim = sorted((top / "bicycle_final").glob("*.JPG"))[0]
    if damage == "garbage":
        corrupt_file(victim)
    else:  # a JPEG cut in the middle of its scan data
        data = victim.read_bytes()
        victim.write_bytes(data[: len(data) // 2])
    data = _sop(tmp_path, classes_per_batch=12)
    data.setup("fit")
    with pytest.raises(CorruptImageError, match=rf"cannot read image .*{victim.name}"):
        _consume(data.train_dataloader())
        _consume(data.test_dataloader())


def test_unreadable_image_skipped_with_a_warning_when_asked(tmp_path):
    top = make_sop(tmp_path)
    victim = corrupt_file(sorted((top / "bicycle_final").glob("*.JPG"))[0])
    data = _sop(tmp_path, classes_per_batch=12, on_corrupt="skip")
    data.setup("fit")
    with pytest.warns(RuntimeWarning, match=rf"skipping cannot read image .*{victim.name}"):
        for images, labels, *_ in data.train_dataloader():
            assert images.shape[0] == labels.shape[0] == 24  # the batch keeps its P x K shape
        for _ in data.test_dataloader():
            pass


@pytest.mark.parametrize("missing", ["query", "gallery"])
def test_inshop_without_query_or_gallery_images(tmp_path, missing):
    """In-Shop is evaluated query vs gallery: a list without one of them fails at setup, not after an epoch."""
    top = make_inshop(tmp_path)
    other = "gallery" if missing == "query" else "query"
    listing = top / "list_eval_partition.txt"
    listing.write_text(listing.read_text().replace(f" {missing}\n", f" {other}\n"))
    data = InShopDataModule(str(tmp_path), classes_per_batch=4, samples_per_class=2, **SMALL)
    with pytest.raises(ValueError, match=rf"list_eval_partition\.txt lists no '{missing}' image"):
        data.setup("fit")


# ------------------------------------------------------------------------------------ sampler
def test_more_classes_per_batch_than_the_dataset_has(tmp_path):
    make_sop(tmp_path)  # 12 training classes
    data = _sop(tmp_path, classes_per_batch=20)
    data.setup("fit")
    with pytest.raises(ValueError, match="classes_per_batch=20 but the dataset has only 12 classes"):
        data.train_dataloader()


# ------------------------------------------------------------------------------------ names
def test_unknown_loss_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown loss 'multi_similarty'; valid names: .*multi_similarity"):
        build_loss("multi_similarty")
    with pytest.raises(ValueError, match=r"unknown loss 'tripplet'; valid names: .*triplet"):
        DMLModule(SmallConvNet(width=4), loss="tripplet")


def test_unknown_loss_name_through_the_cli():
    with pytest.raises(ValueError, match=r"unknown loss 'nope'; valid names: .*contrastive.*multi_similarity"):
        build_cli(["--model.backbone=lightning_dml.models.SmallConvNet", "--model.loss=nope",
                   "--data=lightning_dml.data.GlyphsDataModule", "--trainer.logger=false"], run=False)


def test_unknown_backbone_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown backbone 'resnet5'; valid names: .*resnet50"):
        build_backbone("resnet5")


# ------------------------------------------------------------------------------------ training
class RandomImages(DMLDataModule):
    """Random 8 x 8 images: 8 train and 4 test classes of 4 images."""

    def build_datasets(self):
        g = torch.Generator().manual_seed(0)
        images = torch.randint(0, 256, (48, 1, 8, 8), dtype=torch.uint8, generator=g)
        labels = torch.arange(48) // 4
        return TensorImageDataset(images[:32], labels[:32]), TensorImageDataset(images[32:], labels[32:])


class NaNAfter(nn.Module):
    """A backbone whose features turn NaN (as after a diverged step)."""

    out_features = 4

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)

    def forward(self, x):
        return self.conv(x).mean(dim=(2, 3)) * float("nan")


class StepRecorder(pl.Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.append(trainer.global_step)


def _fit(module, data, root: Path, recorder: StepRecorder | None = None) -> None:
    recorder = recorder or StepRecorder()
    trainer = pl.Trainer(
        max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=root, callbacks=[recorder, PeriodicCheckpoint(str(root / "checkpoints"), every_n_train_steps=1)],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=data)


def test_nan_embeddings_stop_training_at_the_first_step(tmp_path):
    module = DMLModule(NaNAfter(), embedding_dim=4, clustering=False)
    recorder = StepRecorder()
    message = r"embeddings contain non-finite values \(NaN\) in 16 row\(s\), first at row 0"
    with pytest.raises(ValueError, match=message):
        _fit(module, RandomImages(classes_per_batch=4, samples_per_class=4), tmp_path, recorder)
    assert recorder.steps == [0]  # the very first batch, not after hours of NaN losses
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_inf_embeddings_reaching_the_metric():
    embeddings = torch.randn(6, 4)
    embeddings[2, 1] = float("inf")
    with pytest.raises(ValueError, match=r"non-finite values \(Inf\) in 1 row\(s\), first at row 2"):
        RetrievalMetrics().update(embeddings, torch.tensor([0, 0, 1, 1, 2, 2]))


def test_npair_with_a_sampler_that_gives_no_pairs_fails_before_training(tmp_path):
    module = DMLModule(SmallConvNet(width=4), loss=NPairLoss(), embedding_dim=4, clustering=False)
    data = RandomImages(classes_per_batch=8, samples_per_class=1)
    recorder = StepRecorder()
    with pytest.raises(ValueError, match="NPairLoss needs positive pairs.*samples_per_class=1.*sampler: npair"):
        _fit(module, data, tmp_path, recorder)
    assert recorder.steps == []  # before any batch
    assert not (tmp_path / "checkpoints").exists()


def test_a_batch_without_positive_pairs_from_any_loader_fails_at_the_first_step(tmp_path):
    """A data module without samples_per_class (a user's own loader) is caught on its first batch."""

    class Shuffled(pl.LightningDataModule):
        def train_dataloader(self):
            images = torch.randn(8, 1, 8, 8)
            return torch.utils.data.DataLoader(list(zip(images, torch.arange(8))), batch_size=8)

    module = DMLModule(SmallConvNet(width=4), loss=MultiSimilarityLoss(), embedding_dim=4, clustering=False)
    recorder = StepRecorder()
    with pytest.raises(ValueError, match="MultiSimilarityLoss needs positive pairs.*8 distinct labels"):
        _fit(module, Shuffled(), tmp_path, recorder)
    assert recorder.steps == [0]
    assert not (tmp_path / "checkpoints").exists()
