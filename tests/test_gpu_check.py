"""The GPU check (``tools/gpu_check.py``, ``make gpu-check``; docs/gpu.md): its dry run on the CPU, its time caps,
its reading of pytest's output and its install from carried wheels."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


check = _load()


def make_wheel(folder: Path, name: str = "gpucheckprobe", version: str = "0.1") -> Path:
    """A valid pure-Python wheel of one module whose ``VALUE`` is ``version``."""
    files = {
        f"{name}/__init__.py": f"VALUE = {version!r}\n",
        f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{name}-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                             "Tag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{name}-{version}.dist-info/RECORD,,")
    files[f"{name}-{version}.dist-info/RECORD"] = "\n".join(record) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


# ------------------------------------------------------------------------------------------------ reading pytest
PYTEST_OUTPUT = """\
tests/test_a.py::test_one[cuda] PASSED                                   [ 25%]
tests/test_a.py::test_two[cuda-bf16] FAILED                              [ 50%]
tests/test_a.py::test_three[cuda] SKIPPED (no CUDA device)               [ 75%]
tests/test_b.py::test_four[cuda] PASSED                                  [100%]

==================================== ERRORS ====================================
__________________ ERROR collecting tests/test_needs_faiss.py __________________
ImportError while importing test module '/repo/tests/test_needs_faiss.py'.
Traceback:
E   ModuleNotFoundError: No module named 'faiss'
__________________ ERROR collecting tests/test_broken.py _______________________
E     File "/repo/tests/test_broken.py", line 3
E   SyntaxError: invalid syntax
=========================== short test summary info ============================
FAILED tests/test_a.py::test_two[cuda-bf16] - AssertionError: 1 != 2
ERROR tests/test_needs_faiss.py
ERROR tests/test_broken.py
====== 1 failed, 2 passed, 1 skipped, 3000 deselected, 2 errors in 12.34s ======
"""


def test_parse_pytest_reads_counts_failures_and_collection_errors():
    got = check.parse_pytest(PYTEST_OUTPUT)
    assert got["complete"]
    assert got["counts"] == {"failed": 1, "passed": 2, "skipped": 1, "deselected": 3000, "errors": 2}
    assert got["failed"] == ["tests/test_a.py::test_two[cuda-bf16]"]
    errors = {e["node"]: e for e in got["errors"]}
    assert errors["tests/test_needs_faiss.py"]["expected"]  # faiss is not carried: expected there
    assert "No module named 'faiss'" in errors["tests/test_needs_faiss.py"]["why"]
    assert not errors["tests/test_broken.py"]["expected"]


def test_parse_pytest_of_a_run_cut_off_counts_the_per_test_lines():
    cut = PYTEST_OUTPUT.split("\n\n")[0]  # killed at the time cap before pytest's summary
    got = check.parse_pytest(cut)
    assert not got["complete"]
    assert got["counts"] == {"passed": 2, "failed": 1, "skipped": 1}


def test_tests_judge_fails_on_a_failed_test_or_an_unexpected_error_only():
    figures = check.tests_parse([(["pytest"], PYTEST_OUTPUT)], None)
    status, note = check.tests_judge([1], figures)
    assert status == "failed" and "test_two" in note and "test_broken" in note
    clean = "\n".join(line for line in PYTEST_OUTPUT.splitlines() if "test_two" not in line and "broken" not in line)
    figures = check.tests_parse([(["pytest"], clean)], None)
    assert figures["not_collected_expected"] == ["tests/test_needs_faiss.py"]
    assert check.tests_judge([1], figures) == ("passed", "")  # exit 1 from the expected collection error alone
    assert check.tests_judge([2], figures)[0] == "failed"  # interrupted / internal error


# ------------------------------------------------------------------------------------------------ caps and budget
def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie that nobody reaped does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _step(name: str, code: str, cap: float = 30.0):
    return check.Step(name, f"test step {name}", cap, cap, lambda ctx: [[sys.executable, "-c", code]])


def test_a_step_past_its_cap_is_killed_with_its_children_and_the_next_step_runs(tmp_path):
    pid_file = tmp_path / "child.pid"
    hang = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(60)")
    steps = [_step("hang", hang, cap=2.0), _step("after", "print('fine')"), _step("late", "print('never')")]
    args = check.parse_args(["--dry-run", "--out", str(tmp_path / "out"), "--budget-seconds", "30"])
    args.steps = ["hang", "after"]
    assert check.run_check(args, steps) == 1
    data = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    by_name = {s["name"]: s for s in data["steps"]}
    assert by_name["hang"]["status"] == "timeout" and by_name["hang"]["returncodes"] == [None]
    assert 1.5 < by_name["hang"]["wall_s"] < 20
    assert "started" in (tmp_path / "out" / by_name["hang"]["log"]).read_text()
    assert by_name["after"]["status"] == "passed"
    assert by_name["late"]["status"] == "skipped"
    assert data["state"] == "finished"
    child = int(pid_file.read_text())
    for _ in range(50):  # the step's whole process group went with it
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child)
    markdown = (tmp_path / "out" / "gpu-check.md").read_text()
    assert "| hang | timeout |" in markdown and "| after | passed |" in markdown


def test_steps_past_the_total_budget_are_skipped(tmp_path):
    steps = [_step("first", "import time; time.sleep(60)", cap=60.0), _step("second", "print('x')")]
    args = check.parse_args(["--dry-run", "--out", str(tmp_path), "--budget-seconds", "2", "--min-step-seconds", "1"])
    assert check.run_check(args, steps) == 1
    data = json.loads((tmp_path / "gpu-check.json").read_text())
    first, second = data["steps"]
    assert first["status"] == "timeout" and first["cap_s"] <= 2
    assert second["status"] == "skipped" and "budget" in second["note"]


def test_a_terminated_check_kills_the_running_step_and_leaves_a_summary(tmp_path):
    """What the device tool's time limit does (SIGTERM): the running step is marked interrupted, its processes go,
    the steps before it keep their figures."""
    pid_file = tmp_path / "step.pid"
    driver = f"""
