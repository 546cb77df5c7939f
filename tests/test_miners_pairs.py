"""lightning_dml.miners.pairs: labels and label sets -> pair masks, against brute-force loops over the rules of the
module docstring (labels: equal ids; label sets: intersecting sets, -1 pads; self-pair removed by index)."""

import pytest
import torch

from lightning_dml.miners.pairs import (
    as_label_sets,
    cat_labels,
    label_masks,
    negative_mask,
    positive_index,
    positive_pairs,
    positive_table,
    same_label_mask,
)


def _as_set(row) -> set:
    """One item's labels as a Python set: a scalar id, or a -1 padded row of ids >= 0."""
    if row.ndim == 0:
        return {int(row)}
    return {int(v) for v in row if int(v) >= 0}


def _ref_same(a, g):
    """Loop reference of same_label_mask: equality for labels [B]/[N], intersection once either side has sets."""
    if a.ndim == 1 and g.ndim == 1:
        return [[int(a[i]) == int(g[j]) for j in range(len(g))] for i in range(len(a))]
    sa = [_as_set(r) if a.ndim == 2 else {int(r)} for r in a]
    sg = [_as_set(r) if g.ndim == 2 else {int(r)} for r in g]
    return [[bool(sa[i] & sg[j]) for j in range(len(sg))] for i in range(len(sa))]


