"""The learned pairwise re-ranker's model, folder and training (issue 30 s.1, lightning_dml/rerank/).

References are written from the definitions: the feature-distance logit ``b - exp(s) ||P q - P c||``, one ViT
forward per concatenated pair, a float64 brute-force top-n loop for the mining, the BCE written out; the one fit
runs ``lightning-dml fit`` on a random-init base checkpoint of a tiny CSV set."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import yaml

from lightning_dml.checkpoints import checkpoint_record
from lightning_dml.errors import CorruptFileError, MissingFileError, UserInputError
from lightning_dml.rerank import (
    ConcatSiamese,
    FeatureDistanceSiamese,
    RerankerInputError,
    load_reranker,
    read_reranker_record,
    save_reranker,
)
from lightning_dml.rerank.data import mine_pairs
from lightning_dml.rerank.module import pair_bce

SHA = "ab" * 32


def _tiny_vit(**kwargs) -> ConcatSiamese:
    torch.manual_seed(0)
    return ConcatSiamese("vit_tiny_patch16_224", img_size=16, pretrained=False, hidden=(8,),
                         model_kwargs={"depth": 1, "patch_size": 8, "in_chans": 1, "embed_dim": 32, "num_heads": 2,
                                                   **kwargs}).eval()


@pytest.fixture(scope="module")
def vit() -> ConcatSiamese:
    return _tiny_vit()


def test_feature_distance_scores_are_the_definition_and_block_free():
    torch.manual_seed(1)
    model = FeatureDistanceSiamese(6, identity_init=False)
    with torch.no_grad():
        model.log_scale.fill_(0.3)
        model.bias.fill_(-0.2)
    query, candidates = torch.randn(4, 6), torch.randn(4, 5, 6)
    p = model.proj.weight.detach().double()
    reference = torch.tensor([[-0.2 - torch.tensor(0.3).exp().item()
                               * float((p @ (query[i].double() - candidates[i, j].double())).norm())
                               for j in range(5)] for i in range(4)], dtype=torch.float64)
    scores = model.score(query, candidates)
    assert scores.shape == (4, 5) and scores.dtype == torch.float32
    torch.testing.assert_close(scores.double(), reference, rtol=0, atol=1e-5)
    for block in (1, 3, 7, 20):  # only the last bits of a matrix product over another number of rows may move
        torch.testing.assert_close(model.score(query, candidates, block=block), scores, rtol=0, atol=1e-6)
    # identity at initialisation: the base model's Euclidean order
    fresh = FeatureDistanceSiamese(6)
    assert torch.equal(fresh.score(query, candidates).argsort(1, descending=True),
                       (query[:, None] - candidates).norm(dim=-1).argsort(1))


def test_concat_siamese_scores_one_forward_per_pair_in_any_block(vit):
    torch.manual_seed(2)
    query, candidates = torch.randn(3, 1, 16, 16), torch.randn(3, 4, 1, 16, 16)
    assert torch.equal(ConcatSiamese.concat(query, candidates[:, 0])[:, :, :16], query)  # the query on top
    with torch.no_grad():
        reference = torch.stack([torch.cat([vit(query[i:i + 1], candidates[i, j:j + 1]) for j in range(4)])
                                 for i in range(3)])
    scores = vit.score(query, candidates)
    assert scores.shape == (3, 4) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, reference, rtol=0, atol=1e-6)
    for block in (1, 5, 12):  # only the last bits of a matrix product over another number of rows may move
        torch.testing.assert_close(vit.score(query, candidates, block=block), scores, rtol=0, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 inside autocast
        inside = vit.score(query, candidates)
    assert inside.dtype == torch.float32
    torch.testing.assert_close(inside, scores, rtol=0, atol=1e-6)
    with pytest.raises(RerankerInputError, match=r"images of shape \(1, 16, 16\)"):
        vit.score(torch.randn(3, 1, 32, 32), torch.randn(3, 4, 1, 32, 32))
    with pytest.raises(RerankerInputError, match="do not fit query"):
        vit.score(query, torch.randn(2, 4, 1, 16, 16))


def test_save_load_round_trip_gives_equal_scores(vit, tmp_path):
    torch.manual_seed(3)
    feature = FeatureDistanceSiamese(6, identity_init=False)
    q, c = torch.randn(2, 6), torch.randn(2, 3, 6)
    save_reranker(feature, tmp_path / "f", base_checkpoint_sha256=SHA, extra={"note": "x"})
    loaded = load_reranker(tmp_path / "f")
    assert torch.equal(loaded.score(q, c), feature.score(q, c)) and not loaded.training
    assert loaded.base_checkpoint_sha256 == SHA and loaded.embedding_dim == 6 and loaded.record["extra"] == {"note": "x"}
    save_reranker(vit, tmp_path / "v", base_checkpoint_sha256=SHA)
    images_q, images_c = torch.randn(2, 1, 16, 16), torch.randn(2, 3, 1, 16, 16)
    again = load_reranker(tmp_path / "v")
    assert isinstance(again, ConcatSiamese) and again.input_spec == vit.input_spec
    assert torch.equal(again.score(images_q, images_c), vit.score(images_q, images_c))
    save_reranker(feature, tmp_path / "v", base_checkpoint_sha256=SHA)  # replaces the folder as a whole
    assert read_reranker_record(tmp_path / "v")["kind"] == "feature_distance_siamese"
    assert sorted(p.name for p in (tmp_path / "v").iterdir()) == ["reranker.json", "weights.safetensors"]


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message and isinstance(error.value, UserInputError)
    return message


def test_corrupt_or_foreign_folders_are_one_line_errors(tmp_path):
    model = FeatureDistanceSiamese(4)
    good = tmp_path / "good"
    save_reranker(model, good, base_checkpoint_sha256=SHA)
    record = json.loads((good / "reranker.json").read_text())
    weights = (good / "weights.safetensors").read_bytes()

    def broken(name: str, manifest: str | None, data: bytes | None):
        folder = tmp_path / name
        folder.mkdir()
        if manifest is not None:
            (folder / "reranker.json").write_text(manifest)
        if data is not None:
            (folder / "weights.safetensors").write_bytes(data)
        return folder

    cases = [
        (tmp_path / "absent", MissingFileError, "does not exist"),
        (broken("no_json", None, weights), MissingFileError, "has no reranker.json"),
        (broken("bad_json", "{not json", weights), CorruptFileError, "not valid JSON"),
        (broken("other_format", json.dumps({**record, "format": "x"}), weights), CorruptFileError, "format"),
        (broken("other_kind", json.dumps({**record, "kind": "pickle"}), weights), CorruptFileError,
         "unknown re-ranker kind"),
        (broken("no_weights", json.dumps(record), None), MissingFileError, "no weights file"),
        (broken("truncated", json.dumps(record), weights[:-9]), CorruptFileError, "truncated, corrupt or replaced"),
        (broken("flipped", json.dumps(record), weights[:-1] + bytes([weights[-1] ^ 1])), CorruptFileError,
         "truncated, corrupt or replaced"),
        (broken("wrong_width", json.dumps({**record, "options": {"dim": 5, "identity_init": True}}), weights),
         CorruptFileError, "do not fit"),
        (broken("escape", json.dumps({**record, "weights": {**record["weights"], "file": "../good/weights.safetensors"}}),
                weights), CorruptFileError, "plain file name"),
    ]
    for folder, kind, text in cases:
        with pytest.raises(kind) as error:
            load_reranker(folder)
        assert text in _one_line(error), folder.name


def _brute_force_pairs(x: torch.Tensor, labels: torch.Tensor, top_n: int, sequence: torch.Tensor | None):
    """Each row's top_n others by float64 cosine (ties: smaller index), own row and sequence excluded."""
    rows = [[v / math.sqrt(math.fsum(u * u for u in row)) for v in row] for row in x.double().tolist()]

    def cos(i: int, j: int) -> float:  # in Python floats: equal rows give bit for bit equal scores
        return math.fsum(a * b for a, b in zip(rows[i], rows[j]))

    out = []
    for i in range(x.shape[0]):
        others = [j for j in range(x.shape[0]) if j != i and not (
            sequence is not None and sequence[i] >= 0 and sequence[j] == sequence[i])]
        ranked = sorted(others, key=lambda j: (-cos(i, j), j))[:top_n]
        for rank, j in enumerate(ranked):
            if labels.ndim == 1:
                same = bool(labels[i] == labels[j])
            else:
                same = bool(set(labels[i][labels[i] >= 0].tolist()) & set(labels[j][labels[j] >= 0].tolist()))
            out.append((i, j, float(same), rank))
    return out


