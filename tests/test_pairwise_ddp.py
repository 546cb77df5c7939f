"""``lightning-dml test --rerank pairwise:...`` with two DDP processes (gloo, CPU) gives the one-process figures
(issue 30 s.1; lightning_dml/callbacks/pairwise_test.py: every process gathers the whole test set and re-ranks it).

The tiny set of tests/test_pairwise_search.py with one more query (29 test items: the second process's share is
padded by the distributed sampler, which the gathered metric states must drop), a random-init checkpoint and a
FeatureDistanceSiamese with a random map (a re-ranking unlike the base order). The one-process run is in this
process (``build_cli``); the two-process run is this file run as a script (below), which Lightning's DDP launcher
runs again as the second process; each process writes its re-ranked lists and its logged metrics to a JSON file.
Both processes must hold exactly (``==``) the one-process lists and values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
pytestmark = [pytest.mark.skipif(sys.platform == "win32", reason="gloo"), pytest.mark.slow]  # two more processes


def _result(cli) -> dict:
    """The re-ranked lists and the logged test metrics of a finished ``test`` (plain JSON data)."""
    from lightning_dml.callbacks.pairwise_test import PairwiseRerankTest

    callback = next(cb for cb in cli.trainer.callbacks if isinstance(cb, PairwiseRerankTest))
    return {"query": callback.result["query"].tolist(), "ranked": callback.result["ranked"].tolist(),
            "metrics": callback.result["metrics"],
            "logged": {k: float(v) for k, v in cli.trainer.callback_metrics.items() if k.startswith("test/")},
            "world_size": cli.trainer.world_size}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    from lightning_dml.checkpoints import checkpoint_record
    from lightning_dml.rerank import FeatureDistanceSiamese, save_reranker
    from tests.test_pairwise_search import tiny_set

    root = tmp_path_factory.mktemp("pairwise_ddp")
    out = tiny_set(root, {"class0": 3, "class1": 2, "class2": 2, "class3": 2})
    torch.manual_seed(5)
    save_reranker(FeatureDistanceSiamese(16, identity_init=False), root / "rr",
                  base_checkpoint_sha256=checkpoint_record(out["ckpt"])["sha256"])
    return {**out, "rr": root / "rr"}


def test_two_processes_give_the_one_process_figures(tiny, tmp_path):
    from lightning_dml.cli import build_cli

    args = ["test", "--config", str(tiny["config"]), "--ckpt_path", str(tiny["ckpt"]), "--rerank",
            f"pairwise:model={tiny['rr']},top_n=4", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", "--trainer.accelerator=cpu"]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
        one = _result(build_cli([*args, f"--trainer.default_root_dir={tmp_path / 'one'}"]))
    assert one["world_size"] == 1 and len(one["query"]) == 9 and "test/pairwise/map@r" in one["logged"]

    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONWARNINGS="ignore")
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(key, None)  # as tests/distributed/: a clean launcher environment
    proc = subprocess.run([sys.executable, str(HERE), str(tmp_path / "ranks"), *args, "--trainer.devices=2",
                           "--trainer.strategy=ddp", f"--trainer.default_root_dir={tmp_path / 'two'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    for rank in (0, 1):
        two = json.loads((tmp_path / "ranks" / f"rank{rank}.json").read_text())
        assert two["world_size"] == 2
        assert two["query"] == one["query"] and two["ranked"] == one["ranked"]
        assert two["metrics"] == one["metrics"]  # exact: the same lists, the same float64 arithmetic
        assert two["logged"] == one["logged"]
    assert proc.stdout.count("pairwise/recall@1") == 1  # one table, printed by rank 0


if __name__ == "__main__":  # one process of the two-process run (the test above starts it; Lightning the second)
    sys.path.insert(0, str(HERE.parents[1]))
    from lightning_dml.cli import build_cli

    folder = Path(sys.argv[1])
    cli = build_cli(sys.argv[2:])
    folder.mkdir(parents=True, exist_ok=True)
    result = _result(cli)
    (folder / f"rank{cli.trainer.global_rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # no gloo thread left at exit (tests/distributed/ do the same)
