"""The Kubernetes manifests in examples/kubernetes/ are valid and have a training job's semantics.

Offline only: no API server. The Job and the Service are checked strictly (no unknown field)
against the Kubernetes OpenAPI schemas that ``kubernetes-validate`` ships, for every version from
the manifests' minimum (1.31: podFailurePolicy GA, backoffLimitPerIndex and successPolicy on by
default) to the newest the package knows. The JobSet (a CRD, in no Kubernetes schema) is checked
strictly against the JobSet models of ``kubeflow-trainer-api`` (Kubeflow Trainer's generated
``jobset.x-k8s.io/v1alpha2`` types: every field name known, every value of its type), and its Job
template against the batch/v1 Job schema like the Job.

Then the semantics: how each exit code of the agent (:mod:`ftrain.contract.exits`) is handled,
that the pod outlives the agent's drain, that the environment names every ``$(NAME)`` used, that
the sizes agree, and that the JobSet runs the same Job as the plain manifest.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any

import pytest

from ftrain.agents.config import AgentConfig
from ftrain.contract import exits
from ftrain.contract.config import parse_nnodes
from ftrain.testbed.procs import REPO

kv = pytest.importorskip(
    "kubernetes_validate.utils",
    reason="kubernetes-validate is not installed (pip install -e '.[dev]'): the manifests are not validated",
)
yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (kubernetes-validate needs it)")

EXAMPLES = REPO / "examples" / "kubernetes"
JOB_FILE = EXAMPLES / "ftrain.yaml"
JOBSET_FILE = EXAMPLES / "ftrain-jobset.yaml"
MIN_VERSION = (1, 31)
VAR = re.compile(r"\$\((\w+)\)")


def _versions() -> list[str]:
    """Every Kubernetes minor version kubernetes-validate has schemas for, from MIN_VERSION on."""
    out = []
    for version in kv.all_versions():
        major, minor = (int(x) for x in version.split(".")[:2])
        if (major, minor) >= MIN_VERSION:
            out.append(f"{major}.{minor}")
    return sorted(set(out), key=lambda v: tuple(int(x) for x in v.split(".")))


VERSIONS = _versions()


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kind(path: Path, kind: str) -> dict[str, Any]:
    (doc,) = [d for d in _documents(path) if d["kind"] == kind]
    return doc


def _job_spec_of_jobset() -> dict[str, Any]:
    (replicated,) = _kind(JOBSET_FILE, "JobSet")["spec"]["replicatedJobs"]
    return replicated["template"]["spec"]


def _job_specs() -> dict[str, dict[str, Any]]:
    return {"job": _kind(JOB_FILE, "Job")["spec"], "jobset": _job_spec_of_jobset()}


def _rule_for_exit(spec: dict[str, Any], code: int) -> dict[str, Any] | None:
    """The first podFailurePolicy rule that decides a pod whose agent exited with ``code`` (and
    that has no DisruptionTarget condition): the Job controller takes the first match."""
    container = spec["template"]["spec"]["containers"][0]["name"]
    for rule in spec["podFailurePolicy"]["rules"]:
        on = rule.get("onExitCodes")
        if on is None or on.get("containerName", container) != container:
            continue
        if (code in on["values"]) == (on["operator"] == "In"):
            return rule
    return None


# -- schema validation ----------------------------------------------------------------------------


def test_there_are_versions_to_validate_for():
    assert VERSIONS, f"kubernetes-validate {kv.latest_version()} has no schema at or above {MIN_VERSION}"


@pytest.mark.parametrize("version", VERSIONS)
def test_the_job_and_the_service_are_valid(version):
    docs = _documents(JOB_FILE)
    assert sorted(d["kind"] for d in docs) == ["Job", "Service"]
    for doc in docs:
        kv.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_jobsets_job_template_is_a_valid_job(version):
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "ftrain-node-0"},
        "spec": _job_spec_of_jobset(),
    }
    kv.validate(job, version, strict=True)


def test_an_older_kubernetes_does_not_know_the_fields_used():
    """The strict check does see the new fields: 1.29's Job has no successPolicy."""
    with pytest.raises(kv.ValidationError, match="successPolicy"):
        kv.validate(_kind(JOB_FILE, "Job"), "1.29", strict=True)


def _model_type(annotation: Any) -> Any:
    """The pydantic model inside ``Optional[List[Model]]`` and the like (or the annotation)."""
    while typing.get_origin(annotation) in (typing.Union, types.UnionType, list, dict):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[-1]
    return annotation


def _unknown_fields(value: Any, model: Any, where: str) -> list[str]:
    """The field names in ``value`` (a dict read from YAML) that ``model`` and its nested models
    do not declare: what a CRD with a structural schema would prune or reject."""
    from pydantic import BaseModel

    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return []
    if isinstance(value, list):
        return [u for i, v in enumerate(value) for u in _unknown_fields(v, model, f"{where}[{i}]")]
    if not isinstance(value, dict):
        if "actual_instance" in model.model_fields:  # a oneOf of scalars (a quantity: 8 or "8Gi")
            return []
        return [f"{where}: {value!r} is not an object"]
    fields = {(f.alias or name): f for name, f in model.model_fields.items()}
    out = []
    for key, item in value.items():
        if key not in fields:
            out.append(f"{where}.{key}")
            continue
        annotation = fields[key].annotation
        if typing.get_origin(_strip_optional(annotation)) is dict:  # a map: check its values
            inner = _model_type(annotation)
            out += [u for k, v in item.items() for u in _unknown_fields(v, inner, f"{where}.{key}.{k}")]
        else:
            out += _unknown_fields(item, _model_type(annotation), f"{where}.{key}")
    return out


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return inner
    return annotation


