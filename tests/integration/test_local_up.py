"""``ftrain local up --host ADDR``: etcd and S3 listen where other hosts reach them. Run as a user
runs it, on the root side of a network-namespace bridge: a process inside a namespace (another
host) reaches both by the printed URLs; an address that is not this machine's, or not an address,
is refused before anything starts."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from ftrain.chaos.netns import NetnsCluster, unavailable_reason
from ftrain.testbed.procs import REPO, kill_tree, quiet_env
from ftrain.testbed.wait import wait_for

pytestmark = pytest.mark.timeout(180)

REACH = (
    "import sys, urllib.request\n"
    "for url in sys.argv[1:]:\n"
    "    try:\n"
    "        urllib.request.urlopen(url, timeout=10).read()\n"
    "        print('ok')\n"
    "    except urllib.error.HTTPError as e:\n"
    "        print('ok' if e.code < 500 else f'http {e.code}')  # S3 answers 403 to an unsigned request\n"
    "    except OSError as e:\n"
    "        print(type(e).__name__)\n"
)


def _up(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ftrain", "local", "up", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=quiet_env(),
    )


def test_a_host_that_is_not_this_machines_address_is_refused():
    out = _up("--host", "not-an-address")
    assert out.returncode == 2 and "--host 'not-an-address' is not an IP address" in out.stderr, out.stderr
    out = _up("--host", "192.0.2.77")  # TEST-NET-1: no interface here has it
    assert out.returncode == 2 and "is not an address of this machine" in out.stderr, out.stderr


@pytest.mark.skipif(unavailable_reason() is not None, reason=f"network namespaces: {unavailable_reason()}")
def test_local_up_on_the_bridge_address_is_reached_from_another_host(tmp_path):
    with NetnsCluster(["a"]) as net:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ftrain", "local", "up", "--host", net.root_address, "--dir", str(tmp_path / "s")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            env=quiet_env(),
            start_new_session=True,
        )
        try:
            lines: list[str] = []
            assert proc.stdout is not None
            wait_for(
                lambda: lines.append(proc.stdout.readline()) or "Ctrl-C" in lines[-1],
                90,
                "local up ready",
                alive=lambda: proc.poll() is None,
                context=lambda: "".join(lines),
            )
            text = "".join(lines)
            etcd = re.search(r"^etcd: (\S+)", text, re.M)
            s3 = re.search(r"^s3:\s+(\S+)", text, re.M)
            assert etcd and s3, text
            assert f"//{net.root_address}:" in etcd.group(1) and f"//{net.root_address}:" in s3.group(1), text
            reached = subprocess.run(
                net.command("a", [sys.executable, "-c", REACH, etcd.group(1) + "/version", s3.group(1)]),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert reached.stdout.split() == ["ok", "ok"], reached.stdout + reached.stderr
        finally:
            kill_tree(proc)
