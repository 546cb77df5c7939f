"""Residual pairwise re-rankers and the model selection on held-out classes (lightning_dml/rerank/models.py,
data.py, module.py; issue 30 s.1): an untrained residual re-ranker reproduces the base ranking exactly (ties and
near-ties included) in the search, ``index evaluate`` and ``test`` code paths; its logit is the written-out
definition; the held-out split, Recall@1 of re-ranked lists and the kept weights against loops; old folders (no
``residual`` option recorded) still load."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from lightning_dml.index import pairwise as P
from lightning_dml.index.rerank import as_stored
from lightning_dml.rerank import ConcatSiamese, FeatureDistanceSiamese, RerankerInputError, load_reranker, save_reranker
from lightning_dml.rerank.data import MinedPairs, PairDataset, held_out_classes, mine_pairs, recall_at_1


def _tied_set() -> tuple[torch.Tensor, torch.Tensor]:
    """20 x 8 embeddings with exact duplicates and near-duplicates (cosines 1e-12 apart: equal in float32)."""
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(20, 8, generator=g, dtype=torch.float64)
    emb[3] = emb[1]
    emb[7] = emb[1]
    emb[9] = emb[1] * (1 + 1e-12)
    emb[11] = emb[1] + 1e-12
    emb[14] = emb[2] + 1e-9 * torch.randn(8, generator=g, dtype=torch.float64)
    return emb.float(), torch.arange(20) % 4


@pytest.fixture(scope="module")
def vit() -> ConcatSiamese:
    """A tiny untrained residual ConcatSiamese (8 x 8 grey images, one block of width 16)."""
    torch.manual_seed(0)
    return ConcatSiamese("vit_tiny_patch16_224", img_size=8, pretrained=False, hidden=[4], residual=True,
                         model_kwargs={"in_chans": 1, "patch_size": 4, "depth": 1, "embed_dim": 16, "num_heads": 1})


def test_an_untrained_residual_reranker_is_the_base_ranking(vit):
    from lightning_dml.callbacks.pairwise_test import rerank_test_set
    from lightning_dml.metrics import functional as MF

    emb, labels = _tied_set()
    top_n = 8
    scores, ranked = MF.knn(emb, None, k=12, metric="cosine")
    stored = as_stored(emb, "cosine")
    images = torch.randn(20, 1, 8, 8)
    for model, items in ((FeatureDistanceSiamese(8, residual=True), stored), (vit.eval(), images)):
        # test/index evaluate path: the exact lists' permutation is the identity
        perm = P.rerank_ranked(model, ranked, items, lambda pos, items=items: items[pos.clamp_min(0)], top_n, scores)
        assert torch.equal(perm, torch.arange(top_n).expand(20, top_n))
        # search path: a search function's lists (float32 scores, as faiss gives them) come back unchanged
        reranker = P.PairwiseRerank(model="unused", top_n=top_n)

        def search(queries, k):
            return scores[:, :k].float(), ranked[:, :k]

        query_inputs = None if model.inputs == "embeddings" else images
        fn = None if model.inputs == "embeddings" else (lambda ids: images[ids.clamp_min(0)])
        got_scores, got_ids = reranker.search(search, lambda ids: stored[ids], emb, 10, "cosine", model=model,
                                              query_inputs=query_inputs, candidate_fn=fn)
        assert torch.equal(got_ids, ranked[:, :10])
        assert bool((got_scores[:, :-1] >= got_scores[:, 1:]).all())
    # test path: the re-ranked lists of rerank_test_set are the exact engine's
    model = FeatureDistanceSiamese(8, residual=True)
    data = {"embeddings": emb, "labels": labels, "indices": None, "query_mask": None, "gallery_mask": None,
            "sequence": None, "category": None}
    import lightning_dml.index.pairwise as module

    original = module.load_pairwise_model
    module.load_pairwise_model = lambda folder, device="cpu": model
    try:
        out = rerank_test_set(P.PairwiseRerank(model="unused", top_n=top_n), data, "cosine", (1, 2))
    finally:
        module.load_pairwise_model = original
    _, exact = MF.knn(emb, None, k=out["ranked"].shape[1], metric="cosine")
    assert torch.equal(out["ranked"], exact)


def test_the_residual_logit_is_its_definition(vit):
    g = torch.Generator().manual_seed(1)
    x1, x2, base = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g), torch.rand(6, generator=g)
    model = FeatureDistanceSiamese(5, residual=True)
    assert set(dict(model.named_parameters())) == {"proj.weight", "base_log_scale", "base_bias", "gate"}
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    a, c, gate, proj = (model.base_log_scale.double(), model.base_bias.double(), model.gate.double(),
                        model.proj.weight.double())
    want = a.exp() * base.double() + c + gate * torch.linalg.vector_norm((x1.double() - x2.double()) @ proj.T, dim=1)
    torch.testing.assert_close(model.pair_logits(x1, x2, base).double(), want, rtol=1e-5, atol=1e-5)
    scored = model.score(x1[:2], x2.view(2, 3, 5), base=base.view(2, 3))
    torch.testing.assert_close(scored.flatten().double(), torch.cat([
        model.pair_logits(x1[[0, 0, 0]], x2[:3], base[:3]), model.pair_logits(x1[[1, 1, 1]], x2[3:], base[3:])
    ]).double(), rtol=1e-6, atol=1e-6)
    with pytest.raises(RerankerInputError, match="needs the base scores"):
        model.score(x1[:2], x2.view(2, 3, 5))
    assert not bool(vit.head[-1].weight.any())  # the residual starts at zero
    vit = copy.deepcopy(vit)
    with torch.no_grad():
        vit.head[-1].weight.normal_()
    i1, i2 = torch.randn(3, 1, 8, 8), torch.randn(3, 1, 8, 8)
    vit.eval()
    want = vit.base_log_scale.exp() * base[:3] + vit.base_bias + vit.head(vit.backbone(vit.concat(i1, i2))).squeeze(-1)
    torch.testing.assert_close(vit.pair_logits(i1, i2, base[:3]), want)


def test_old_folders_without_the_residual_option_load(tmp_path):
    torch.manual_seed(2)
    model = FeatureDistanceSiamese(6, identity_init=False)
    save_reranker(model, tmp_path / "rr", base_checkpoint_sha256="0" * 64)
    path = tmp_path / "rr" / "reranker.json"
    record = json.loads(path.read_text())
    assert record["options"]["residual"] is False
    del record["options"]["residual"]  # as the folders written before the option
    path.write_text(json.dumps(record))
    loaded = load_reranker(tmp_path / "rr")
    q, c = torch.randn(2, 6), torch.randn(2, 3, 6)
    assert loaded.residual is False and torch.equal(loaded.score(q, c), model.eval().score(q, c))
    residual = FeatureDistanceSiamese(6, residual=True)
    save_reranker(residual, tmp_path / "res", base_checkpoint_sha256="0" * 64)
    again = load_reranker(tmp_path / "res")
    base = torch.randn(2, 3)
    assert again.residual and torch.equal(again.score(q, c, base=base), residual.eval().score(q, c, base=base))


def test_held_out_classes_and_recall_at_1_against_loops():
    labels = torch.tensor([5, 5, 7, 7, 7, 9, 9, 11, 11, 13])
    held = held_out_classes(labels, 0.4, seed=3)
    out = set(labels[held].tolist())
    assert len(out) == 2 and not out & set(labels[~held].tolist())  # whole classes, 40% of 5
    assert torch.equal(held, held_out_classes(labels, 0.4, seed=3))
    assert held_out_classes(labels, 0.01).any() and not held_out_classes(labels, 0.99).all()
    with pytest.raises(Exception, match="label sets"):
        held_out_classes(torch.tensor([[1, 2], [2, -1]]), 0.5)
    pairs = MinedPairs(query=torch.tensor([0, 0, 0, 1, 1, 2, 2]), candidate=torch.tensor([1, 2, 3, 0, 2, 0, 1]),
                       target=torch.tensor([0.0, 1, 0, 1, 0, 0, 0]), rank=torch.tensor([0, 1, 2, 0, 1, 0, 1]),
                       score=torch.zeros(7, dtype=torch.float64))
    for logits in (torch.tensor([0.0, 0, 0, 0, 0, 0, 0]), torch.tensor([0.1, 0.5, 0.5, -1, 2, 0, 0])):
        hits = []
        for q in range(3):
            rows = [p for p in range(7) if pairs.query[p] == q]
            best = max(rows, key=lambda p: (float(logits[p]), -int(pairs.rank[p])))  # ties: the base rank
            hits.append(float(pairs.target[best]))
        assert recall_at_1(logits, pairs) == pytest.approx(sum(hits) / 3, abs=1e-12)


class _Pairs(pl.LightningDataModule):
    """Training pairs whose targets contradict the base scores, and a held-out split the base ranks perfectly."""

    inputs = "embeddings"
    batch_size = 16
    val_classes = 0.5

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(4)
        centres = torch.nn.functional.normalize(torch.randn(12, 8, generator=g), dim=1)
        labels = torch.arange(24) % 12  # pairs: each item's one relevant item is its nearest neighbour
        emb = as_stored(centres[labels] + 0.05 * torch.randn(24, 8, generator=g), "cosine")
        train, val = labels < 6, labels >= 6
        rows_t, rows_v = torch.nonzero(train).flatten(), torch.nonzero(val).flatten()
        pt = mine_pairs(emb[rows_t], labels[rows_t], 4)
        last = (pt.rank == 3).float()  # "the 4th-ranked candidate is the match": the base order reversed
        self.pairs = MinedPairs(rows_t[pt.query], rows_t[pt.candidate], last, pt.rank, pt.score)
        pv = mine_pairs(emb[rows_v], labels[rows_v], 4)
        self.val_pairs = MinedPairs(rows_v[pv.query], rows_v[pv.candidate], pv.target, pv.rank, pv.score)
        self.train_set, self.val_set = PairDataset(emb, self.pairs), PairDataset(emb, self.val_pairs)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)


def test_the_fit_keeps_the_weights_of_the_best_held_out_recall(tmp_path):
    from lightning_dml.rerank.module import PairwiseRerankerModule

    data = _Pairs()
    assert recall_at_1(data.val_pairs.score, data.val_pairs) == 1.0  # the base ranking: every first item relevant
    torch.manual_seed(0)
    reranker = FeatureDistanceSiamese(8, residual=True)
    start = {k: v.clone() for k, v in reranker.state_dict().items()}
    module = PairwiseRerankerModule(reranker, lr=1.0, weight_decay=0.0, output=str(tmp_path / "rr"))
    trainer = pl.Trainer(max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", devices=1, default_root_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=data)
    assert module.global_step > 0
    # training on contradicting targets moved the weights and hurt the held-out lists: the untrained state is kept
    assert module.best["epoch"] == 0 and module.best["recall@1"] == 1.0
    assert all(torch.equal(v, start[k]) for k, v in reranker.state_dict().items())
    record = load_reranker(tmp_path / "rr").record["extra"]["validation"]
    assert record["kept_epoch"] == 0 and record["recall@1"] == record["recall@1_before_training"] == 1.0
    assert record["val_pairs"] == len(data.val_pairs)
    # the logged measurements: the kept one is their maximum, and what the final weights give
    assert module.validation_recall() == module.best["recall@1"]
    last = float(trainer.callback_metrics["val/rerank_recall@1"])
    assert last < 1.0  # the last epoch's weights were worse (so keeping the first is what the test checks)