def test_the_jobset_is_valid_against_the_jobset_api():
    models = pytest.importorskip(
        "kubeflow_trainer_api.models",
        reason="kubeflow-trainer-api is not installed (pip install -e '.[dev]'): the JobSet is not validated",
    )
    jobset = _kind(JOBSET_FILE, "JobSet")
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    model = models.JobsetV1alpha2JobSet
    assert _unknown_fields(jobset, model, "JobSet") == []
    parsed = model.from_dict(jobset)  # the types (a missing required name reads as '': checked below)
    (replicated,) = parsed.spec.replicated_jobs
    assert replicated.name and replicated.replicas == 1
    # the enums are in the field descriptions only
    rule_model = models.JobsetV1alpha2FailurePolicyRule
    (valid,) = re.findall(r"Valid values are ([^.]*)\.", rule_model.model_fields["action"].description)
    for rule in parsed.spec.failure_policy.rules:
        assert rule.action in re.split(r",\s*", valid)
        assert re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", rule.name)
    assert parsed.spec.success_policy.operator in ("All", "Any")
    assert parsed.spec.failure_policy.restart_strategy in ("Recreate", "BlockingRecreate")


# -- semantics --------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["job", "jobset"])
def test_each_exit_code_of_the_agent_is_handled(which):
    spec = _job_specs()[which]
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy needs it
    assert spec["completionMode"] == "Indexed"
    drained = _rule_for_exit(spec, exits.DRAINED)
    assert drained is not None and drained["action"] == "Ignore", "a drained agent's pod must be recreated"
    failed = _rule_for_exit(spec, exits.FAILED)
    assert failed is not None and failed["action"] == "FailJob", "the training job failed: fail the Job"
    # exit 2 is also etcd not reachable or a node id still leased at start-up: retried, counted
    assert _rule_for_exit(spec, exits.USAGE) is None
    assert _rule_for_exit(spec, exits.OK) is None  # success is never a pod failure
    disrupted = [r for r in spec["podFailurePolicy"]["rules"] if r.get("onPodConditions")]
    assert [(r["action"], r["onPodConditions"]) for r in disrupted] == [
        ("Ignore", [{"type": "DisruptionTarget", "status": "True"}])
    ]
    # retries are per node; the replacement starts after the old pod (and its lease) is gone
    assert spec["backoffLimitPerIndex"] >= 1 and "backoffLimit" not in spec
    assert spec["podReplacementPolicy"] == "Failed"


@pytest.mark.parametrize("which", ["job", "jobset"])
def test_the_pod_outlives_the_agents_drain(which):
    (drain,) = [f.default for f in dataclasses.fields(AgentConfig) if f.name == "drain_timeout_s"]
    grace = _job_specs()[which]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > drain, f"terminationGracePeriodSeconds {grace} must exceed agent.drain_timeout_s {drain}"


@pytest.mark.parametrize("which", ["job", "jobset"])
def test_the_environment_names_every_variable_used(which):
    """Kubernetes expands ``$(NAME)`` only for a variable defined earlier in ``env``; one it does
    not know stays as the literal text (an agent started with ``--node-id $(FTRAIN_NODE_ID)``)."""
    (container,) = _job_specs()[which]["template"]["spec"]["containers"]
    names = [e["name"] for e in container["env"]]
    assert len(names) == len(set(names))
    for i, entry in enumerate(container["env"]):
        for used in VAR.findall(entry.get("value", "")):
            assert used in names[:i], f"env {entry['name']} uses $({used}), not defined before it"
    used = {name for word in container["command"] for name in VAR.findall(word)}
    assert used >= {"FTRAIN_NODE_ID", "FTRAIN_NNODES", "FTRAIN_NPROC_PER_NODE", "FTRAIN_HOST", "FTRAIN_ETCD"}
    assert used <= set(names), f"the command uses {sorted(used - set(names))}, not in env"
    completion_index = next(e for e in container["env"] if e["name"] == "JOB_COMPLETION_INDEX")
    assert "job-completion-index" in completion_index["valueFrom"]["fieldRef"]["fieldPath"]


@pytest.mark.parametrize("which", ["job", "jobset"])
def test_the_sizes_agree(which):
    """One pod per node up to the job's largest size, one failed index tolerated per node the job
    can do without, one GPU per worker."""
    spec = _job_specs()[which]
    (container,) = spec["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    low, high = parse_nnodes(env["FTRAIN_NNODES"])
    assert spec["completions"] == spec["parallelism"] == high
    assert spec["maxFailedIndexes"] == high - low
    assert container["resources"]["limits"]["nvidia.com/gpu"] == int(env["FTRAIN_NPROC_PER_NODE"])
    # the first agent to exit 0 proves the training job finished
    assert spec["successPolicy"] == {"rules": [{"succeededCount": 1}]}


def test_the_jobset_runs_the_same_job():
    job = _kind(JOB_FILE, "Job")["spec"]
    inner = _job_spec_of_jobset()
    job_pod = dict(job["template"]["spec"])
    assert job_pod.pop("subdomain") == _kind(JOB_FILE, "Service")["metadata"]["name"]
    assert {**job, "template": {"spec": job_pod}} == inner


def test_the_jobset_fails_on_the_jobs_failure_and_succeeds_on_its_end():
    spec = _kind(JOBSET_FILE, "JobSet")["spec"]
    first = spec["failurePolicy"]["rules"][0]
    assert first["action"] == "FailJobSet"
    assert first["onJobFailureReasons"] == ["PodFailurePolicy"]  # the Job's reason for FailJob
    assert spec["successPolicy"]["operator"] == "All"
