"""One ``lightning-dml fit`` run for tests/test_resume.py, executed in its own process.

    python tests/scripts/resume_run.py RESULT.json [--block-at-step N MARKER] -- <lightning-dml fit arguments>

Runs the CLI exactly as the ``lightning-dml`` command does and, when ``fit`` returns, writes RESULT.json with the
final logged metrics, a SHA-256 digest of every parameter and buffer, the optimizer's learning rates and the
global step. With ``--block-at-step N MARKER`` the run stops (blocks forever, after writing MARKER) at the start of
the first training batch after step N, i.e. just after the step-N checkpoint was saved, so that the test can
kill it with SIGKILL at a known point.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import pytorch_lightning as pl

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.glyph_cache import install_from_env  # noqa: E402


class BlockAtStep(pl.Callback):
    """Write ``marker`` and block at the start of the first batch after ``step`` optimizer steps."""

    def __init__(self, step: int, marker: str) -> None:
        self.step = step
        self.marker = marker

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            Path(self.marker).write_text(f"{trainer.current_epoch} {batch_idx}\n")
            while True:  # wait for SIGKILL
                time.sleep(1)


def digest(module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str]) -> None:
    result = Path(argv[0])
    split = argv.index("--")
    options, cli_args = argv[1:split], argv[split + 1 :]
    if options[:1] == ["--block-at-step"]:
        step, marker = int(options[1]), options[2]
        spec = {"class_path": "tests.scripts.resume_run.BlockAtStep", "init_args": {"step": step, "marker": marker}}
        cli_args = [*cli_args, f"--trainer.callbacks+={json.dumps(spec)}"]
    install_from_env()
    from lightning_dml.cli import build_cli

    cli = build_cli(["fit", *cli_args])
    trainer = cli.trainer
    out = {
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "digest": digest(cli.model),
        "lrs": [group["lr"] for group in trainer.optimizers[0].param_groups],
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
    }
    result.write_text(json.dumps(out, indent=1, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1:])
