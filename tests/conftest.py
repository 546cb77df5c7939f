"""Shared test set-up: no network, few threads, deterministic seeds, a CPU/CUDA ``device`` fixture."""

import os
import tempfile

os.environ.setdefault("WANDB_MODE", "offline")
# nothing in the tests reaches outside the machine: the download tests switch this off for a loopback server
os.environ.setdefault("LIGHTNING_DML_OFFLINE", "1")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("MPLBACKEND", "Agg")
# what the library derives from data sets (verify_images results, decoded images) stays out of the user's cache
os.environ.setdefault("LIGHTNING_DML_CACHE", os.path.join(tempfile.gettempdir(), f"lightning-dml-tests-{os.getpid()}"))

import pytest
import torch

# one intra-op thread per pytest-xdist worker (the workers already share the cores), at most two otherwise
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))

#: The devices a test taking the ``device`` fixture runs on. The CUDA variant always exists (so ``-m cuda``
#: selects the same tests everywhere), carries the ``cuda`` mark and is skipped where no GPU is visible.
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """The device to run the test on: ``cpu`` always, ``cuda`` when a GPU is available (marked ``cuda``).

    ``pytest -m cuda`` runs exactly the CUDA variants; ``pytest -m "not cuda"`` only the CPU ones.
    """
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(0)
    yield
