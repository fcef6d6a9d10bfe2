"""``lockstep k8s``: write a Kubeflow Trainer TrainJob manifest that runs a script with ``lockstep run``.

The TrainJob uses Kubeflow Trainer's torch runtime (``torch-distributed`` by default), which starts
one pod per node and gives each the ``PET_*`` variables that ``lockstep run`` reads: the entrypoint is
``lockstep run SCRIPT ARGS`` with no option. Apply it with ``kubectl apply -f FILE``.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from lockstep.cli.slurm import one_line
from lockstep.errors import ConfigError

#: The pod's grace period after TERM (an eviction, a node drain): the Trainer's preemption checkpoint
#: must fit in it, and torch's agent gives the workers 30 s of it before it kills them.
DEFAULT_GRACE_S = 60
#: Kubernetes names (RFC 1123 labels): what a TrainJob's name and its pods' host names must be.
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
#: An environment variable's name as every Kubernetes version takes it (C_IDENTIFIER, with '-' and '.').
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = commands.add_parser(
        "k8s", allow_abbrev=False, help="write a Kubeflow Trainer TrainJob manifest for SCRIPT (apply it with kubectl)",
        description="Write a TrainJob (Kubeflow Trainer, trainer.kubeflow.org/v1alpha1) that runs "
        "`lockstep run SCRIPT ARGS` on --nodes pods of --devices devices each. See docs/launching.md.",
    )
    parser.add_argument("--image", required=True, help="the container image (lockstep and the script's needs in it)")
    parser.add_argument("--nodes", type=int, default=1, help="pods, one per node (default 1)")
    parser.add_argument("--devices", type=int, default=1, help="per node: GPUs with cuda, processes with cpu")
    parser.add_argument("--accelerator", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--cpu", help="CPU cores per node (requests and limits), e.g. 16")
    parser.add_argument("--memory", help="memory per node (requests and limits), e.g. 128Gi")
    parser.add_argument("--name", help="the TrainJob's name (default: the script's name)")
    parser.add_argument("--namespace", help="the Kubernetes namespace (default: kubectl's)")
    parser.add_argument("--runtime", default="torch-distributed",
                        help="the ClusterTrainingRuntime to run on (default torch-distributed)")
    parser.add_argument("--grace-period", type=int, default=DEFAULT_GRACE_S,
                        help=f"seconds a pod has after TERM to checkpoint (default {DEFAULT_GRACE_S})")
    parser.add_argument("--volume", action="append", default=[], metavar="CLAIM:PATH",
                        help="mount a PersistentVolumeClaim at PATH in every pod (checkpoints must be on a "
                        "volume every pod sees); repeatable")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="repeatable")
    parser.add_argument("--out", help="write the manifest here (default: print it)")
    parser.add_argument("script", metavar="SCRIPT", help="the script's path inside the image")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS")
    parser.set_defaults(func=k8s_command)


def k8s_command(args: argparse.Namespace) -> int:
    try:
        text = to_yaml(trainjob(args))
    except ConfigError as error:
        print(f"lockstep k8s: {error}", file=sys.stderr)
        return 2
    if args.nodes > 1 and not args.volume:
        print(f"lockstep k8s: warning: {args.nodes} pods and no --volume: each pod writes its checkpoints to its own "
              "disk, which no other pod sees and which goes with the pod, so a restarted job cannot resume (a "
              "resume needs every rank to see the same newest checkpoint). Give --volume CLAIM:PATH, a "
              "ReadWriteMany claim mounted in every pod, and checkpoint under PATH.", file=sys.stderr)
    # one comment line, whatever the arguments hold (a line break in one would begin YAML of its own)
    header = f"# Written by: lockstep k8s {one_line(shlex.join(sys.argv[2:]))}\n# Apply with: kubectl apply -f FILE\n"
    if args.out:
        Path(args.out).write_text(header + text, encoding="utf-8")
        print(f"lockstep k8s: wrote {args.out}; apply it with: kubectl apply -f {args.out}", file=sys.stderr)
    else:
        print(header + text, end="")
    return 0


def trainjob(args: argparse.Namespace) -> dict[str, Any]:
    """The TrainJob, as a dict in the field order of its schema; raises ConfigError for bad input."""
    name = args.name or Path(args.script).stem.lower().replace("_", "-")
    if not _NAME.fullmatch(name):
        raise ConfigError(f"--name {name!r}: a Kubernetes name is lowercase letters, digits and '-', at most 63, "
                         "starting and ending with a letter or digit (give --name).")
    if args.nodes < 1 or args.devices < 1 or args.grace_period < 1:
        raise ConfigError("--nodes, --devices and --grace-period must be at least 1.")
    resources: dict[str, str] = {}
    if args.accelerator == "cuda":
        resources["nvidia.com/gpu"] = str(args.devices)
    resources.update({key: value for key, value in (("cpu", args.cpu), ("memory", args.memory)) if value})
    if args.namespace and not _NAME.fullmatch(args.namespace):
        raise ConfigError(f"--namespace {args.namespace!r}: a Kubernetes namespace is lowercase letters, digits and "
                          "'-', at most 63, starting and ending with a letter or digit.")
    command = ["lockstep", "run", args.script, *args.script_args]
    trainer: dict[str, Any] = {"image": args.image, "command": [_literal(part) for part in command],
                               "numNodes": args.nodes, "numProcPerNode": args.devices}
    if resources:
        trainer["resourcesPerNode"] = {"limits": resources, "requests": dict(resources)}
    if args.env:
        trainer["env"] = [_env(item) for item in args.env]
    pod: dict[str, Any] = {"terminationGracePeriodSeconds": args.grace_period}
    if args.volume:
        mounts = [_volume(item, index) for index, item in enumerate(args.volume)]
        pod["volumes"] = [volume for volume, _ in mounts]
        pod["containers"] = [{"name": "node", "volumeMounts": [mount for _, mount in mounts]}]
    metadata: dict[str, Any] = {"name": name, **({"namespace": args.namespace} if args.namespace else {})}
    patch = {"manager": "lockstep", "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": "node", "template": {"spec": {"template": {"spec": pod}}}}]}}}}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": metadata,
            "spec": {"runtimeRef": {"name": args.runtime}, "trainer": trainer, "runtimePatches": [patch]}}


def _env(item: str) -> dict[str, str]:
    name, sep, value = item.partition("=")
    if not sep or not _ENV_NAME.fullmatch(name):
        raise ConfigError(f"--env {item!r}: give NAME=VALUE, NAME of letters, digits, '_', '-' and '.', not "
                          "beginning with a digit.")
    return {"name": name, "value": _literal(value)}


def _literal(text: str) -> str:
    """``text`` as the container gets it: Kubernetes expands ``$(NAME)`` in a command and an env value, and
    reads ``$$`` as ``$``, so each ``$`` is doubled."""
    return text.replace("$", "$$")


def _volume(item: str, index: int) -> tuple[dict[str, Any], dict[str, str]]:
    claim, sep, path = item.partition(":")
    if not sep or not claim or not path.startswith("/"):
        raise ConfigError(f"--volume {item!r}: give CLAIM:PATH, PATH absolute (e.g. checkpoints:/ckpt).")
    name = f"lockstep-volume-{index}"
    return {"name": name, "persistentVolumeClaim": {"claimName": claim}}, {"name": name, "mountPath": path}


def to_yaml(value: Any, indent: int = 0) -> str:
    """Block-style YAML of dicts, lists, strings and numbers; strings double-quoted (JSON's quoting is
    valid YAML), so no value is ever read back as another type."""
    pad = "  " * indent
    if isinstance(value, dict):
        lines = []
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                lines.append(f"{pad}{key}:\n{to_yaml(item, indent + 1)}")
            else:
                lines.append(f"{pad}{key}: {_scalar(item)}\n")
        return "".join(lines)
    if isinstance(value, list):
        lines = []
        for item in value:
            if isinstance(item, dict) and item:
                body = to_yaml(item, indent + 1)
                lines.append(f"{pad}- {body[len(pad) + 2:]}")
            elif isinstance(item, list) and item:
                lines.append(f"{pad}-\n{to_yaml(item, indent + 1)}")
            else:
                lines.append(f"{pad}- {_scalar(item)}\n")
        return "".join(lines)
    return f"{pad}{_scalar(value)}\n"


def _scalar(value: Any) -> str:
    if isinstance(value, bool) or value is None or isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, (dict, list)):
        return "{}" if isinstance(value, dict) else "[]"
    # JSON's quoting (valid YAML), with the characters kept as they are; those that are not printable (a line
    # break of Unicode's, which YAML would fold) escaped, as YAML reads them back
    quoted = json.dumps(str(value), ensure_ascii=False)
    return "".join(c if c.isprintable() else f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}"
                   for c in quoted)
