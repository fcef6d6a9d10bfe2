"""`lockstep k8s`: the TrainJob it writes is what Kubeflow Trainer's published API models accept, field
for field (kubeflow-trainer-api, generated from the TrainJob CRD's OpenAPI schema), and reads back as
written; bad input is refused by name."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest

from lockstep.cli.main import main

pytestmark = pytest.mark.timeout(60)
yaml = pytest.importorskip("yaml")
models = pytest.importorskip("kubeflow_trainer_api.models")


def _accepted_as_is(manifest: dict) -> bool:
    """The schema's model takes every field (none unknown, none of the wrong type) and gives it back."""
    job = models.TrainerV1alpha1TrainJob.from_dict(manifest)
    return job is not None and job.to_dict() == manifest


def _written(tmp_path, *argv: str) -> dict:
    out = tmp_path / "job.yaml"
    assert main(["k8s", "--out", str(out), *argv]) == 0
    return yaml.safe_load(out.read_text())


def test_the_trainjob_runs_lockstep_run_on_every_node_and_matches_the_trainjob_schema(tmp_path):
    manifest = _written(tmp_path, "--image", "registry.example/team/train:1", "--nodes", "2", "--devices", "8",
                        "--cpu", "32", "--memory", "256Gi", "--volume", "ckpt:/ckpt", "--env", "LOCKSTEP_TIMEOUT=600",
                        "--namespace", "ml", "--grace-period", "120", "train_llm.py", "--lr", "0.1")
    assert _accepted_as_is(manifest)
    assert (manifest["apiVersion"], manifest["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert manifest["metadata"] == {"name": "train-llm", "namespace": "ml"}
    trainer = manifest["spec"]["trainer"]
    # no option: the torch runtime's PET_* variables give lockstep run the nodes, rank and master
    assert trainer["command"] == ["lockstep", "run", "train_llm.py", "--lr", "0.1"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 8)
    assert trainer["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": "8", "cpu": "32", "memory": "256Gi"}
    assert trainer["env"] == [{"name": "LOCKSTEP_TIMEOUT", "value": "600"}]
    pod = manifest["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    assert pod["name"] == "node"
    spec = pod["template"]["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] == 120
    assert spec["volumes"] == [{"name": "lockstep-volume-0", "persistentVolumeClaim": {"claimName": "ckpt"}}]
    assert spec["containers"] == [{"name": "node", "volumeMounts": [{"name": "lockstep-volume-0",
                                                                      "mountPath": "/ckpt"}]}]
    cpu = _written(tmp_path, "--image", "img", "--accelerator", "cpu", "--devices", "4", "t.py")
    assert _accepted_as_is(cpu) and "resourcesPerNode" not in cpu["spec"]["trainer"]


def test_the_schema_check_refuses_a_field_the_trainjob_does_not_have(tmp_path):
    manifest = _written(tmp_path, "--image", "img", "t.py")
    misspelled = copy.deepcopy(manifest)
    misspelled["spec"]["trainer"]["numNode"] = misspelled["spec"]["trainer"].pop("numNodes")
    assert not _accepted_as_is(misspelled)
    wrong_type = copy.deepcopy(manifest)
    wrong_type["spec"]["trainer"]["numNodes"] = "2"
    with pytest.raises(ValueError):  # pydantic's ValidationError is a ValueError
        _accepted_as_is(wrong_type)


@pytest.mark.parametrize("argv, says", [
    (["--name", "Bad_Name"], "--name 'Bad_Name'"),
    (["--volume", "ckpt"], "--volume 'ckpt': give CLAIM:PATH"),
    (["--env", "NOVALUE"], "--env 'NOVALUE': give NAME=VALUE"),
    (["--env", "BAD NAME=1"], "--env 'BAD NAME=1': give NAME=VALUE, NAME of letters"),
    (["--namespace", "Not A Namespace!"], "--namespace 'Not A Namespace!': a Kubernetes namespace"),
    (["--nodes", "0"], "must be at least 1"),
])
def test_bad_input_is_refused_by_name(argv, says, capsys):
    assert main(["k8s", "--image", "img", *argv, "t.py"]) == 2
    assert says in capsys.readouterr().err


def test_several_pods_without_a_volume_are_warned_that_no_other_pod_sees_their_checkpoints(tmp_path, capsys):
    _written(tmp_path, "--image", "img", "--nodes", "2", "t.py")
    assert "warning: 2 pods and no --volume" in capsys.readouterr().err
    for argv in (["--nodes", "2", "--volume", "ckpt:/ckpt"], ["--nodes", "1"]):
        _written(tmp_path, "--image", "img", *argv, "t.py")
        assert "warning" not in capsys.readouterr().err


def test_what_the_arguments_hold_is_what_the_container_gets_and_no_second_object(tmp_path):
    """A line break in an argument ended the header's comment, so the rest of it was YAML of its own (a
    privileged Pod beside the TrainJob); '$(NAME)' was expanded by Kubernetes per pod; a character beyond
    the BMP came back as two lone surrogates."""
    out = tmp_path / "job.yaml"
    hostile = "x\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: injected}\n"
    done = subprocess.run([sys.executable, "-m", "lockstep.cli.main", "k8s", "--image", "img", "--out", str(out),
                           "--env", "RUN=$(POD_NAME)-$$", "t.py", hostile, "$(PET_NODE_RANK)", "\U0001f600 \u2028"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    documents = list(yaml.safe_load_all(out.read_text(encoding="utf-8")))
    assert len(documents) == 1 and documents[0]["kind"] == "TrainJob" and _accepted_as_is(documents[0])
    trainer = documents[0]["spec"]["trainer"]
    # Kubernetes reads $$ as $: each $ doubled, so the script gets exactly these arguments
    assert trainer["command"] == ["lockstep", "run", "t.py", hostile.replace("$", "$$"), "$$(PET_NODE_RANK)",
                                  "\U0001f600 \u2028"]
    assert trainer["env"] == [{"name": "RUN", "value": "$$(POD_NAME)-$$$$"}]