def _sets(n, width, classes, seed, empty_rows=()):
    """[n, width] label sets of ids in 0..classes-1 (distinct within a row), -1 padded, some rows empty."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((n, width), -1, dtype=torch.long)
    for i in range(n):
        if i in empty_rows:
            continue
        k = int(torch.randint(1, width + 1, (1,), generator=g))
        out[i, :k] = torch.randperm(classes, generator=g)[:k]
    return out


def _check_masks(a, g, anchor_index=None):
    """label_masks / same_label_mask / negative_mask / positive_pairs / positive_table of (a, g) vs the loops."""
    B, N = a.shape[0], g.shape[0]
    ref = _ref_same(a, g)
    assert same_label_mask(a, g).tolist() == ref
    pos, neg = label_masks(a, g)
    assert pos.shape == neg.shape == (B, N)
    for i in range(B):
        for j in range(N):
            assert bool(pos[i, j]) == (ref[i][j] and j != i), (i, j)
            assert bool(neg[i, j]) == (not ref[i][j] and j != i), (i, j)
    idx = torch.arange(B) if anchor_index is None else anchor_index
    nm = negative_mask(a, g, anchor_index)
    assert nm.shape == (B, N)
    for i in range(B):
        for j in range(N):
            assert bool(nm[i, j]) == (not ref[i][j] and j != int(idx[i])), (i, j)
    rows, cols = positive_pairs(a, g)
    assert sorted(zip(rows.tolist(), cols.tolist())) == sorted(map(tuple, pos.nonzero().tolist()))
    t_rows, t_cols, t_valid = positive_table(a, g)
    assert t_rows.shape == t_cols.shape == t_valid.shape and t_rows.shape[0] == B
    assert sorted(zip(t_rows[t_valid].tolist(), t_cols[t_valid].tolist())) == sorted(map(tuple, pos.nonzero().tolist()))


def test_labels_are_compared_by_plain_equality_for_any_integer_id():
    # [B] / [N] class ids: any integer is a class (check_labels accepts negative ids), so -1 == -1 is a positive
    y = torch.tensor([-1, 2, -1, -2, 2, 0])
    gy = torch.cat([y, torch.tensor([-2, -1, 5])])
    _check_masks(y, gy)
    _check_masks(y, y)
    # negative_mask of labels: every pair with different ids (the self-pair has equal ids)
    assert negative_mask(y, gy).tolist() == [[int(a) != int(b) for b in gy] for a in y]


@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_labels_and_label_sets_match_the_loops(seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (5,), generator=g)  # anchors with one label each
    ref_sets = _sets(4, 3, 4, seed + 10, empty_rows=(1,))
    # labels [B] against a gallery of label sets (the batch followed by references: cat_labels pads)
    gallery = cat_labels(y, ref_sets)
    assert gallery.ndim == 2
    _check_masks(y, gallery)
    _check_masks(y, gallery, anchor_index=torch.tensor([4, 0, 2, 1, 3]))
    # label sets [B, L] (one label each, padded) against a gallery of labels [N]
    gy = torch.cat([y, torch.randint(0, 4, (3,), generator=g)])
    _check_masks(as_label_sets(y, 2), gy)
    _check_masks(as_label_sets(y, 2), gy, anchor_index=torch.tensor([1, 0, 2, 4, 3]))
    # sets against sets of another width, with empty sets among the anchors
    sets = _sets(6, 2, 3, seed, empty_rows=(0, 3))
    _check_masks(sets, cat_labels(sets, ref_sets))


def test_the_self_pair_is_neither_positive_nor_negative_even_for_an_item_without_labels():
    # module docstring: "In both cases an anchor is never its own positive nor its own negative" (removed by index).
    # An item that is positive to nothing (an empty set, a row of -1) is still not its own negative, whichever side
    # holds [B] labels and which label sets. (A [B] id of -1 compared against label sets is read as the -1 padding by
    # as_label_sets: the self-pair must be removed by index there too.)
    y = torch.tensor([-1, 1, 1, -1])
    refs = torch.tensor([[1, -1], [-1, -1], [0, 1]])
    combos = [
        (y, cat_labels(y, refs)),  # [B] anchors + label-set references, as the losses build them
        (as_label_sets(y, 2), torch.cat([y, torch.tensor([1, 0])])),  # label-set anchors, [N] gallery
        (as_label_sets(y, 2), cat_labels(y, refs)),
    ]
    for a, gal in combos:
        B = a.shape[0]
        pos, neg = label_masks(a, gal)
        assert not pos[:, :B].diagonal().any() and not neg[:, :B].diagonal().any(), (a, gal)
        assert not negative_mask(a, gal)[:, :B].diagonal().any(), (a, gal)
        empty = [i for i in range(B) if a.ndim == 2 and not _as_set(a[i])]
        for i in empty:  # an empty set (a row of -1) is everyone else's negative
            others = [j for j in range(gal.shape[0]) if j != i]
            assert not pos[i].any() and bool(neg[i, others].all())
            assert (not pos[:, i].any())


def test_cat_labels_keeps_labels_and_pads_label_sets_to_the_widest_block():
    a = torch.tensor([3, 0, 7])
    b = torch.tensor([1, 2])
    assert torch.equal(cat_labels(a, b), torch.tensor([3, 0, 7, 1, 2]))
    # [N] with [M, 1] sets: width stays 1, each [N] label is a one-label set
    one = torch.tensor([[4], [5], [6], [8]])
    assert torch.equal(cat_labels(a, one), torch.tensor([[3], [0], [7], [4], [5], [6], [8]]))
    assert torch.equal(cat_labels(one, a), torch.tensor([[4], [5], [6], [8], [3], [0], [7]]))
    # blocks with more rows than columns and fewer rows than columns: the width is the widest set
    wide = torch.tensor([[1, 2, -1, 3]])  # 1 row, width 4
    tall = torch.tensor([[0, 1], [2, -1], [5, -1]])  # 3 rows, width 2
    out = cat_labels(a, tall, wide)
    assert out.shape == (3 + 3 + 1, 4)
    parts = [a[:, None], tall, wide]
    rows = [r for p in parts for r in p]
    for got, want in zip(out, rows):
        assert _as_set(got) == _as_set(want)
        assert torch.equal(got[: want.numel()], want) and bool((got[want.numel():] == -1).all())
    assert torch.equal(as_label_sets(tall, 2), tall) and torch.equal(as_label_sets(tall), tall)


def test_positive_index_gathers_positives_in_increasing_column_order():
    # index[i, r] is the r-th positive of anchor i (increasing column), K_max = most positives of an anchor, >= 1
    g = torch.Generator().manual_seed(3)
    pos = torch.rand(5, 200, generator=g) < 0.4
    pos[2] = False
    index, valid = positive_index(pos)
    counts = pos.sum(dim=1)
    assert index.shape == valid.shape == (5, int(counts.max()))
    for i in range(5):
        assert index[i][valid[i]].tolist() == pos[i].nonzero().flatten().tolist()
        assert (index[i][~valid[i]] == 0).all()
    for shape in [(3, 4), (1, 1), (0, 4)]:  # at most one positive per anchor; no anchors (the gallery has N >= B)
        p = torch.zeros(shape, dtype=torch.bool)
        if shape == (3, 4):
            p[0, 2] = p[2, 1] = True
        index, valid = positive_index(p)
        assert index.shape == valid.shape == (shape[0], 1)
        assert valid.sum(dim=1).tolist() == p.sum(dim=1).tolist()
        assert index[valid].tolist() == p.nonzero()[:, 1].tolist()


def test_positive_table_of_labels_has_the_largest_class_count_columns_in_gallery_order():
    g = torch.Generator().manual_seed(4)
    y = torch.randint(0, 3, (40,), generator=g)
    gy = torch.cat([y, torch.randint(0, 4, (60,), generator=g)])
    rows, cols, valid = positive_table(y, gy)
    largest = max(int((gy == int(c)).sum()) for c in y)  # K: the largest class count of an anchor's class
    assert cols.shape == (40, largest)
    pos, _ = label_masks(y, gy)
    for i in range(40):
        assert (rows[i] == i).all()
        # the anchor's positives in increasing gallery order (as label_masks(...)[0].nonzero()): the same table on
        # every device, so a seeded draw over it (distance_weighted_sampling) pairs the same positives
        assert cols[i][valid[i]].tolist() == pos[i].nonzero().flatten().tolist()
    # no anchors: no positives and K = 0 (the largest count over no anchor)
    for gallery in [torch.tensor([1, 1, 2]), torch.zeros(0, dtype=torch.long)]:
        rows, cols, valid = positive_table(torch.zeros(0, dtype=torch.long), gallery)
        assert rows.shape == cols.shape == valid.shape == (0, 0)
