"""CategoryBalancedSampler (C categories x P classes x K items) and LabelSetSampler (P labels x K items of label
sets): batch composition, DDP sharding into distinct complete batches, exact mid-epoch resume, the data modules'
``sampler=`` choice."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
import torch

from lightning_dml.data import CategoryBalancedSampler, DMLDataModule, LabelSetSampler
from lightning_dml.data.resumable import ResumableDataLoader
from lightning_dml.data.samplers import SeededBatch, batch_seed, take_distinct


def _categorised(classes_per_category: list[int], per_class: int | list[int] = 6, seed: int = 0):
    """``(labels, categories)``: category ``j`` holds ``classes_per_category[j]`` classes (labels ``100 * j + c``),
    items shuffled."""
    labels, categories = [], []
    counts = iter(per_class) if isinstance(per_class, list) else None
    for j, n in enumerate(classes_per_category):
        for c in range(n):
            k = next(counts) if counts is not None else per_class
            labels += [100 * j + c] * k
            categories += [7 + 3 * j] * k  # any integer ids
    order = np.random.default_rng(seed).permutation(len(labels))
    return np.asarray(labels)[order], np.asarray(categories)[order]


def _check_cpk(batch, labels, categories, c: int, p: int, k: int) -> None:
    """C distinct categories, each a block of P distinct classes, each class a block of K items of that class
    (K distinct items when the class has at least K)."""
    assert len(batch) == c * p * k
    batch = np.asarray(batch)
    blocks = batch.reshape(c, p, k)
    assert len({int(categories[b[0, 0]]) for b in blocks}) == c
    for block in blocks:
        assert len(set(categories[block.ravel()].tolist())) == 1  # the category block is one category
        assert len({int(labels[group[0]]) for group in block}) == p  # P distinct classes
        for group in block:
            assert len(set(labels[group].tolist())) == 1  # a class group is one class
            if int((labels == labels[group[0]]).sum()) >= k:
                assert len(set(group.tolist())) == k  # K distinct items


@pytest.mark.parametrize("weights", ["classes", "uniform"])
@pytest.mark.parametrize("c,p,k", [(2, 3, 2), (3, 2, 4), (1, 4, 3)])
def test_category_batches_are_c_categories_p_classes_k_items(c, p, k, weights):
    labels, categories = _categorised([4, 6, 9, 5], per_class=[3, 6, 5, 4, 6, 2, 8, 6] * 3)
    sampler = CategoryBalancedSampler(labels, categories, c, p, k, seed=1, num_replicas=1, rank=0,
                                      category_weights=weights)
    assert sampler.batch_size == c * p * k and len(sampler) == max(1, len(labels) // (c * p * k))
    batches = list(sampler)
    assert len(batches) == len(sampler)
    for batch in batches:
        assert isinstance(batch, SeededBatch)
        _check_cpk(batch, labels, categories, c, p, k)


def test_uniform_categories_and_the_classes_of_a_category_come_in_rounds():
    """``category_weights="uniform"``: every category once per round (counts differ by at most one after every
    batch); within a category, every class once per round of that category's classes."""
    labels, categories = _categorised([3, 5, 7, 4], per_class=40)
    sampler = CategoryBalancedSampler(labels, categories, 3, 2, 2, seed=0, num_replicas=1, rank=0,
                                      category_weights="uniform")
    category_uses, class_uses = Counter(), Counter()
    for batch in sampler:
        batch = np.asarray(batch)
        category_uses.update(set(categories[batch].tolist()))
        class_uses.update(set(labels[batch].tolist()))
        counts = [category_uses[cat] for cat in np.unique(categories)]
        assert max(counts) - min(counts) <= 1
    for j in range(4):
        in_category = [class_uses[label] for label in np.unique(labels[labels // 100 == j])]
        assert max(in_category) - min(in_category) <= 1, (j, in_category)


def test_class_weighted_categories_draw_every_class_about_equally_often():
    """``category_weights="classes"`` (OML's ``weight_categories=True``): a category is drawn in proportion to its
    number of classes, so a class of a big category is drawn as often as one of a small category (classes are
    taken in rounds within each category), unlike uniform category draws."""
    labels, categories = _categorised([2, 12], per_class=200)
    draws = {}
    for weights in ("classes", "uniform"):
        sampler = CategoryBalancedSampler(labels, categories, 1, 2, 2, seed=0, num_replicas=1, rank=0,
                                          category_weights=weights)
        uses = Counter()
        for batch in sampler:
            uses.update(set(labels[np.asarray(batch)].tolist()))
        small = np.mean([uses[c] for c in (0, 1)])
        big = np.mean([uses[c] for c in range(100, 112)])
        draws[weights] = small / big
    assert 0.6 < draws["classes"] < 1.6  # ~1: every class alike (700 batches)
    assert draws["uniform"] > 4  # ~6: the 2 classes of the small category drawn every other batch


@pytest.mark.parametrize("world", [2, 3])
def test_category_sampler_shards_distinct_complete_batches_over_ranks(world):
    labels, categories = _categorised([4, 5, 6], per_class=5)
    c, p, k = 2, 2, 2
    single = list(CategoryBalancedSampler(labels, categories, c, p, k, seed=5, num_replicas=1, rank=0))
    ranks = [list(CategoryBalancedSampler(labels, categories, c, p, k, seed=5, num_replicas=world, rank=r,
                                          augmentation_seed=4)) for r in range(world)]
    assert len({len(r) for r in ranks}) == 1 and len(ranks[0]) == max(1, len(labels) // (c * p * k) // world)
    for r, batches in enumerate(ranks):
        for step, batch in enumerate(batches):
            _check_cpk(batch, labels, categories, c, p, k)
            assert batch == single[step * world + r]  # rank r takes global batches r, r + W, ...
            assert batch.seed == batch_seed(4, 0, step * world + r)
    # within one step the ranks' batches differ
    for step in range(len(ranks[0])):
        assert len({tuple(ranks[r][step]) for r in range(world)}) == world


@pytest.mark.parametrize("sampler_kind", ["category", "label_sets"])
@pytest.mark.parametrize("world", [1, 2])
def test_exact_mid_epoch_resume(sampler_kind, world):
    """A sampler restored from ``state_dict`` at position ``n`` of an epoch yields exactly the batches (and batch
    seeds) the uninterrupted one yields after its first ``n``, on every rank; the next epoch is whole again."""
    def build(rank):
        if sampler_kind == "category":
            labels, categories = _categorised([4, 5, 6], per_class=6)
            return CategoryBalancedSampler(labels, categories, 2, 2, 2, seed=3, num_replicas=world, rank=rank,
                                           augmentation_seed=11)
        return LabelSetSampler(_label_sets(60), 3, 2, seed=3, num_replicas=world, rank=rank, augmentation_seed=11)

    for rank in range(world):
        full = build(rank)
        full.set_epoch(2)
        expected = list(full)
        assert len(expected) >= 4
        for position in (0, 1, len(expected) - 1, len(expected)):
            state = dict(full.state_dict(), position=position)
            resumed = build(rank)
            resumed.augmentation_seed = 99  # the saved augmentation seed wins
            resumed.load_state_dict(state)
            rest = list(resumed)
            assert rest == expected[position:]
            assert [b.seed for b in rest] == [b.seed for b in expected[position:]]
        resumed.set_epoch(3)
        full.set_epoch(3)
        assert list(resumed) == list(full)


def test_category_sampler_resumes_through_the_resumable_loader():
    labels, categories = _categorised([3, 4, 5], per_class=4)

    def loader():
        sampler = CategoryBalancedSampler(labels, categories, 2, 2, 2, seed=0, num_replicas=1, rank=0)
        return ResumableDataLoader(torch.arange(len(labels)), batch_sampler=sampler)

    full = loader()
    full.batch_sampler.set_epoch(1)
    expected = [b.tolist() for b in full]
    interrupted = loader()
    interrupted.batch_sampler.set_epoch(1)
    iterator = iter(interrupted)
    seen = [next(iterator).tolist() for _ in range(2)]
    resumed = loader()
    resumed.load_state_dict(interrupted.state_dict())
    resumed.batch_sampler.set_epoch(1)
    assert seen + [b.tolist() for b in resumed] == expected


def test_category_sampler_errors_name_the_problem():
    labels, categories = _categorised([3, 5], per_class=3)
    with pytest.raises(ValueError, match=r"classes_per_batch=4 distinct classes per category, but 1 categories have "
                                         r"fewer \(category 7: 3 classes\)"):
        CategoryBalancedSampler(labels, categories, 1, 4, 2, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="categories_per_batch=3 but the data has only 2 categories"):
        CategoryBalancedSampler(labels, categories, 3, 2, 2, num_replicas=1, rank=0)
    mixed = categories.copy()
    mixed[np.flatnonzero(labels == 1)[0]] = 10  # one item of class 1 (category 7) in category 10
    with pytest.raises(ValueError, match=r"class 1 has items in 2 categories \(\[7, 10\]\)"):
        CategoryBalancedSampler(labels, mixed, 1, 2, 2, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="categories must have shape"):
        CategoryBalancedSampler(labels, categories[:-1], 1, 2, 2, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="category_weights must be"):
        CategoryBalancedSampler(labels, categories, 1, 2, 2, num_replicas=1, rank=0, category_weights="size")


# ------------------------------------------------------------------------------------------------ label sets
def _label_sets(n: int, seed: int = 0, labels: int = 8, width: int = 3) -> np.ndarray:
    """``[n, width]`` label sets padded with -1: every item one to ``width`` distinct labels of ``0 .. labels-1``."""
    rng = np.random.default_rng(seed)
    out = np.full((n, width), -1, dtype=np.int64)
    for i in range(n):
        size = int(rng.integers(1, width + 1))
        out[i, :size] = np.sort(rng.choice(labels, size=size, replace=False))
    return out


@pytest.mark.parametrize("p,k", [(3, 2), (4, 3), (2, 5)])
def test_label_set_batches_are_p_labels_times_k_items_carrying_them(p, k):
    sets = _label_sets(80)
    sampler = LabelSetSampler(sets, p, k, seed=2, num_replicas=1, rank=0)
    members = {label: set(np.flatnonzero((sets == label).any(axis=1)).tolist()) for label in range(8)}
    assert list(sampler.classes) == list(range(8))
    assert [set(m.tolist()) for m in sampler.members] == [members[label] for label in range(8)]
    assert len(sampler) == 80 // (p * k)
    for batch in sampler:
        assert len(batch) == p * k
        groups = [batch[i : i + k] for i in range(0, p * k, k)]
        # the labels every item of a group carries; some choice of one per group must give P distinct labels
        shared = [set.intersection(*(set(sets[i][sets[i] >= 0].tolist()) for i in group)) for group in groups]
        assignments = [a for a in itertools.product(*shared) if len(set(a)) == p]
        assert assignments, f"no P distinct labels for the groups {groups} (shared labels {shared})"
        for group, carried in zip(groups, shared):
            if min(len(members[label]) for label in carried) >= k:
                assert len(set(group)) == k  # K distinct items


def test_label_set_batches_hold_an_item_once_when_possible_and_small_labels_repeat():
    # label 0: items 0-5; label 1: items 0-5 too (every item carries both); label 2: item 6 only
    sets = np.array([[0, 1]] * 6 + [[2, -1]] + [[-1, -1]] * 3)
    sampler = LabelSetSampler(sets, 2, 3, seed=0, num_replicas=1, rank=0)
    assert sampler.num_items == 7 and len(sampler) == 1  # items without labels are not counted (nor drawn)
    for seed in range(20):
        sampler = LabelSetSampler(sets, 3, 3, seed=seed, num_replicas=1, rank=0)
        (batch,) = list(sampler)
        groups = [batch[0:3], batch[3:6], batch[6:9]]
        for group in groups:
            assert all(i < 7 for i in group)  # never an unlabelled item
        big = [g for g in groups if 6 not in g]
        assert len(big) == 2 and len(set(big[0]) | set(big[1])) == 6  # labels 0 and 1: six different items
        (small,) = [g for g in groups if 6 in g]
        assert small == [6, 6, 6]  # label 2 has one item: drawn with replacement
    # four items for labels 0 and 1: the second label takes the one fresh item, then two already in the batch
    sets = np.array([[0, 1]] * 4)
    (batch,) = list(LabelSetSampler(sets, 2, 3, seed=0, num_replicas=1, rank=0))
    assert len(set(batch[:3])) == 3 and len(set(batch[3:])) == 3 and set(batch) == {0, 1, 2, 3}


@pytest.mark.parametrize("world", [2, 3])
def test_label_set_sampler_shards_distinct_complete_batches(world):
    sets = _label_sets(90, seed=4)
    single = list(LabelSetSampler(sets, 3, 2, seed=1, num_replicas=1, rank=0))
    ranks = [list(LabelSetSampler(sets, 3, 2, seed=1, num_replicas=world, rank=r)) for r in range(world)]
    assert len({len(r) for r in ranks}) == 1 and len(ranks[0]) == 90 // 6 // world
    for r, batches in enumerate(ranks):
        for step, batch in enumerate(batches):
            assert batch == single[step * world + r] and len(batch) == 6
    for step in range(len(ranks[0])):
        assert len({tuple(ranks[r][step]) for r in range(world)}) == world


def test_label_set_sampler_input_checks():
    with pytest.raises(ValueError, match="no item has a label"):
        LabelSetSampler(np.full((4, 2), -1), 1, 1, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="found -3"):
        LabelSetSampler(np.array([[0, -3]]), 1, 1, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="classes_per_batch=3 but the dataset has only 2 classes"):
        LabelSetSampler(np.array([[0, 1], [1, -1]]), 3, 1, num_replicas=1, rank=0)
    plain = LabelSetSampler(np.array([0, 0, 1, 1, 2, 2]), 3, 2, seed=0, num_replicas=1, rank=0)  # [N]: one label each
    (batch,) = list(plain)
    assert sorted(np.array([0, 0, 1, 1, 2, 2])[batch].tolist()) == [0, 0, 1, 1, 2, 2]


def test_take_distinct_never_repeats_within_a_call_and_balances_rounds():
    rng = np.random.default_rng(0)
    queue: list[int] = []
    uses = Counter()
    for _ in range(200):
        chosen = take_distinct(rng, queue, 3, 7)
        assert len(set(chosen)) == 3 and all(0 <= c < 7 for c in chosen)
        uses.update(chosen)
        assert max(uses.values()) - min(uses[c] for c in range(7)) <= 1


# ------------------------------------------------------------------------------------------------ data modules
class _Tiny(DMLDataModule):
    """A data module over index datasets with labels and categories (no images)."""

    def __init__(self, labels, categories=None, **kwargs):
        super().__init__(num_workers=0, **kwargs)
        self._labels, self._categories = torch.as_tensor(np.asarray(labels)), categories

    def build_datasets(self):
        class Items(torch.utils.data.Dataset):
            def __init__(self, labels, category):
                self.labels, self.category = labels, category

            def __len__(self):
                return len(self.labels)

            def __getitem__(self, i):
                return torch.zeros(1), self.labels[i], i

        category = None if self._categories is None else torch.as_tensor(self._categories)
        return Items(self._labels, category), Items(self._labels, None)


def test_data_modules_select_the_sampler():
    labels, categories = _categorised([3, 4], per_class=4)
    labels, categories = labels.tolist(), categories.tolist()  # (Lightning compares init arguments with ==)
    dm = _Tiny(labels, categories, sampler="category", categories_per_batch=2, classes_per_batch=3,
               samples_per_class=2)
    assert dm.batch_size == 12
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert isinstance(loader.batch_sampler, CategoryBalancedSampler)
    batch = next(iter(loader))
    assert batch[1].shape == (12,)
    sets = _Tiny(_label_sets(40).tolist(), sampler="label_sets", classes_per_batch=3, samples_per_class=2)
    sets.setup("fit")
    assert isinstance(sets.train_dataloader().batch_sampler, LabelSetSampler)
    with pytest.raises(ValueError, match="sampler='category' and categories_per_batch are set together"):
        _Tiny(labels, categories, sampler="category")
    with pytest.raises(ValueError, match="sampler='category' and categories_per_batch are set together"):
        _Tiny(labels, categories, categories_per_batch=2)
    with pytest.raises(ValueError, match="sampler must be one of 'balanced', 'npair', 'category', 'label_sets'"):
        _Tiny(labels, sampler="categories")
    plain = _Tiny(labels, None, sampler="category", categories_per_batch=1, classes_per_batch=2, samples_per_class=2)
    plain.setup("fit")
    with pytest.raises(ValueError, match="sampler='category' needs the category of every training item"):
        plain.train_dataloader()
    partial = [-1] * 3 + categories[3:]
    missing = _Tiny(labels, partial, sampler="category", categories_per_batch=1, classes_per_batch=2,
                    samples_per_class=2)
    missing.setup("fit")
    with pytest.raises(ValueError, match="3 of 28 training items have none"):
        missing.train_dataloader()


def test_sop_super_classes_are_the_categories_of_its_training_items(tmp_path):
    """SOP's ``super_class_id`` (``Ebay_train.txt`` column 3) is each training item's category, named by its folder;
    the category sampler draws C super-classes x P products x K images; the test split is evaluated as before."""
    from lightning_dml.data import SOPDataModule
    from tests.fixtures_data import make_sop

    top = make_sop(tmp_path, train_classes=36, test_classes=12, images_per_class=2)
    rows = [line.split() for line in (top / "Ebay_train.txt").read_text().splitlines()[1:]]
    dm = SOPDataModule(top, sampler="category", categories_per_batch=3, classes_per_batch=2, samples_per_class=2,
                       num_workers=0, image_size=16, check_counts=False)
    dm.setup("fit")
    assert dm.category_names == ["bicycle", "cabinet", "chair", "coffee_maker", "fan", "kettle", "lamp", "mug",
                                 "sofa", "stapler", "table", "toaster"]
    for i, path in enumerate(dm.train_dataset.paths):
        (row,) = [r for r in rows if top / r[3] == path]
        assert dm.category_names[int(dm.train_dataset.category[i])] == row[3].split("_final/")[0]
        assert int(row[2]) == int(dm.train_dataset.category[i]) + 1
    loader = dm.train_dataloader()
    assert isinstance(loader.batch_sampler, CategoryBalancedSampler) and dm.batch_size == 12
    labels = dm.train_dataset.labels.numpy()
    categories = dm.train_dataset.category.numpy()
    for batch in loader.batch_sampler:
        _check_cpk(batch, labels, categories, 3, 2, 2)
    assert dm.test_dataset.category is None and len(dm.test_dataset[0]) == 3


def test_the_sop_vit_recipes_follow_omls_category_balanced_sampler():
    import yaml
    from pathlib import Path

    configs = sorted((Path(__file__).resolve().parents[1] / "configs" / "sop").glob("vit_small_*.yaml"))
    assert len(configs) == 3
    for config in configs:
        text = config.read_text()
        args = yaml.safe_load(text)["data"]["init_args"]
        assert (args["sampler"], args["categories_per_batch"], args["classes_per_batch"], args["samples_per_class"]) == (
            "category", 3, 32, 6
        ), config.name
        assert "C x P x K = 3 x 32 x 6" in text and "(3 super-categories per batch)" not in text
