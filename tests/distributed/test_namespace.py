"""One import namespace: every module of ftrain is ``ftrain.<something>``, so a user's own
``checkpoint.py``, ``agents/``, ``contract.py``, ``chaos/`` or ``testbed/`` beside their training
script can neither break ftrain nor be imported by it; the wheel puts nothing else at the top of
site-packages; and torch's loading of the ``etcd-v3`` entry point imports nothing of ftrain but
the entry point itself.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ftrain.testbed.jobs import TINY_CONFIG, worker_env
from ftrain.testbed.procs import REPO

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

#: what a training repository commonly holds at its root: each fails loudly if anything imports it
USER_MODULES = ("checkpoint.py", "contract.py", "agents/__init__.py", "chaos/__init__.py", "testbed/__init__.py")


@pytest.fixture
def user_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "my-training-repo"
    for name in USER_MODULES:
        path = repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"raise RuntimeError('the user\\'s own {name} was imported')\n")
    (repo / "agents" / "agent.py").write_text("raise RuntimeError('the user\\'s agents/agent.py was imported')\n")
    (repo / "config.toml").write_text(TINY_CONFIG)
    return repo


def _run(cmd: list[str], cwd: Path, timeout_s: float = 240) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, env=worker_env(), capture_output=True, text=True, timeout=timeout_s)
    assert out.returncode == 0, f"{cmd}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    assert "was imported" not in out.stdout + out.stderr
    return out


def test_ftrain_runs_beside_a_users_own_checkpoint_agents_contract_chaos_and_testbed(user_repo: Path):
    plan = _run([sys.executable, "-m", "ftrain", "plan", "config.toml", "--world-size", "2"], user_repo)
    assert "2 rank(s)" in plan.stdout and "recommended:" in plan.stdout, plan.stdout
    status = _run([sys.executable, "-m", "ftrain", "status", "--help"], user_repo)
    assert "--etcd" in status.stdout
    ckpt = user_repo / "ckpt"
    train = _run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            "-m", "ftrain", "train", "config.toml", "--train.steps=2", f"--checkpoint.uri={ckpt}",
            "--checkpoint.interval=2",
        ],
        user_repo,
    )  # fmt: skip
    assert any(p.name.startswith("step-") for p in ckpt.iterdir()), train.stderr[-3000:]


def test_torch_loading_the_rendezvous_entry_point_imports_only_the_entry_point(tmp_path: Path):
    code = (
        "import sys, torch.distributed.checkpoint, torch.distributed.elastic.rendezvous\n"
        "print(sorted(m for m in sys.modules if m == 'ftrain' or m.startswith('ftrain.')))"
    )
    out = _run([sys.executable, "-c", code], tmp_path)
    assert out.stdout.strip() == "['ftrain', 'ftrain.torchrun_plugin']"


def test_the_wheel_installs_one_top_level_package_holding_every_folder(tmp_path: Path):
    """Built from a copy of the checkout (links kept as links), so no build/ left in it matters."""
    src = tmp_path / "src"
    shutil.copytree(
        REPO,
        src,
        symlinks=True,
        ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", "runs", ".*cache"),
    )
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", ".", "-w", str(tmp_path)],
        src,
    )
    (wheel,) = tmp_path.glob("ftrain-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"ftrain", wheel.name.split("-py3")[0] + ".dist-info"}
    for folder in ("agents", "checkpoint", "chaos", "contract", "testbed"):
        sources = {f"ftrain/{p.relative_to(REPO).as_posix()}" for p in (REPO / folder).rglob("*.py")}
        assert sources <= set(names), folder
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "etcd-v3 = ftrain.torchrun_plugin:handler" in text and "ftrain = ftrain.cli:main" in text
