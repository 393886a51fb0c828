"""The worker's etcd settings: the client file the agent writes (0600, no secret on a command line
or in the workers' environment) and how the fence reads it. The fence against a real etcd with
auth and TLS is in tests/integration/test_etcd_auth.py.
"""

from __future__ import annotations

import json
import os
import pickle
import stat
from dataclasses import replace

import pytest

from ftrain.agent_link import fence
from ftrain.agent_link.fence import ClientSettings, EtcdRoundFence, FenceConfigError
from ftrain.agents.agent_options import AgentOptions, write_client_file
from ftrain.agents.workers import Launch
from ftrain.contract.worker_env import ETCD_CLIENT_FILE as CLIENT_FILE_ENV
from ftrain.contract.worker_env import worker_environment

PASSWORD = "pw-do-not-leak"


def options(tmp_path, **kw) -> AgentOptions:
    ca = tmp_path / "ca.pem"
    ca.write_text("not really a CA")
    return AgentOptions.of(
        etcd=["http://127.0.0.1:2379"],
        job="j",
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=1,
        worker_args=["cfg.toml"],
        node_id="n1",
        etcd_username="root",
        etcd_password=PASSWORD,
        etcd_ca_cert=os.path.relpath(ca),
        **kw,
    )


def test_agent_gives_workers_its_credentials_in_a_0600_file_not_in_argv_or_env(tmp_path, monkeypatch) -> None:
    opts = options(tmp_path)
    opts.validate()
    path = write_client_file(str(tmp_path), opts.etcd_client_settings())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    settings = json.loads(open(path).read())
    assert settings == {"username": "root", "password": PASSWORD, "ca_cert": str(tmp_path / "ca.pem")}  # absolute

    monkeypatch.setenv("FTRAIN_ETCD_PASSWORD", PASSWORD)
    env = worker_environment(
        dict(os.environ), {"FTRAIN_ETCD_PASSWORD": PASSWORD, "X": "1"}, {CLIENT_FILE_ENV: path, "FTRAIN_ROUND": "3"}
    )
    assert env[CLIENT_FILE_ENV] == path and env["X"] == "1"
    assert not any(PASSWORD in v for v in env.values()), "a secret reached the workers' environment"
    argv = Launch(3, 1, 0, 1, "127.0.0.1", 29500, tuple(opts.worker_args)).command()
    assert not any(PASSWORD in a for a in argv)


def test_no_credentials_no_file_and_no_inherited_client_file(tmp_path) -> None:
    assert write_client_file(str(tmp_path), {}) is None
    env = worker_environment({CLIENT_FILE_ENV: "/elsewhere/creds.json", "PATH": "/bin"}, {}, {})
    assert CLIENT_FILE_ENV not in env and env["PATH"] == "/bin"


def test_user_without_password_is_refused_naming_the_variable(tmp_path) -> None:
    with pytest.raises(ValueError, match="FTRAIN_ETCD_PASSWORD"):
        replace(options(tmp_path), etcd_password=None).validate()


def test_missing_tls_file_is_refused_naming_the_option(tmp_path) -> None:
    opts = options(tmp_path, etcd_cert=str(tmp_path / "nope.pem"))
    with pytest.raises(ValueError, match="--etcd-cert: no such file"):
        opts.validate()


def write(path, data, mode: int = 0o600) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as fh:
        fh.write(data if isinstance(data, str) else json.dumps(data))
    os.chmod(path, mode)
    return str(path)


@pytest.mark.parametrize(
    ("data", "mode", "match"),
    [
        ({"username": "u", "password": "p"}, 0o640, "readable by other users"),
        ("{not json", 0o600, "cannot read"),
        ({"username": "u"}, 0o600, "go together"),
        ({"username": "u", "password": 7}, 0o600, "JSON object of strings"),
        ({"user": "u"}, 0o600, "JSON object of strings"),
    ],
)
def test_unusable_client_file_is_refused(tmp_path, data, mode, match) -> None:
    path = write(tmp_path / "c.json", data, mode)
    with pytest.raises(FenceConfigError, match=match):
        ClientSettings.load(path)


def test_client_file_read_lazily_and_never_pickled(tmp_path, monkeypatch) -> None:
    path = write(tmp_path / "c.json", {"username": "root", "password": PASSWORD})
    monkeypatch.setenv("FTRAIN_ETCD", "http://127.0.0.1:1")
    monkeypatch.setenv("FTRAIN_FENCE_KEY", "/ftrain/jobs/j/round")
    monkeypatch.setenv(CLIENT_FILE_ENV, path)
    f = fence.from_env()
    assert f.settings() == ClientSettings("root", PASSWORD)
    assert PASSWORD not in repr(f.settings())
    assert PASSWORD.encode() not in pickle.dumps(f)
    assert pickle.loads(pickle.dumps(f)).settings().password == PASSWORD  # read again on the other side


def test_fence_without_client_file_uses_no_credentials() -> None:
    assert EtcdRoundFence(["http://127.0.0.1:1"], "k").settings() == ClientSettings()


def test_a_reply_cut_short_moves_on_and_refuses_the_commit_naming_it() -> None:
    """A fence txn whose reply breaks off (etcd restarting) is an unreachable endpoint, not a crash."""
    from ftrain.checkpoint.errors import StaleRoundError
    from ftrain.testbed.fake_http import TruncatingServer

    with TruncatingServer() as server:
        f = EtcdRoundFence([server.endpoint], "/ftrain/jobs/j/round")
        with pytest.raises(StaleRoundError, match="etcd unreachable.*IncompleteRead"):
            f.check(3)
