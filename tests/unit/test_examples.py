"""The deployment examples run the command line the tests run: examples/slurm/agent.sh and
examples/kubernetes/ftrain.yaml are generated from agents/launch.py (never stale), and filled in
with a node's values they are the chaos cluster's command for that node on network namespaces,
less what only the tests add (the shared events file, fast timeouts, the metrics and log paths)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess

import pytest

from ftrain.agents.launch import agent_command
from ftrain.chaos.cluster import FAST_AGENT_OPTIONS, Cluster
from ftrain.contract.config import ConfigError
from ftrain.testbed.jobs import TINY_CONFIG
from ftrain.testbed.procs import REPO
from tests.script_support import load_script

TEST_ONLY_OPTIONS = {"--events", *FAST_AGENT_OPTIONS[::2]}


def test_the_examples_are_the_generated_ones():
    assert load_script("render_examples").main(["--check"]) == 0, "examples are stale: run `make docs`"


def _slurm_command() -> list[str]:
    text = (REPO / "examples" / "slurm" / "agent.sh").read_text()
    words = shlex.split(text[text.index("exec ftrain agent") :].replace("\\\n", " "))[1:]
    at = words.index("--drain-timeout-s")  # Slurm's own: a drain ends before KillWait's SIGKILL
    assert words[at + 1] == "${FTRAIN_DRAIN_TIMEOUT_S}"
    return words[:at] + words[at + 2 :]


def _kubernetes_command() -> list[str]:
    text = (REPO / "examples" / "kubernetes" / "ftrain.yaml").read_text()
    (line,) = [ln for ln in text.splitlines() if ln.strip().startswith("command:")]
    return json.loads(line.split("command:", 1)[1])


def _fill(command: list[str], pattern: str, values: dict[str, str]) -> list[str]:
    return [re.sub(pattern, lambda m: values[m.group(1)], word) for word in command]


def _without_test_only(command: list[str]) -> list[str]:
    """The cluster's command less the options only tests add; the worker arguments end at the
    checkpoint location (the rest are the test job's overrides)."""
    split = command.index("--")
    agent, worker = command[:split], command[split + 1 :]
    kept, i = [], 0
    while i < len(agent):
        if agent[i] in TEST_ONLY_OPTIONS:
            i += 2
            continue
        kept.append(agent[i])
        i += 1
    return [*kept, "--", *worker[:2]]


@pytest.mark.parametrize(
    "read, pattern", [(_slurm_command, r"\$\{(\w+)\}"), (_kubernetes_command, r"\$\((\w+)\)")], ids=["slurm", "k8s"]
)
def test_an_example_is_the_command_the_namespace_tests_run(tmp_path, read, pattern):
    etcd = "http://198.18.0.2:2379,http://198.18.0.3:2379,http://198.18.0.4:2379"
    cluster = Cluster(tmp_path, etcd, TINY_CONFIG, job="chaos", ckpt_uri="s3://ftrain/chaos", steps=360)
    tested = cluster.command("n1", nnodes="2:3", nproc=1, host="198.18.0.12")
    values = {
        "FTRAIN_ETCD": etcd,
        "FTRAIN_JOB": "chaos",
        "FTRAIN_NODE_ID": "n1",
        "FTRAIN_RUN_DIR": str(tmp_path / "n1"),
        "FTRAIN_HOST": "198.18.0.12",
        "FTRAIN_CONFIG": str(TINY_CONFIG),
        "FTRAIN_CHECKPOINT_URI": "s3://ftrain/chaos",
        "FTRAIN_NNODES": "2:3",
        "FTRAIN_NPROC_PER_NODE": "1",
    }
    example = read()
    assert example[:2] == ["ftrain", "agent"]
    assert _fill(example, pattern, values) == _without_test_only(tested)


def test_the_slurm_script_is_valid_shell():
    for name in ("agent.sh", "ftrain.sbatch"):
        subprocess.run(["bash", "-n", str(REPO / "examples" / "slurm" / name)], check=True)


def test_a_node_command_names_a_missing_key_or_a_bad_value():
    node = {"etcd": "http://e:2379", "job": "j", "nnodes": "2:3", "nproc_per_node": 8, "node_id": "a", "run_dir": "/r"}
    with pytest.raises(ValueError, match="missing keys \\['host'\\]"):
        agent_command(node, "job.toml")
    with pytest.raises(ConfigError, match="agent.nnodes"):
        agent_command({**node, "host": "10.0.0.1", "nnodes": "3:2"}, "job.toml")
