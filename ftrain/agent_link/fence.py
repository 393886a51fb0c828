"""The checkpoint fence of a worker started by an agent: commit only while our round is current.

The agent passes ``FTRAIN_ETCD`` (client URLs), ``FTRAIN_FENCE_KEY`` (the job's ``round`` key),
``FTRAIN_ROUND`` and, when it uses etcd auth or TLS, ``FTRAIN_ETCD_CLIENT_FILE``: a JSON file in
its run dir, readable by its user only (0600), with ``username``/``password``, ``ca_cert``,
``cert``, ``key`` — the same credentials and files as the agent, and no secret on any command
line or in the workers' environment. Before the manifest is written,
:meth:`EtcdRoundFence.check` runs an etcd transaction that succeeds only if the key still holds
our round; otherwise, or when no etcd member answers, it raises
:class:`~ftrain.checkpoint.errors.StaleRoundError` and nothing is committed (the save is reported as
failed). The leader moves the key forward before any agent starts the next round's workers, so
a worker of an old round — a zombie on a partitioned host — cannot publish a checkpoint the new
round might load.

What must stay true:

- "stale round" is said only when etcd answered that the key holds another value. Refused
  credentials raise :class:`FenceAuthError` ("authentication ..."), a TLS failure or an
  unusable client file :class:`FenceConfigError`; both also refuse the commit.
- Auth as etcd's own clients do it: ``/v3/auth/authenticate`` gives a token sent in the
  ``Authorization`` header; a token etcd rejects (expired, server restarted) is replaced once
  per check, then the request is sent again.
- The fence is picklable (it may run in DCP's background process): the password, token and
  ssl context are loaded lazily and never pickled; the client file is read again there.

**The commit point is an etcd transaction.** A check alone leaves a window: a worker paused
(SIGSTOP, a frozen host, a long GC) between its check and its manifest PUT would publish its
step after a newer round formed. So with ``FTRAIN_COMMITS_KEY`` set (the agent sets it),
:meth:`EtcdRoundFence.record` runs, after the manifest is stored, one transaction that writes
``<commits key><step>`` = ``{"digest": sha256 of the manifest's bytes, "round": r}`` only if the
round key still holds ``r``: the round check and the commit are one atomic step in etcd. Readers
(:meth:`EtcdRoundFence.recorded`, passed to :func:`ftrain.checkpoint.catalog.list_steps`) count a step
as committed only when the stored manifest's digest is the one recorded: a manifest that a
fenced-out worker stored late is, for them, a torn save. The worst a worker paused that long can
do is overwrite a newer round's manifest of the same step (storage has no conditional PUT
everywhere), which then no longer matches its record: that step is lost (readers fall back to
the one before), never replaced.

This speaks the etcd v3 JSON gateway with the standard library alone (``urllib``, ``ssl``): one
request per check and one per commit record (two when a token is fetched), and the worker stays
free of the agent's packages.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import os
import re
import ssl
import stat
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ftrain.checkpoint.errors import CheckpointError, StaleRoundError
from ftrain.contract import bounded_json
from ftrain.contract.worker_env import ETCD_CLIENT_FILE, WorkerEnv

log = logging.getLogger(__name__)

TIMEOUT_S = 3.0
#: With more than one endpoint, the first pass gives each this long: a member cut off from the
#: quorum (or from us) holds a request until it times out, and a healthy one answers in
#: milliseconds; a second pass with the full timeout follows for a cluster that is just slow.
FAILOVER_TIMEOUT_S = 1.0
_HEX64 = re.compile(r"[0-9a-f]{64}")
#: commit records read at most (a job keeps a few steps; retention forgets the others' records)
MAX_RECORDS = 100_000
MAX_RECORD_BYTES = 64 << 10  #: a commit record is a digest and a round (~100 bytes)
_UNAUTHENTICATED, _INVALID_ARGUMENT, _PERMISSION_DENIED = 16, 3, 7
_TOKEN_REJECTED = ("invalid auth token", "auth store is old", "user name is empty", "token")


class FenceAuthError(CheckpointError):
    """etcd refused the fence's credentials (or asked for some and none were given)."""


