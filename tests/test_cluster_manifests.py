"""The cluster examples are wired to the code: examples/kubernetes/ (the controller's Deployment and Service, the
workers as an indexed Job and as a JobSet) and examples/slurm/elastic.sbatch.

Every check compares against the code's own names and rules (the ENV_* constants, the controller's flags,
``auth.load_secret``'s file-mode rule, ``EXIT_REPLACE``), so renaming one in the code fails here. The worker's
id formula is run, not read: each pod's shell command runs with a stand-in ``python``. The sbatch script runs
against stand-ins for ``srun`` and ``scontrol``, a controller that waits for its workers and workers that fail.
None of this is a real cluster: it checks the wiring, not Kubernetes or SLURM.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from elastic_runtime.cluster import auth, protocol
from elastic_runtime.cluster.controller.admission import _MAX_WORKER_ID

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "examples" / "kubernetes"
SBATCH = ROOT / "examples" / "slurm" / "elastic.sbatch"

# Every environment variable a worker or the controller reads, by the code's own constants.
KNOWN_ENV = {getattr(protocol, name) for name in protocol.__all__ if name.startswith("ENV_")} | {
    auth.ENV_TOKEN,
    auth.ENV_TOKEN_FILE,
}
SECRET_NAME = "elastic-runtime-token"
WORKER_MANIFESTS = ["workers-job.yaml", "workers-jobset.yaml"]
# Kubernetes' own names (KEP-3850; the JobSet API), which the worker id is made from.
FAILURE_COUNT = "metadata.annotations['batch.kubernetes.io/job-index-failure-count']"
RESTART_ATTEMPT = "metadata.annotations['jobset.sigs.k8s.io/restart-attempt']"

Doc = dict[str, Any]


def documents(name: str) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def one(name: str, kind: str) -> Doc:
    (doc,) = [doc for doc in documents(name) if doc["kind"] == kind]
    return doc


def job_spec(name: str) -> Doc:
    """The worker Job's spec, from the plain Job or from the JobSet's only replicated Job."""
    doc = one(name, "JobSet" if "jobset" in name else "Job")
    if doc["kind"] == "JobSet":
        (replicated,) = doc["spec"]["replicatedJobs"]
        assert replicated["replicas"] == 1
        spec: Doc = replicated["template"]["spec"]
        return spec
    spec = doc["spec"]
    return spec


def controller_pod() -> Doc:
    spec: Doc = one("controller.yaml", "Deployment")["spec"]["template"]["spec"]
    return spec


def pods() -> Iterator[tuple[str, Doc]]:
    yield "controller.yaml", controller_pod()
    for name in WORKER_MANIFESTS:
        yield name, job_spec(name)["template"]["spec"]


def container(pod: Doc) -> Doc:
    (only,) = pod["containers"]
    return only


def env(pod: Doc) -> dict[str, Doc]:
    return {item["name"]: item for item in container(pod).get("env", [])}


def flag(args: list[str], name: str) -> str:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in ``args``."""
    for i, arg in enumerate(args):
        if arg == name:
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} is not in {args}")


def controller_args() -> list[str]:
    ctr = container(controller_pod())
    assert ctr["command"] == ["elastic-runtime", "controller"]
    return [str(arg) for arg in ctr["args"]]


def worker_script(name: str) -> str:
    ctr = container(job_spec(name)["template"]["spec"])
    assert ctr["command"] == ["/bin/sh", "-c"]
    (script,) = ctr["args"]
    return str(script)


def worker_command(name: str) -> list[str]:
    """The training command a worker pod runs (its script's last line: ``exec python ...``)."""
    last = [line for line in worker_script(name).splitlines() if line.strip()][-1].split()
    # exec: the pod's exit code is the worker's own (0: the index is done; anything else: it is replaced).
    assert last[0] == "exec", last
    return last[1:]


# --- Kubernetes ---------------------------------------------------------------------------------------------


def test_every_manifest_parses_as_the_kinds_we_ship() -> None:
    kinds = sorted(doc["kind"] for path in K8S.glob("*.yaml") for doc in documents(path.name))
    assert kinds == ["Deployment", "Job", "JobSet", "NetworkPolicy", "Service"]
    assert one("workers-jobset.yaml", "JobSet")["apiVersion"] == "jobset.x-k8s.io/v1alpha2"