def test_mining_equals_a_brute_force_loop_with_ties_sequences_and_label_sets():
    torch.manual_seed(4)
    centres = torch.randn(3, 5)
    labels = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
    x = centres[labels] + 0.4 * torch.randn(12, 5)
    x[3] = x[0]  # an exact copy: tie at equal score, broken by the smaller index
    x[9] = x[1]  # a copy in another class: a hard negative tied with a positive
    sequence = torch.tensor([0, 0, -1, -1, 1, 1, -1, -1, -1, 2, 2, -1])
    for seq in (None, sequence):
        pairs = mine_pairs(x, labels, 4, sequence=seq)
        got = list(zip(pairs.query.tolist(), pairs.candidate.tolist(), pairs.target.tolist(), pairs.rank.tolist()))
        assert got == _brute_force_pairs(x, labels, 4, seq)
        assert all(q != c for q, c, _, _ in got) and 0 < pairs.target.sum() < len(pairs)
    sets = torch.tensor([[0, -1], [0, 1], [1, -1], [2, -1]]).repeat(3, 1)  # label sets padded with -1
    pairs = mine_pairs(x, sets, 3)
    got = list(zip(pairs.query.tolist(), pairs.candidate.tolist(), pairs.target.tolist(), pairs.rank.tolist()))
    assert got == _brute_force_pairs(x, sets, 3, None)


