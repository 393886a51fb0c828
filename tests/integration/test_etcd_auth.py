"""Workers reach an etcd with auth (and TLS) as their agent does: the checkpoint fence against a
real etcd with auth enabled, a real etcd with client certificates, and a real agent whose
workers commit checkpoints through an auth-enabled etcd.
"""

from __future__ import annotations

import json
import os
import pickle
import stat

import pytest

from ftrain.agent_link.fence import ClientSettings, EtcdRoundFence, FenceAuthError, FenceConfigError
from ftrain.agents.etcd import EtcdClient
from ftrain.agents.job_keys import JobKeys
from ftrain.checkpoint.errors import StaleRoundError
from ftrain.contract.worker_env import ETCD_CLIENT_FILE as CLIENT_FILE_ENV
from ftrain.testbed.etcd import EtcdServer
from tests.agent_support import AgentJob
from tests.integration.test_etcd import tls_etcd

pytestmark = pytest.mark.timeout(240)

PASSWORD = "s3cret-pw"
KEYS = JobKeys("authjob")


def enable_auth(client: EtcdClient, password: str = PASSWORD) -> None:
    """root user with the root role, then auth on (what `etcdctl user add root; auth enable` does)."""
    for path, body in [
        ("/v3/auth/role/add", {"name": "root"}),
        ("/v3/auth/user/add", {"name": "root", "password": password}),
        ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
        ("/v3/auth/enable", {}),
    ]:
        client._call(path, body)


@pytest.fixture
def auth_etcd(etcd: EtcdServer, client: EtcdClient) -> EtcdServer:
    client.put(KEYS.round, "2")
    enable_auth(client)
    return etcd


def client_file(tmp_path, **settings: str) -> str:
    path = tmp_path / "etcd-client.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(settings, fh)
    return str(path)


def test_fence_authenticates_and_fences_by_round(auth_etcd: EtcdServer, tmp_path) -> None:
    fence = EtcdRoundFence(
        [auth_etcd.endpoint], KEYS.round, client_file=client_file(tmp_path, username="root", password=PASSWORD)
    )
    fence.check(2)  # the current round may commit
    with pytest.raises(StaleRoundError, match="no longer current"):
        fence.check(1)
    pickle.loads(pickle.dumps(fence)).check(2)  # as in DCP's background process: reads the file itself


def test_commit_records_are_written_with_the_round_check_and_read_back_untrusted(auth_etcd: EtcdServer) -> None:
    """The commit point under auth: a record is written only while the round is current, read
    back as {step: manifest digest}; what else sits under the prefix (a malformed value, a key
    that is not a step) is skipped, and forgetting drops records."""
    fence = EtcdRoundFence(
        [auth_etcd.endpoint], KEYS.round, commits_key=KEYS.commits, settings=ClientSettings("root", PASSWORD)
    )
    fence.record(2, 40, "a" * 64)
    fence.record(2, 60, "b" * 64)
    with pytest.raises(StaleRoundError, match="round 1 is no longer current.*the commit of step 80 refused"):
        fence.record(1, 80, "c" * 64)
    with EtcdClient([auth_etcd.endpoint], username="root", password=PASSWORD) as root:
        root.put(f"{KEYS.commits}000000000090", "not json")
        root.put(f"{KEYS.commits}000000000100", json.dumps({"digest": "../../etc", "round": 2}))
        root.put(f"{KEYS.commits}latest", json.dumps({"digest": "d" * 64, "round": 2}))
    assert fence.recorded() == {40: "a" * 64, 60: "b" * 64}
    assert fence.forget(2, {40: "a" * 64, 60: "c" * 64}) == [40]  # 60 names another manifest: kept
    with pytest.raises(StaleRoundError, match="round 1 is no longer current.*record of step 60 refused"):
        fence.forget(1, {60: "b" * 64})  # a retention of an old round drops nothing
    assert fence.recorded() == {60: "b" * 64}
    without_records = EtcdRoundFence([auth_etcd.endpoint], KEYS.round, settings=ClientSettings("root", PASSWORD))
    assert without_records.recorded() is None


def test_fence_with_wrong_or_no_credentials_says_authentication(auth_etcd: EtcdServer, tmp_path) -> None:
    wrong = EtcdRoundFence([auth_etcd.endpoint], KEYS.round, settings=ClientSettings("root", "wrong"))
    with pytest.raises(FenceAuthError, match="authentication") as refused:
        wrong.check(2)
    assert "stale" not in str(refused.value) and "no longer current" not in str(refused.value)
    with pytest.raises(FenceAuthError, match="authentication.*no credentials"):
        EtcdRoundFence([auth_etcd.endpoint], KEYS.round).check(2)


class CountingFence(EtcdRoundFence):
    """Counts authentications (etcd 3.5.1 may hand out the same token string again after a restart)."""

    authentications = 0

    def _authenticate(self, endpoint: str, timeout_s: float) -> str | None:
        self.authentications += 1
        return super()._authenticate(endpoint, timeout_s)


def test_fence_gets_a_new_token_once_etcd_rejects_its_token(auth_etcd: EtcdServer) -> None:
    fence = CountingFence([auth_etcd.endpoint], KEYS.round, settings=ClientSettings("root", PASSWORD))
    fence.check(2)
    fence.check(2)
    assert fence.authentications == 1  # the token is kept
    fence._token = "expiredTokenXyz.1"  # what a token looks like once etcd dropped it (TTL, restart)
    fence.check(2)
    assert fence.authentications == 2 and fence._token != "expiredTokenXyz.1"


def test_fence_over_tls_with_client_certificates(tmp_path) -> None:
    server, certs = tls_etcd(tmp_path)
    tls = {"ca_cert": certs["ca.pem"], "cert": certs["client.pem"], "key": certs["client.key"]}
    try:
        with server.client(timeout_s=1.0) as c:
            c.put(KEYS.round, "5")
        EtcdRoundFence([server.endpoint], KEYS.round, client_file=client_file(tmp_path, **tls)).check(5)
        with pytest.raises(FenceConfigError, match="TLS"):  # no client certificate: refused, and said why
            EtcdRoundFence([server.endpoint], KEYS.round, settings=ClientSettings(ca_cert=certs["ca.pem"])).check(5)
    finally:
        server.close()


def test_an_agent_on_an_auth_enabled_etcd_commits_checkpoints(tmp_path, etcd: EtcdServer, client: EtcdClient) -> None:
    enable_auth(client)
    job = AgentJob(tmp_path / "job", etcd.endpoint, steps=40, ckpt_interval=10)
    job.env["FTRAIN_ETCD_PASSWORD"] = PASSWORD
    try:
        job.start("a", "--etcd-user", "root", nnodes="1:1")
        assert job.wait_exit("a", timeout_s=180) == 0, job.log_tail()
        assert not job.events("ckpt_failed"), job.events("ckpt_failed")
        assert {10, 20, 30} <= set(job.committed_steps())
        settings = tmp_path / "job" / "a" / "etcd-client.json"
        assert stat.S_IMODE(settings.stat().st_mode) == 0o600
        started = job.events("workers_started")[0]
        assert PASSWORD not in json.dumps(job.events()), "the password reached the event log"
        assert started
    finally:
        job.close()


def test_client_file_readable_by_others_is_refused(tmp_path) -> None:
    path = client_file(tmp_path, username="root", password=PASSWORD)
    os.chmod(path, 0o644)
    with pytest.raises(FenceConfigError, match=f"{CLIENT_FILE_ENV}.*chmod 600"):
        EtcdRoundFence(["http://127.0.0.1:1"], KEYS.round, client_file=path).check(1)
