"""Smoke test of bench/memory.py (issue 28 s.4): one row per option on tiny models, in this process (a fresh process
per row, as the script runs them, costs seconds of imports each). The four options compute the same step, so the
rows' losses agree; the targets' verdicts follow the figures."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "memory.py"


@pytest.fixture(scope="module")
def memory():
    spec = importlib.util.spec_from_file_location("bench_memory", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("model", ["vit_tiny", "small_cnn"])
def test_rows_of_every_option_give_the_same_step(memory, model):
    rows = [memory.measure_row(model, option, 16, 0, "cpu", 1, dry_run=True) for option in memory.OPTIONS]
    for row in rows:
        assert row["peak_mib"] > 0 and row["cpu_s"] >= 0 and row["steps"] == 1
        assert row["loss"] == pytest.approx(rows[0]["loss"], rel=1e-5), (row["option"], row["loss"], rows[0]["loss"])
    assert rows[0]["loss"] > 0


def test_dry_run_chunks_act_on_its_batch(memory):
    module, _ = memory.build_module("small_cnn", "both", dry_run=True)
    assert module.embedding_chunk_size == 4 and module.loss.anchor_chunk_size == 4  # below the batch of 16


def test_verdicts_follow_the_figures(memory):
    def row(peak, cpu):
        return {"peak_mib": peak, "rise_mib": peak - 100.0, "cpu_s": cpu}

    rows = {("m", "both", 64): row(200.0, 1.0), ("m", "both", 4096): row(290.0, 70.0),
            ("m", "plain", 64): row(300.0, 0.5)}
    lines = memory._verdicts(rows, [64, 4096], ["m"])
    assert "peak memory B=4096 / B=64 = 290 / 200 MiB = 1.45x (target <= 1.5x: met)" in lines[0]
    assert "rise memory B=4096 / B=64 = 190 / 100 MiB = 1.90x (target <= 1.5x: MISSED)" in lines[1]
    assert lines[2] == "m: B=64, CPU time per sample both / plain = 2.00x (target <= 1.4x: MISSED)"
    assert len(lines) == 3  # no unchunked row at 4096: no time comparison there