def test_env_names_are_the_codes() -> None:
    for name, pod in pods():
        named = set(env(pod)) | set(re.findall(r"\bELASTIC_[A-Z_]+", yaml.safe_dump(pod)))
        unknown = {n for n in named if n.startswith("ELASTIC_")} - KNOWN_ENV
        assert not unknown, f"{name}: {unknown} is read by no code (known: {sorted(KNOWN_ENV)})"
    assert auth.ENV_TOKEN_FILE in env(controller_pod())
    for name in WORKER_MANIFESTS:
        worker_env = env(job_spec(name)["template"]["spec"])
        assert {protocol.ENV_CONTROLLER, auth.ENV_TOKEN_FILE} <= set(worker_env), name
        assert f"export {protocol.ENV_WORKER}=" in worker_script(name), name


def test_the_service_is_the_controllers_port() -> None:
    service = one("controller.yaml", "Service")
    (port,) = service["spec"]["ports"]
    host, _, listen_port = flag(controller_args(), "--listen").rpartition(":")
    assert port["port"] == port["targetPort"] == int(listen_port)
    assert host == "0.0.0.0"  # a wildcard --listen needs --coordinator-host: the Service's name
    assert flag(controller_args(), "--coordinator-host") == service["metadata"]["name"]
    labels = one("controller.yaml", "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    # The coordination services listen on --coordinator-ports: a headless Service reaches every port of the pod;
    # a ClusterIP one would have to list each.
    low, high = (int(p) for p in flag(controller_args(), "--coordinator-ports").split("-"))
    listed = {p["port"] for p in service["spec"]["ports"]}
    assert service["spec"].get("clusterIP") == "None" or set(range(low, high + 1)) <= listed
    for name in WORKER_MANIFESTS:
        address = env(job_spec(name)["template"]["spec"])[protocol.ENV_CONTROLLER]["value"]
        assert address == f"{service['metadata']['name']}:{port['port']}", name


def test_the_network_policy_admits_the_runs_pods_to_each_other() -> None:
    policy = one("networkpolicy.yaml", "NetworkPolicy")["spec"]
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    selected = policy["podSelector"]["matchLabels"]
    assert source["podSelector"]["matchLabels"] == selected
    templates = [one("controller.yaml", "Deployment")["spec"]["template"]]
    templates += [job_spec(name)["template"] for name in WORKER_MANIFESTS]
    for template in templates:
        assert selected.items() <= template["metadata"]["labels"].items()


def test_the_secret_is_mounted_where_it_is_read(tmp_path: Path) -> None:
    for name, pod in pods():
        path = Path(env(pod)[auth.ENV_TOKEN_FILE]["value"])
        (mount,) = [m for m in container(pod)["volumeMounts"] if Path(m["mountPath"]) == path.parent]
        assert mount.get("readOnly") is True, name
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        secret = volume["secret"]
        assert secret["secretName"] == SECRET_NAME, name
        items = {item["path"]: item for item in secret.get("items", [])}
        item = items.get(path.name, {"key": path.name})
        assert item["key"] == "token", name
        # The mode the kubelet gives the file (Kubernetes' default is 0644), judged by the code's own rule.
        mode = item.get("mode", secret.get("defaultMode", 0o644))
        token = tmp_path / f"{name}.token"
        token.write_text("s3cret\n")
        token.chmod(mode)
        assert auth.load_secret({auth.ENV_TOKEN_FILE: str(token)}) == "s3cret", f"{name}: mode {mode:o}"
        # An fsGroup adds group read to the secret's files, which the worker refuses.
        assert "fsGroup" not in (pod.get("securityContext") or {}), name
    readme = (K8S / "README.md").read_text()
    assert f"kubectl create secret generic {SECRET_NAME} --from-file=token=" in readme


def test_no_secret_in_any_command_line() -> None:
    for name, pod in pods():
        ctr = container(pod)
        line = " ".join(str(part) for part in ctr.get("command", []) + ctr.get("args", []))
        token_dir = str(Path(env(pod)[auth.ENV_TOKEN_FILE]["value"]).parent)
        assert token_dir not in line, f"{name} reads the token on its command line"
        assert not re.search(rf"\b{auth.ENV_TOKEN}\b(?!_FILE)", line), name
        # Not in the pod's environment either (visible in the pod spec and in /proc/PID/environ).
        assert auth.ENV_TOKEN not in env(pod), name


def test_the_workers_and_the_controller_agree() -> None:
    nprocs = int(flag(controller_args(), "--nprocs"))
    steps = flag(controller_args(), "--steps")
    specs = {name: job_spec(name) for name in WORKER_MANIFESTS}
    # One pod template for both: the JobSet is the Job wrapped.
    assert specs["workers-job.yaml"] == specs["workers-jobset.yaml"]
    for name, spec in specs.items():
        pod = spec["template"]["spec"]
        worker_env = env(pod)
        assert flag(worker_command(name), "--steps") == steps, f"{name}: the controller refuses another target"
        assert worker_command(name)[0] == "python"
        assert spec["completionMode"] == "Indexed"
        assert spec["completions"] == spec["parallelism"] == nprocs == int(worker_env["WORKERS"]["value"])
        assert spec["backoffLimitPerIndex"] == int(worker_env["RETRIES_PER_INDEX"]["value"])
        # A replacement as soon as the old pod is terminating (one on an unreachable node never finishes); its
        # new id makes two pods of one index harmless. A podFailurePolicy would only allow "Failed".
        assert spec["podReplacementPolicy"] == "TerminatingOrFailed"
        assert "podFailurePolicy" not in spec, name
        assert pod["restartPolicy"] == "Never"
        assert worker_env["INDEX_FAILURES"]["valueFrom"]["fieldRef"]["fieldPath"] == FAILURE_COUNT
        assert worker_env["RESTART_ATTEMPT"]["valueFrom"]["fieldRef"]["fieldPath"] == RESTART_ATTEMPT
        # A pod on a node that stops answering is evicted, and so replaced, well before the default 300 s.
        waits = {t["key"]: t["tolerationSeconds"] for t in pod["tolerations"] if t.get("effect") == "NoExecute"}
        assert waits.keys() == {"node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"}
        assert max(waits.values()) <= 60


def worker_id(tmp_path: Path, name: str, index: int, failures: int, attempt: str) -> int:
    """Run the worker pod's shell command as the pod would, with a stand-in ``python`` that prints its id."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    python = fake / "python"
    python.write_text(f'#!/bin/sh\necho "${protocol.ENV_WORKER}"\n')
    python.chmod(0o755)
    pod = job_spec(name)["template"]["spec"]
    values = {key: item["value"] for key, item in env(pod).items() if "value" in item}
    values |= {"JOB_COMPLETION_INDEX": str(index), "INDEX_FAILURES": str(failures), "RESTART_ATTEMPT": attempt}
    values["PATH"] = f"{fake}:/usr/bin:/bin"
    done = subprocess.run(["/bin/sh", "-c", worker_script(name)], env=values, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


@pytest.mark.parametrize("name", WORKER_MANIFESTS)
def test_worker_ids_are_new_for_every_pod(tmp_path: Path, name: str) -> None:
    spec = job_spec(name)
    n, retries = spec["completions"], spec["backoffLimitPerIndex"]
    # The first pods are 0..N-1 (the convention of docs/multiprocess.md); a plain Job has no restart attempt.
    assert [worker_id(tmp_path, name, i, 0, "") for i in range(n)] == list(range(n))
    seen: dict[int, tuple[int, int, int]] = {}
    for attempt in range(3):
        for failures in range(retries + 1):  # failures <= backoffLimitPerIndex: past that the index has failed
            for index in range(n):
                worker = worker_id(tmp_path, name, index, failures, str(attempt))
                assert worker not in seen, f"id {worker} for {index, failures, attempt} and for {seen[worker]}"
                assert 0 <= worker <= _MAX_WORKER_ID
                seen[worker] = (index, failures, attempt)


# --- SLURM --------------------------------------------------------------------------------------------------


def test_the_sbatch_script_is_bash() -> None:
    done = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    text = SBATCH.read_text()
    named = set(re.findall(r"\bELASTIC_[A-Z_]+", text))
    assert named <= KNOWN_ENV, named - KNOWN_ENV
    assert {auth.ENV_TOKEN_FILE, protocol.ENV_CONTROLLER, protocol.ENV_WORKER} <= named
    assert not re.search(rf"\b{auth.ENV_TOKEN}\b(?!_FILE)", text)


FAKES = {
    # srun: note the command line, then run the step's command "on" the node it names.
    "srun": r"""#!/bin/bash
printf '%s\n' "$*" >>"$FAKE_LOG/srun.log"
node=
while [[ $# -gt 0 && $1 == --* ]]; do
    [[ $1 == --nodelist=* ]] && node=${1#--nodelist=}
    shift
done
FAKE_NODE=$node exec "$@"
""",
    "scontrol": r"""#!/bin/bash
case "$1 $2" in
    "show hostnames") tr ',' '\n' <<<"$3" ;;
    "show node") if [[ " $FAKE_DOWN " == *" $3 "* ]]; then echo "NodeName=$3 State=DOWN+NOT_RESPONDING";
                 else echo "NodeName=$3 State=ALLOCATED"; fi ;;
esac
""",
    # The controller: note its arguments, wait until FAKE_HELLOS workers said hello, then stop them.
    "elastic-runtime": r"""#!/bin/bash
printf '%s\n' "$@" >"$FAKE_LOG/controller.args"
for _ in $(seq 400); do
    [[ -f $FAKE_LOG/hello && $(wc -l <"$FAKE_LOG/hello") -ge $FAKE_HELLOS ]] && break
    sleep 0.05
done
touch "$FAKE_LOG/stop"
""",
    # A worker: keep a copy of the token file it was given (its mode too, for the test to judge by the code's
    # rule), say hello, then fail as FAKE_FAIL says ("ID:CODE ...") or run until the controller stops.
    "python": r"""#!/bin/bash
cp -p "$ELASTIC_RUNTIME_TOKEN_FILE" "$FAKE_LOG/token-$ELASTIC_WORKER_ID" || exit 1
echo "$ELASTIC_WORKER_ID $FAKE_NODE $ELASTIC_CONTROLLER $*" >>"$FAKE_LOG/hello"
code=$(tr ' ' '\n' <<<"$FAKE_FAIL" | sed -n "s/^$ELASTIC_WORKER_ID://p")
[[ -n $code ]] && exit "$code"
for _ in $(seq 400); do [[ -f $FAKE_LOG/stop ]] && exit 0; sleep 0.05; done
exit 1
""",
}


def test_the_sbatch_script_replaces_a_failed_worker_with_a_new_id(tmp_path: Path) -> None:
    fake, log, run = tmp_path / "bin", tmp_path / "log", tmp_path / "run"
    fake.mkdir()
    log.mkdir()
    for name, text in FAKES.items():
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    nodes = [f"n{i}" for i in range(5)]
    values = {
        "PATH": f"{fake}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": ",".join(nodes),
        "RUN_DIR": str(run),
        "POLL_S": "0.1",
        "FAKE_LOG": str(log),
        "FAKE_HELLOS": "6",  # 4 workers and 2 replacements
        # 1: its place was taken; 2: its node failed, and srun then exits 0 (as a real SLURM's does: the step's
        # task never said how it ended),
        "FAKE_FAIL": f"1:{protocol.EXIT_REPLACE} 2:0",
        "FAKE_DOWN": "n2",  # which SLURM reports down
    }
    done = subprocess.run(["bash", str(SBATCH)], env=values, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr

    hellos = [line.split() for line in (log / "hello").read_text().splitlines()]
    placed = {int(h[0]): h[1] for h in hellos}
    # The first group on the first four nodes; each replacement a new id; none on the node SLURM reports down.
    assert placed == {0: "n0", 1: "n1", 2: "n2", 3: "n3", 4: "n4", 5: "n1"}, done.stdout
    assert "replacing worker" in done.stdout and "node n2 is down" in done.stdout

    args = (log / "controller.args").read_text().split("\n")
    assert args[:1] == ["controller"]
    port = flag(args, "--listen").rpartition(":")[2]
    assert flag(args, "--nprocs") == "4"
    for _, _, controller, *command in hellos:
        assert controller == f"{flag(args, '--coordinator-host')}:{port}" == f"n0:{port}"
        assert flag(command, "--steps") == flag(args, "--steps"), "the controller refuses another target"
    (step,) = [line for line in (log / "srun.log").read_text().splitlines() if "elastic-runtime controller" in line]
    assert "--overlap" in step and "--nodelist=n0" in step, step  # on the first node, beside its worker

    # Every worker was given the same secret in a file the code accepts; it is on no command line, and gone after.
    secrets = {auth.load_secret({auth.ENV_TOKEN_FILE: str(log / f"token-{worker}")}) for worker in placed}
    (secret,) = secrets
    assert len(secret) == 64
    assert secret not in (log / "srun.log").read_text() + (log / "controller.args").read_text()
    assert not (run / "token").exists()
    assert stat.S_IMODE((run).stat().st_mode) & (stat.S_IRWXG | stat.S_IRWXO) == 0


def test_the_docs_name_the_examples() -> None:
    docs = (ROOT / "docs" / "cluster.md").read_text()
    for path in [SBATCH, *K8S.glob("*.yaml")]:
        assert str(path.relative_to(ROOT)) in docs, path