class FenceConfigError(CheckpointError):
    """The fence cannot be set up: an unusable client file, or a TLS/certificate error."""


@dataclass(frozen=True)
class ClientSettings:
    """How to reach etcd: what the agent wrote to the client file."""

    username: str | None = None
    password: str | None = None
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None

    @classmethod
    def load(cls, path: str) -> ClientSettings:
        """Read the client file; FenceConfigError (naming the file and variable) if unusable or
        readable by other users."""
        try:
            mode = os.stat(path).st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise FenceConfigError(
                    f"{ETCD_CLIENT_FILE}={path}: readable by other users "
                    f"(mode {stat.S_IMODE(mode):o}); it holds a password: chmod 600"
                )
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError) as e:
            raise FenceConfigError(f"{ETCD_CLIENT_FILE}={path}: cannot read the etcd client settings: {e}") from e
        if (
            not isinstance(data, dict)
            or not all(isinstance(v, str) for v in data.values())
            or set(data) - {"username", "password", "ca_cert", "cert", "key"}
        ):
            raise FenceConfigError(
                f"{ETCD_CLIENT_FILE}={path}: expected a JSON object of strings with "
                "username, password, ca_cert, cert, key"
            )
        if ("username" in data) != ("password" in data):
            raise FenceConfigError(f"{ETCD_CLIENT_FILE}={path}: username and password go together")
        return cls(**data)

    def __repr__(self) -> str:  # never print the password
        return (
            f"ClientSettings(username={self.username!r}, password={'***' if self.password else None}, "
            f"ca_cert={self.ca_cert!r}, cert={self.cert!r}, key={self.key!r})"
        )


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class _Rejected(Exception):
    """etcd answered with an error reply (HTTP status, gRPC code, message)."""

    def __init__(self, status: int, code: int | None, message: str):
        super().__init__(f"HTTP {status}, code {code}: {message}")
        self.status, self.code, self.message = status, code, message

    @property
    def auth(self) -> bool:
        return (
            self.code in (_UNAUTHENTICATED, _PERMISSION_DENIED)
            or (self.code == _INVALID_ARGUMENT and "user name" in self.message)
            or "auth" in self.message
        )

    @property
    def token_rejected(self) -> bool:
        return self.code == _UNAUTHENTICATED or any(m in self.message for m in _TOKEN_REJECTED)


