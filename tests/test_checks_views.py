"""Fit-start checks of the views option (lightning_dml.data.views) with the self-supervised wrapper."""

import pytest

from lightning_dml.checks import check_fit_combination
from lightning_dml.losses import build_loss


class _Data:
    def __init__(self, views: int, samples_per_class: int) -> None:
        self.views = views
        self.samples_per_class = samples_per_class


def test_self_supervised_without_views_is_refused_in_one_line():
    # class labels repeated samples_per_class times would pass as "item ids": the inner loss would train supervised
    with pytest.raises(ValueError, match=r"views=1: set views: 2"):
        check_fit_combination(build_loss("self_supervised"), _Data(views=1, samples_per_class=2))


@pytest.mark.parametrize("name", ["self_supervised", "multi_similarity"])
def test_views_are_positives_even_with_one_sample_per_class(name):
    check_fit_combination(build_loss(name), _Data(views=2, samples_per_class=1))


def test_one_sample_per_class_without_views_still_needs_positive_pairs():
    with pytest.raises(ValueError, match="samples_per_class=1"):
        check_fit_combination(build_loss("multi_similarity"), _Data(views=1, samples_per_class=1))
