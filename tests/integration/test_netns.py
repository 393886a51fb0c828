"""The network-namespace cluster (``chaos/netns.py``): hosts with their own addresses that reach
each other over a bridge, cuts that make TCP hang rather than fail, a teardown that leaves no
namespace, link or process behind, and a 3-member etcd cluster with one member per namespace
that keeps its quorum when one member is cut off. Needs root and ``ip`` (CI has both)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
import torch

from ftrain.agents.errors import EtcdUnavailableError
from ftrain.agents.etcd import EtcdClient
from ftrain.agents.job_keys import JobKeys
from ftrain.chaos.cluster import Cluster
from ftrain.chaos.netns import NetnsCluster, leftovers, unavailable_reason
from ftrain.testbed.etcd import EtcdCluster
from ftrain.testbed.jobs import TINY_CONFIG, max_abs_diff, optimizer_tensors, train_job
from ftrain.testbed.wait import wait_for

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(unavailable_reason() is not None, reason=f"network namespaces: {unavailable_reason()}"),
]

PORT = 7000
ECHO = (
    "import socket, sys\n"
    "s = socket.create_server((sys.argv[1], 7000))\n"
    "print('ready', flush=True)\n"
    "while True:\n"
    "    c, _ = s.accept()\n"
    "    c.sendall(c.recv(64))\n"
    "    c.close()\n"
)
CLIENT = (
    "import socket, sys\n"
    "try:\n"
    "    with socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[2])) as c:\n"
    "        c.sendall(b'hello'); print(c.recv(64).decode())\n"
    "except OSError as e:\n"
    "    print(type(e).__name__)\n"
)


def _echo_server(cluster: NetnsCluster, host: str) -> subprocess.Popen:
    proc = cluster.run(host, [sys.executable, "-c", ECHO, cluster.address(host)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _talk(cluster: NetnsCluster, src: str, dst: str, timeout_s: float = 5.0) -> str:
    """What a TCP client in ``src`` got from ``dst``'s echo server: the echo, or the error's name."""
    out = subprocess.run(
        cluster.command(src, [sys.executable, "-c", CLIENT, cluster.address(dst), str(timeout_s)]),
        capture_output=True,
        text=True,
        timeout=timeout_s + 30,
    )
    return out.stdout.strip() or out.stderr.strip()


def test_hosts_reach_each_other_by_their_own_addresses_and_a_cut_hangs_until_healed():
    with NetnsCluster(["a", "b", "c"]) as cluster:
        tag = cluster.tag
        assert [h.address for h in cluster.hosts.values()] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
        assert len(leftovers(tag)) == 3 + 3 + 1  # namespaces, root-side veth ends, the bridge
        server = _echo_server(cluster, "b")
        assert _talk(cluster, "a", "b") == "hello" and _talk(cluster, "c", "b") == "hello"
        with socket.create_connection((cluster.address("b"), PORT), timeout=5) as s:  # the test's own address
            s.sendall(b"root")
            assert s.recv(64) == b"root"
        # nothing listens on a: refused at once, the network itself works
        assert _talk(cluster, "b", "a") == "ConnectionRefusedError"

        cluster.cut("a", "b")  # silent: a's packets arrive, b's answers are dropped
        assert cluster.blackholed() == {("b", "198.18.0.1")}
        assert _talk(cluster, "a", "b", timeout_s=1.0) == "TimeoutError"  # hangs, as across a dead switch
        assert _talk(cluster, "c", "b") == "hello"  # only that path
        cluster.heal("a", "b")
        assert _talk(cluster, "a", "b") == "hello" and not cluster.blackholed()

        cluster.isolate("b")
        assert _talk(cluster, "a", "b", timeout_s=1.0) == "TimeoutError"
        assert _talk(cluster, "c", "b", timeout_s=1.0) == "TimeoutError"
        with pytest.raises(OSError):
            socket.create_connection((cluster.address("b"), PORT), timeout=1.0)
        cluster.heal_all()
        assert _talk(cluster, "a", "b") == "hello" and not cluster.blackholed()

        cluster.cut("a", "b", both=True)  # a loud partition: each side's own connections fail at once
        assert _talk(cluster, "a", "b", timeout_s=5.0) == "OSError"  # EINVAL from the blackhole, not a hang
        cluster.heal("a", "b")
        assert _talk(cluster, "a", "b") == "hello"

        cluster.limit("b", "2mbit")
        qdisc = subprocess.run(["tc", "qdisc", "show", "dev", cluster.hosts["b"].link], capture_output=True, text=True)
        assert "tbf" in qdisc.stdout and "2Mbit" in qdisc.stdout, qdisc.stdout
        assert _talk(cluster, "a", "b") == "hello"  # slower, not cut
        cluster.unlimit("b")
        qdisc = subprocess.run(["tc", "qdisc", "show", "dev", cluster.hosts["b"].link], capture_output=True, text=True)
        assert "tbf" not in qdisc.stdout
    assert server.poll() is not None, "the server in b outlived its cluster"
    assert leftovers(tag) == [], leftovers(tag)


def test_a_cluster_that_fails_half_way_removes_what_it_made(monkeypatch):
    import ftrain.chaos.netns as netns

    made: list[str] = []
    real = netns.NetnsCluster._add_host

    def third_fails(self, name, address, index):
        made.append(self.tag)
        if index == 3:
            raise RuntimeError("no more hosts")
        real(self, name, address, index)

    monkeypatch.setattr(netns.NetnsCluster, "_add_host", third_fails)
    with pytest.raises(RuntimeError, match="no more hosts"):
        NetnsCluster(["a", "b", "c"])
    assert made and leftovers(made[0]) == []


def test_bad_host_lists_and_subnets_are_refused_before_anything_is_made():
    with pytest.raises(ValueError, match="unique"):
        NetnsCluster(["a", "a"])
    with pytest.raises(ValueError, match="benchmarking range"):
        NetnsCluster(["a"], subnet="10.0.0.0/24")


def test_an_etcd_cluster_across_namespaces_keeps_quorum_when_one_member_is_cut_off():
    """etcd_minority: member 2 taken off the network. The two others keep the quorum; a client
    whose first endpoint is the cut member fails over and its writes succeed, a client of that
    member alone cannot write; once the member is back it serves what was written meanwhile."""
    with NetnsCluster(["etcd0", "etcd1", "etcd2"]) as net:
        hosts = [(net.address(n), tuple(net.command(n, []))) for n in ("etcd0", "etcd1", "etcd2")]
        with EtcdCluster(hosts=hosts) as etcd:
            assert etcd.endpoints == [f"http://198.18.0.{i}:2379" for i in (1, 2, 3)]
            cut = etcd.endpoints[2]
            with EtcdClient([cut, *etcd.endpoints[:2]], timeout_s=1.0, retry_timeout_s=20.0) as client:
                client.put("/k", "before")
                net.isolate("etcd2")
                client.put("/k", "during")  # fails over from the cut member to the majority
                assert client.get("/k").value == b"during"
                with (
                    EtcdClient([cut], timeout_s=0.5, retry_timeout_s=2.0) as alone,
                    pytest.raises(EtcdUnavailableError),
                ):
                    alone.put("/k", "minority")
                net.rejoin("etcd2")
                with EtcdClient([cut], timeout_s=1.0, retry_timeout_s=5.0) as alone:
                    wait_for(lambda: _value(alone) == b"during", 30, "the cut member to catch up")
    assert leftovers(net.tag) == []


def _value(client: EtcdClient) -> bytes | None:
    try:
        kv = client.get("/k")
    except EtcdUnavailableError:
        return None
    return kv.value if kv else None


STEPS = 150  # long enough that b is back before a, alone, could finish
DETERMINISTIC = "--parallel.deterministic=true"


def test_a_job_on_two_node_namespaces_trains_on_their_own_addresses_and_rides_out_a_partition(tmp_path):
    """Two nodes (an agent and a worker each) in namespaces of their own, a 3-member etcd cluster
    in three more; every address is a namespace's own (``--host``; gloo on ``eth0``, which the
    agent tells the workers), nothing is on loopback. Node b is taken off the network at step 20:
    its lease expires, node a goes on alone; b comes back, rejoins without a human, and the job
    ends bitwise equal to golden."""
    golden = train_job(tmp_path / "golden", 2, f"--train.steps={STEPS}", DETERMINISTIC).final
    config = tmp_path / "config.toml"
    config.write_text(TINY_CONFIG)
    with NetnsCluster(["etcd0", "etcd1", "etcd2", "a", "b"]) as net:
        hosts = [(net.address(n), tuple(net.command(n, []))) for n in ("etcd0", "etcd1", "etcd2")]
        with EtcdCluster(hosts=hosts) as etcd:
            job = Cluster(
                tmp_path,
                ",".join(etcd.endpoints),
                config,
                steps=STEPS,
                ckpt_interval=10,
                step_sleep_s=0.05,
                overrides=[f"--train.save_final_path={tmp_path / 'final.pt'}", DETERMINISTIC],
            )
            try:
                for node in ("a", "b"):
                    job.start(node, nnodes="1:2", host=net.address(node), launcher=net.command(node, []))
                job.wait_step(20)
                first = job.events("round_formed", new_round=1)[0]
                assert first["world_size"] == 2, first
                cut_at, cut_step = time.time(), job.step()
                net.isolate("b")
                alone = wait_for(
                    lambda: [e for e in job.events("round_formed") if e["members"] == ["a"]], 60, "a round without b"
                )[0]
                job.wait_step(job.step() + 5)
                healed_at = time.time()
                net.rejoin("b")
                back = wait_for(
                    lambda: [e for e in job.events("round_formed") if e["new_round"] > alone["new_round"]],
                    90,
                    "b to rejoin",
                )[0]
                assert job.wait_exit("a", timeout_s=180) == 0, job.log_tail()
                assert job.wait_exit("b", timeout_s=60) == 0, job.log_tail()
                rounds = [(e["new_round"], e["reason"], sorted(e["members"])) for e in job.events("round_formed")]
                went_on = job.events("live_restored", round=alone["new_round"])[0]
                print(
                    f"partition of b at step {cut_step}: round {alone['new_round']} without it "
                    f"{alone['time'] - cut_at:.2f}s later, going on from step {went_on['step']} "
                    f"({went_on['source']}, {max(0, cut_step - went_on['step'])} step(s) lost); b back in "
                    f"round {back['new_round']} {back['time'] - healed_at:.2f}s after healing"
                )
                assert rounds[-1][2] == ["a", "b"], rounds
                keys = JobKeys(job.job)
                with EtcdClient(etcd.endpoints) as client:
                    masters = [client.get(keys.master(g)) for g, _, _ in rounds]
                addresses = {kv.value.decode().rsplit(":", 1)[0] for kv in masters if kv is not None}
                assert addresses and addresses <= {net.address("a"), net.address("b")}, addresses
            finally:
                job.close()
    final = torch.load(tmp_path / "final.pt", weights_only=False)
    assert max_abs_diff(final["model"], golden["model"]) == 0.0
    assert max_abs_diff(optimizer_tensors(final["optim"]), optimizer_tensors(golden["optim"])) == 0.0
    assert leftovers(net.tag) == []