class EtcdRoundFence:
    """``check(round_)`` passes only while ``key`` holds ``round_`` (see the module docstring).

    ``settings``: credentials and TLS files given directly; ``client_file``: read them from
    there at first use instead (what :func:`from_env` does).
    """

    def __init__(
        self,
        endpoints: list[str],
        key: str,
        *,
        commits_key: str = "",
        timeout_s: float = TIMEOUT_S,
        settings: ClientSettings | None = None,
        client_file: str | None = None,
    ):
        if not endpoints:
            raise ValueError("EtcdRoundFence needs at least one etcd endpoint")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.key = key
        self.commits_key = commits_key  #: the prefix of the commit records ("": manifests are the truth)
        self.timeout_s = timeout_s
        self.client_file = client_file
        self._settings = settings
        self._ssl: ssl.SSLContext | None = None
        self._token: str | None = None
        self._answering = self.endpoints[0]  #: the endpoint that answered last: asked first

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_ssl=None, _token=None)
        if self.client_file:
            state["_settings"] = None  # the other process reads the file itself
        return state

    # -- settings -------------------------------------------------------------------------
    def settings(self) -> ClientSettings:
        if self._settings is None:
            self._settings = ClientSettings.load(self.client_file) if self.client_file else ClientSettings()
        return self._settings

    def _context(self) -> ssl.SSLContext:
        if self._ssl is None:
            s = self.settings()
            try:
                context = ssl.create_default_context(cafile=s.ca_cert)
                if s.cert:
                    context.load_cert_chain(s.cert, s.key)
            except (OSError, ssl.SSLError) as e:
                raise FenceConfigError(
                    f"etcd TLS files (ca_cert={s.ca_cert}, cert={s.cert}, key={s.key}) unusable: {e}"
                ) from e
            self._ssl = context
        return self._ssl

    # -- requests -------------------------------------------------------------------------
    def _post(
        self, endpoint: str, path: str, body: dict[str, Any], token: str | None, timeout_s: float
    ) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = token
        request = urllib.request.Request(f"{endpoint}{path}", data=json.dumps(body).encode(), headers=headers)
        context = self._context() if endpoint.startswith("https://") else None
        try:
            with urllib.request.urlopen(request, timeout=timeout_s, context=context) as reply:
                answer = json.load(reply)
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                data = json.loads(raw)
            except ValueError:
                data = {}
            data = data if isinstance(data, dict) else {}
            raise _Rejected(e.code, data.get("code"), str(data.get("message") or data.get("error") or raw[:200])) from e
        if not isinstance(answer, dict):
            raise ValueError(f"reply is not a JSON object: {answer!r}"[:200])
        if "error" in answer and isinstance(answer["error"], dict):  # some gateway errors come in a 200
            err = answer["error"]
            raise _Rejected(int(err.get("http_code") or 500), err.get("grpc_code"), str(err.get("message")))
        return answer

    def _authenticate(self, endpoint: str, timeout_s: float) -> str | None:
        s = self.settings()
        if s.username is None:
            return None
        try:
            answer = self._post(
                endpoint, "/v3/auth/authenticate", {"name": s.username, "password": s.password}, None, timeout_s
            )
        except _Rejected as e:
            raise FenceAuthError(
                f"etcd authentication as {s.username!r} failed at {endpoint} ({e.message}): "
                f"commit refused; check the agent's --etcd-user and FTRAIN_ETCD_PASSWORD"
            ) from e
        token = answer.get("token")
        if not isinstance(token, str) or not token:
            raise FenceAuthError(f"etcd authentication at {endpoint} gave no token: commit refused")
        return token

    def _call(self, endpoint: str, path: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        if self._token is None:
            self._token = self._authenticate(endpoint, timeout_s)
        try:
            return self._post(endpoint, path, body, self._token, timeout_s)
        except _Rejected as e:
            if not e.auth:
                raise
            if self._token is None or not e.token_rejected:
                who = f"user {self.settings().username!r}" if self.settings().username else "no credentials"
                raise FenceAuthError(
                    f"etcd authentication refused the fence's transaction ({who}) at "
                    f"{endpoint}: {e.message}; commit refused"
                ) from e
        self._token = self._authenticate(endpoint, timeout_s)  # expired or invalid: once more, a fresh token
        try:
            return self._post(endpoint, path, body, self._token, timeout_s)
        except _Rejected as e:
            if e.auth:
                raise FenceAuthError(
                    f"etcd authentication refused the fence's transaction at {endpoint} even "
                    f"with a fresh token: {e.message}; commit refused"
                ) from e
            raise

    def _request(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any] | None, list[str]]:
        """The first answer of any endpoint, or None and why each failed; TLS and credential
        failures raise (FenceConfigError, FenceAuthError): another endpoint would not fix them.
        The endpoint that answered last is asked first; with several, a short first pass
        (:data:`FAILOVER_TIMEOUT_S` each) moves on from a member that holds requests."""
        errors: list[str] = []
        order = [self._answering, *(e for e in self.endpoints if e != self._answering)]
        passes = [min(FAILOVER_TIMEOUT_S, self.timeout_s), self.timeout_s] if len(order) > 1 else [self.timeout_s]
        for endpoint, timeout_s in ((e, t) for t in passes for e in order):
            try:
                answer = self._call(endpoint, path, body, timeout_s)
                self._answering = endpoint
                return answer, errors
            except ssl.SSLError as e:
                raise FenceConfigError(f"TLS with etcd at {endpoint} failed: {e}; commit refused") from e
            except urllib.error.URLError as e:
                if isinstance(e.reason, ssl.SSLError):
                    raise FenceConfigError(f"TLS with etcd at {endpoint} failed: {e.reason}; commit refused") from e
                errors.append(f"{endpoint}: {e}")
            except (_Rejected, OSError, ValueError, http.client.HTTPException) as e:  # incl. a reply cut short
                errors.append(f"{endpoint}: {type(e).__name__}: {e}")
        return None, errors

    def _if_current(self, round_: int, then: list[dict[str, Any]], doing: str) -> None:
        """One transaction: ``then`` (etcd request ops) only if the round key holds ``round_``;
        StaleRoundError if it does not, or if no endpoint answered."""
        body = {
            "compare": [{"key": _b64(self.key), "target": "VALUE", "result": "EQUAL", "value": _b64(str(round_))}],
            "success": then,
            "failure": [],
        }
        answer, errors = self._request("/v3/kv/txn", body)
        if answer is None:
            raise StaleRoundError(
                f"cannot confirm round {round_} is current, etcd unreachable ({'; '.join(errors)}): {doing} refused"
            )
        if not answer.get("succeeded"):
            why = f"round {round_} is no longer current ({self.key} moved on): this worker belongs to an old round"
            log.warning("%s; %s refused", why, doing)  # said here too: a blocked training thread may never report it
            raise StaleRoundError(f"{why}; {doing} refused")

    def check(self, round_: int) -> None:
        self._if_current(round_, [], "commit")

    def record(self, round_: int, step: int, manifest_digest: str) -> None:
        """The commit point: record ``step``'s manifest digest, atomically with the round check
        (StaleRoundError when the round moved on or etcd cannot say). Without a commits key:
        the check alone (the manifest, already stored, is then the commit point)."""
        if not self.commits_key:
            self.check(round_)
            return
        value = json.dumps({"digest": manifest_digest, "round": round_})
        put = {"request_put": {"key": _b64(self._record_key(step)), "value": _b64(value)}}
        self._if_current(round_, [put], f"the commit of step {step}")

    def recorded(self) -> dict[int, str] | None:
        """``{step: manifest digest}`` of every recorded commit (None without a commits key:
        manifests are the truth). Raises CheckpointError when etcd cannot be read: without the
        records nothing can be judged committed. A record that does not parse is skipped."""
        records = self._records()
        return None if records is None else {step: digest for step, (digest, _) in records.items()}

    def _records(self) -> dict[int, tuple[str, int]] | None:
        """``{step: (manifest digest, mod revision)}``; see :meth:`recorded`."""
        if not self.commits_key:
            return None
        prefix = self.commits_key.encode()
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        body = {"key": _b64(self.commits_key), "range_end": base64.b64encode(end).decode(), "limit": MAX_RECORDS}
        answer, errors = self._request("/v3/kv/range", body)
        if answer is None:
            raise CheckpointError(f"cannot read the commit records under {self.commits_key}: {'; '.join(errors)}")
        out: dict[int, tuple[str, int]] = {}
        for kv in answer.get("kvs") or []:
            parsed = _parse_record(self.commits_key, kv)
            if parsed is not None:
                out[parsed[0]] = (parsed[1], parsed[2])
        return out

    def incarnation(self) -> str:
        """Which life of the job this is: ``etcd-<cluster id>-<create revision of the round key>``.
        The round key is created with the job's first round and kept, its value moved on, for
        every later round, so this stays the same across the job's rounds and restarts and
        changes when the job is started anew (its keys deleted and created again, or another
        etcd cluster). CheckpointError when etcd cannot say (unreachable, no such key, a reply
        without those numbers)."""
        answer, errors = self._request("/v3/kv/range", {"key": _b64(self.key)})
        if answer is None:
            raise CheckpointError(f"cannot read the round key {self.key}: {'; '.join(errors)}")
        header = answer.get("header")
        kvs = answer.get("kvs")
        cluster = header.get("cluster_id") if isinstance(header, dict) else None
        created = kvs[0].get("create_revision") if isinstance(kvs, list) and kvs and isinstance(kvs[0], dict) else None
        if not _is_natural(cluster) or not _is_natural(created):
            raise CheckpointError(
                f"the round key {self.key} gave no cluster id and create revision "
                f"(cluster_id={str(cluster)[:40]!r}, create_revision={str(created)[:40]!r})"
            )
        return f"etcd-{int(str(cluster))}-{int(str(created))}"

    def forget(self, round_: int, expected: Mapping[int, str]) -> list[int]:
        """Delete the commit records of the steps in ``expected`` (retention removed them) that
        still name the manifest digest given there: each in one transaction with the round check
        and the record unchanged since it was read here (a newer round that saved and recorded
        the step again in between keeps its record). The steps forgotten; StaleRoundError when
        the round moved on (nothing more deleted); best effort otherwise (logged)."""
        records = self._records()
        if records is None:
            return []
        forgotten = []
        for step, digest in sorted(expected.items()):
            if records.get(step, ("", 0))[0] != digest:
                continue
            key = _b64(self._record_key(step))
            body = {
                "compare": [
                    {"key": _b64(self.key), "target": "VALUE", "result": "EQUAL", "value": _b64(str(round_))},
                    {"key": key, "target": "MOD", "result": "EQUAL", "mod_revision": str(records[step][1])},
                ],
                "success": [{"request_delete_range": {"key": key}}],
                "failure": [{"request_range": {"key": _b64(self.key)}}],
            }
            answer, errors = self._request("/v3/kv/txn", body)
            if answer is None:
                log.warning("could not delete the commit record of step %d: %s", step, "; ".join(errors))
            elif answer.get("succeeded"):
                forgotten.append(step)
            elif _round_moved(answer, round_):
                raise StaleRoundError(
                    f"round {round_} is no longer current ({self.key} moved on): "
                    f"dropping the commit record of step {step} refused"
                )
            else:
                log.warning("kept the commit record of step %d: it was recorded again since it was read", step)
        return forgotten

    def _record_key(self, step: int) -> str:
        return f"{self.commits_key}{step:012d}"


