"""``ftrain agent``'s options are the ``[agent]`` keys: one per AgentConfig field (old flag names
kept), typed and checked as the key is, over the config file's values (CLI > file > defaults)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ftrain.agents.config import AgentConfig
from ftrain.cli import build_parser
from ftrain.cli.agent import resolve_options
from ftrain.contract.config import ConfigError

FLAGS = (
    "--etcd",
    "--job",
    "--nnodes",
    "--nproc-per-node",
    "--node-id",
    "--host",
    "--lease-ttl-s",
    "--settle-s",
    "--hang-timeout-s",
    "--start-timeout-s",
    "--max-restarts",
    "--restart-window-s",
    "--backoff-initial-s",
    "--backoff-max-s",
    "--deterministic-failures",
    "--scale-up",
    "--metrics-port",
    "--run-dir",
)


def options(tmp_path: Path, *argv: str, agent_section: str = ""):
    config = tmp_path / "job.toml"
    config.write_text(f'[checkpoint]\nuri = "{tmp_path / "ckpt"}"\n\n[agent]\n{agent_section}\n')
    full = ["agent", *argv, "--", str(config)]
    args, overrides = build_parser(full).parse_known_args(full)
    return resolve_options(args, overrides)


def test_every_key_is_an_option_of_its_type_and_every_old_flag_still_works() -> None:
    for f in dataclasses.fields(AgentConfig):
        flag = "--" + f.name.replace("_", "-")
        value = f.metadata.get("choices", ("2",))[0]
        args, unknown = build_parser(["agent"]).parse_known_args(["agent", flag, value])
        assert not unknown and getattr(args, f.name) == {"int": int, "float": float, "str": str}[str(f.type)](value)
    assert {f.name.replace("_", "-") for f in dataclasses.fields(AgentConfig)} >= {f[2:] for f in FLAGS}


def test_options_override_the_file_which_overrides_the_defaults(tmp_path: Path) -> None:
    opts = options(
        tmp_path,
        "--etcd",
        "http://h:1,http://h:2",
        "--job",
        "j",
        "--settle-s",
        "3",
        "--nnodes",
        "1:4",
        agent_section='lease_ttl_s = 7\nsettle_s = 9.0\nnode_id = "n7"',
    )
    cfg = opts.config
    assert (cfg.settle_s, cfg.lease_ttl_s, cfg.node_id) == (3.0, 7, "n7")  # option > file
    assert cfg.start_timeout_s == AgentConfig().start_timeout_s  # untouched: the one default
    assert (cfg.min_nodes, cfg.max_nodes, cfg.endpoints) == (1, 4, ["http://h:1", "http://h:2"])
    assert opts.policy().settle_s == 3.0 and opts.policy().max_nodes == 4


def test_a_bad_option_names_the_key_and_the_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"agent\.lease_ttl_s: must be >= 2.*given as --lease-ttl-s"):
        options(tmp_path, "--etcd", "http://h:1", "--job", "j", "--lease-ttl-s", "1")
    with pytest.raises(ConfigError, match=r"agent\.drain_timeout_s: must be a finite number.*--drain-timeout-s"):
        options(tmp_path, "--etcd", "http://h:1", "--job", "j", "--drain-timeout-s", "inf")


def test_etcd_and_job_are_required_from_an_option_or_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing --etcd \(or agent\.etcd\) and --job \(or agent\.job\)"):
        options(tmp_path)
    assert options(tmp_path, agent_section='etcd = "http://h:1"\njob = "from-file"').config.job == "from-file"


def test_a_script_of_the_users_runs_under_restart_recovery_by_default_with_its_own_arguments(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    base = ["agent", "--etcd", "http://h:1", "--job", "j", "--node-id", "n", "--script", str(script)]
    argv = [*base, "--", "--steps", "80", "--ckpt", "s3://b/p"]
    args, overrides = build_parser(argv).parse_known_args(argv)
    opts = resolve_options(args, overrides)
    opts.validate()
    assert (opts.script, opts.worker_args, opts.config.recovery) == (
        str(script),
        ["--steps", "80", "--ckpt", "s3://b/p"],
        "restart",
    )
    argv = [*base, "--recovery", "live"]  # its loop serves rounds through Session.run
    live = resolve_options(*build_parser(argv).parse_known_args(argv))
    live.validate()
    assert (live.script, live.config.recovery) == (str(script), "live")
    argv = [*base[:-1], str(tmp_path / "missing.py")]
    with pytest.raises(ValueError, match="--script: no such file"):
        resolve_options(*build_parser(argv).parse_known_args(argv)).validate()


def test_a_node_range_whose_minimum_the_pipeline_cannot_run_is_refused_at_start_naming_the_fallback(
    tmp_path: Path, capsys
) -> None:
    """Issue 38 item 13, as a user runs it: ``--nnodes 1:2`` of one worker each at
    ``parallel.pp_size=2``. Before: accepted, and after a node loss the survivor's round could
    never be formed. Now ``ftrain agent`` exits 2 before it joins, and with a fallback it starts."""
    from ftrain.cli.agent import agent_main
    from ftrain.contract import exits

    argv = ["--etcd", "http://h:1", "--job", "j", "--node-id", "n", "--nnodes", "1:2", "--nproc-per-node", "1"]
    config = tmp_path / "job.toml"
    config.write_text(f'[checkpoint]\nuri = "{tmp_path / "ckpt"}"\n')
    full = ["agent", *argv, "--", str(config), "--parallel.pp_size=2"]
    assert agent_main(*build_parser(full).parse_known_args(full)) == exits.USAGE
    err = capsys.readouterr().err
    assert err.startswith("ftrain agent: --nnodes 1:2: a round of the minimum, 1 node(s) x 1 proc = world size 1")
    assert "parallel.pp_size=2 cannot run" in err and "parallel.pp_fallback" in err and "--nnodes 2:2" in err
    fallback = options(tmp_path, *argv, "--parallel.pp_size=2", "--parallel.pp_fallback=1")
    fallback.validate()
    assert fallback.pipeline_degrees == (2, 1)