def test_pair_loss_is_the_written_out_binary_cross_entropy():
    logits = torch.tensor([-3.0, -0.5, 0.0, 0.7, 4.0, 30.0])
    target = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    for w in (1.0, 2.5):
        z = logits.double()
        reference = -(w * target * torch.log(1 / (1 + torch.exp(-z)))
                      + (1 - target) * torch.log(1 / (1 + torch.exp(z)))).mean()  # 1 - sigmoid(z) = sigmoid(-z)
        torch.testing.assert_close(pair_bce(logits, target, w).double(), reference, rtol=1e-6, atol=1e-6)


def test_one_tiny_fit_writes_a_folder_of_the_base_checkpoint(tmp_path, monkeypatch):
    from tests.test_index_cli import ROOT, _checkpoint, _main_capture
    from tests.test_pairwise_search import _images

    classes = [f"class{c}" for c in range(3)]
    _images(tmp_path / "train", dict.fromkeys(classes, 3), seed=1)
    _images(tmp_path / "test", {"class7": 2, "class8": 2}, seed=2)
    rows = ["path,label,split"] + [f"{p},{p.parent.name},{s}" for s in ("train", "test")
                                   for p in sorted((tmp_path / s).glob("*/*.png"))]
    (tmp_path / "table.csv").write_text("\n".join(rows) + "\n")
    cfg = yaml.safe_load((ROOT / "configs" / "glyphs.yaml").read_text())
    cfg["trainer"] = {"logger": False, "enable_checkpointing": False, "accelerator": "cpu", "devices": 1}
    cfg["model"]["backbone"]["init_args"]["width"] = 8
    cfg["model"]["embedding_dim"] = 16
    cfg["model"]["clustering"] = False
    cfg["data"] = {"class_path": "lightning_dml.data.CSVDataModule",
                   "init_args": {"root": str(tmp_path / "table.csv"), "image_size": 32, "classes_per_batch": 2,
                                 "samples_per_class": 2, "num_workers": 0}}
    base_config = tmp_path / "base.yaml"
    base_config.write_text(yaml.safe_dump(cfg))
    ckpt = _checkpoint(base_config, tmp_path / "base.ckpt", 0)
    rerank_cfg = yaml.safe_load((ROOT / "configs" / "rerank" / "glyphs.yaml").read_text())
    rerank_cfg["trainer"] = {"logger": False, "enable_checkpointing": False, "accelerator": "cpu", "devices": 1,
                             "max_steps": 2, "enable_progress_bar": False, "default_root_dir": str(tmp_path / "run")}
    rerank_cfg["model"]["reranker"]["init_args"].update(
        hidden=[8], model_kwargs={"in_chans": 1, "patch_size": 16, "depth": 1, "embed_dim": 32, "num_heads": 2})
    rerank_cfg["model"]["output"] = str(tmp_path / "rr")
    rerank_cfg["data"].update(base_config=str(base_config), base_checkpoint=str(ckpt), top_n=2, batch_size=4)
    config = tmp_path / "rerank.yaml"
    config.write_text(yaml.safe_dump(rerank_cfg))
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code, out, err = _main_capture(["fit", "--config", str(config)])
    assert code == 0, err[-3000:]
    model = load_reranker(tmp_path / "rr")
    record = model.record
    assert isinstance(model, ConcatSiamese) and model.base_checkpoint_sha256 == checkpoint_record(ckpt)["sha256"]
    assert record["embedding_dim"] == 16 and record["extra"]["pairs"] == 9 * 2 and record["extra"]["steps"] == 2
    assert model.input_spec.color == "L" and model.input_spec.crop_size == 32  # the base model's preprocessing
    scores = model.score(torch.zeros(1, 1, 32, 32), torch.zeros(1, 2, 1, 32, 32))
    assert scores.shape == (1, 2) and bool(torch.isfinite(scores).all())


def test_the_rerank_configs_build_the_reranker_classes(tmp_path, monkeypatch):
    from lightning_dml.cli import build_cli
    from lightning_dml.rerank.cli_classes import reranker_fit_classes
    from lightning_dml.rerank.data import PairwiseRerankDataModule
    from lightning_dml.rerank.module import PairwiseRerankerModule
    from tests.test_index_cli import ROOT

    assert reranker_fit_classes(["fit", "--config", str(ROOT / "configs" / "glyphs.yaml")]) is None
    monkeypatch.chdir(tmp_path)
    for name in ("glyphs.yaml", "glyphs_feature.yaml"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cli = build_cli([f"--config={ROOT / 'configs' / 'rerank' / name}", "--trainer.logger=false"],
                            run=False)
        assert isinstance(cli.model, PairwiseRerankerModule) and isinstance(cli.datamodule, PairwiseRerankDataModule)
        assert cli.model.reranker.inputs == cli.datamodule.inputs, name