def _is_natural(value: Any) -> bool:
    """A positive integer as etcd's JSON gateway writes int64 fields (a decimal string) or a number."""
    text = str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    return text.isascii() and text.isdigit() and len(text) <= 20 and int(text) > 0


def _parse_record(prefix: str, kv: Any) -> tuple[int, str, int] | None:
    """(step, digest, mod revision) of one commit record as etcd returned it; None (logged) when
    malformed, whatever it holds (a commit record is under the job's prefix: anyone who can write
    there wrote it)."""
    try:
        key = base64.b64decode(kv["key"]).decode()
        value = bounded_json.loads(base64.b64decode(kv.get("value", "")), max_bytes=MAX_RECORD_BYTES, what="value")
        text = key[len(prefix) :] if key.startswith(prefix) else ""
        step = int(text) if 0 < len(text) <= 18 and text.isascii() and text.isdigit() else -1
        digest = value.get("digest") if isinstance(value, dict) else None
        revision = int(kv.get("mod_revision", 0))
        if step < 0 or not isinstance(digest, str) or not _HEX64.fullmatch(digest) or revision <= 0:
            raise ValueError(f"key {key!r}, value {str(value)[:200]!r}")
    except bounded_json.VALUE_ERRORS as e:
        log.warning("ignoring a malformed commit record: %s", e)
        return None
    return step, digest, revision


def _round_moved(answer: dict[str, Any], round_: int) -> bool:
    """Whether a failed transaction's read of the round key (its failure branch) shows another
    round than ``round_`` (or no round key)."""
    try:
        kvs = answer["responses"][0]["response_range"].get("kvs") or []
        return not kvs or base64.b64decode(kvs[0].get("value", "")).decode() != str(round_)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        return True  # cannot tell: as if it moved (nothing is deleted either way)


def from_env() -> EtcdRoundFence | None:
    env = WorkerEnv.from_env()
    if not env.etcd or not env.fence_key:
        return None
    return EtcdRoundFence(
        list(env.etcd), env.fence_key, commits_key=env.commits_key, client_file=env.etcd_client_file or None
    )