import sys
sys.path.insert(0, {str(SCRIPT.parent)!r})
import gpu_check as check
step = lambda name, code: check.Step(name, name, 60, 60, lambda ctx: [[sys.executable, "-c", code]])
steps = [step("done", "print('fine')"),
         step("hang", "import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"),
         step("never", "print('no')")]
sys.exit(check.run_check(check.parse_args(["--dry-run", "--out", {str(tmp_path / "out")!r}]), steps))
"""
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=ROOT)
    try:
        for _ in range(300):
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.1)
        proc.terminate()
        assert proc.wait(timeout=30) == 1
    finally:
        proc.kill()
    data = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert [s["status"] for s in data["steps"]] == ["passed", "interrupted", "pending"]
    assert data["state"] == "interrupted"
    step_pid = int(pid_file.read_text())
    for _ in range(50):
        if not _alive(step_pid):
            break
        time.sleep(0.1)
    assert not _alive(step_pid)
    assert "| hang | interrupted |" in (tmp_path / "out" / "gpu-check.md").read_text()


# ------------------------------------------------------------------------------------------------ carried wheels
def test_install_falls_back_to_unzipping_a_wheel_where_pip_is_missing(tmp_path):
    make_wheel(tmp_path / "wheels")
    no_pip = tmp_path / "python-without-pip"
    no_pip.write_text("#!/bin/sh\necho 'No module named pip' >&2\nexit 1\n")
    no_pip.chmod(0o755)
    ctx = check.Context(python=str(no_pip), out=tmp_path / "out", dry_run=False, wheels=tmp_path / "wheels",
                     install=True, site=tmp_path / "site", scratch=tmp_path)
    ctx.site.mkdir()
    result = check.install_step(ctx, 30)
    assert result.status == "passed", result
    assert result.figures["method"].startswith("unzip") and result.figures["installed"] == ["gpucheckprobe-0.1"]
    assert (ctx.site / "gpucheckprobe" / "__init__.py").read_text() == "VALUE = '0.1'\n"


def test_no_carried_wheels_on_the_gpu_machine_is_a_failed_step_not_a_crash(tmp_path):
    ctx = check.Context(python=sys.executable, out=tmp_path, dry_run=False, wheels=tmp_path / "absent", install=True,
                     site=tmp_path / "site", scratch=tmp_path)
    result = check.install_step(ctx, 30)
    assert result.status == "failed" and "make gpu-wheels" in result.note


def test_the_wheel_folder_is_ignored_by_git():
    out = subprocess.run(["git", "check-ignore", "-q", "gpu-wheels/x.whl"], cwd=ROOT)
    assert out.returncode == 0


# ------------------------------------------------------------------------------------------------ the dry run
@pytest.mark.slow
def test_dry_run_passes_every_step_and_writes_both_summaries_with_the_figures(tmp_path):
    """The whole check on the CPU at tiny sizes (about 80 s of CPU), installing a carried wheel (the carried
    packages then import from the wheels only) with what the GPU machine lacks hidden, as ``make gpu-check`` runs
    it there."""
    make_wheel(tmp_path / "wheels")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PYTEST_XDIST_WORKER")}
    # one thread per step process, as the suite's DDP subprocesses: beside another pytest worker, a second thread
    # mostly spins and waits (the bf16 fit-glyphs step: 25 -> 10 s of CPU, 38 -> 16 s; all steps 83 -> 70 s of
    # CPU). The dry run's figures are not measurements; make gpu-check on the GPU is not affected.
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--install", "--wheels", str(tmp_path / "wheels"),
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    data = json.loads((out / "gpu-check.json").read_text())
    statuses = {s["name"]: s["status"] for s in data["steps"]}
    assert list(statuses) == [s.name for s in check.STEPS]
    assert statuses == dict.fromkeys(statuses, "passed"), (statuses, proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0 and data["state"] == "finished" and data["dry_run"]
    markdown = (out / "gpu-check.md").read_text()
    for step in data["steps"]:
        assert f"| {step['name']} | passed |" in markdown
        assert step["wall_s"] is not None and step["commands"]
        assert (out / step["log"]).is_file()
    steps = {s["name"]: s for s in data["steps"]}
    env = steps["environment"]["figures"]
    assert env["carried"] == {"gpucheckprobe": "0.1"} and env["device"] == "cpu"
    assert set(env["imports"].values()) == {"ok"}
    tests = steps["cuda-tests"]["figures"]
    assert tests["counts"]["skipped"] > 100 and not tests["failed"]  # every cuda test collected, skipped on the CPU
    evaluation = {r["method"]: r for r in steps["evaluation"]["figures"]["rows"]}
    assert set(evaluation) == {"ours", "torch"} and 0 <= evaluation["ours"]["recall@1"] <= 1
    assert steps["evaluation-precision"]["figures"]["identical_across_precisions"]
    assert [r["precision"] for r in steps["evaluation-precision"]["figures"]["rows"]] == ["fp32", "tf32", "bf16"]
    assert {r["case"] for r in steps["losses"]["figures"]["rows"]} == {"multi_similarity", "contrastive"}
    rows = steps["throughput"]["figures"]["rows"]
    assert {(r["impl"], r["precision"]) for r in rows} == {
        (impl, p) for impl in ("DMLModule", "plain loop") for p in ("bf16-mixed", "32-true")}
    assert all(r["images_per_s"] > 0 for r in rows)
    table = steps["fit-glyphs"]["figures"]["table"]
    assert set(table) == {"raw pixels", "untrained network", "trained network"}
    assert 0 < table["trained network"]["recall@1"] <= 100
