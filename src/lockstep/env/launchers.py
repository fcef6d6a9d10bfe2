"""What each way of starting a job can do, declared once: the runtime asks these capabilities,
never a launcher's name.

A route is the launcher named by ``DistEnv.launcher``. A new route (Ray, Kubernetes, a
fault-tolerant replica group) declares its row here, and every behaviour that depends on what
started the process follows from it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    """What the route that started this process does for it."""

    #: Nothing started it (``python train.py``): asking for N devices makes the script their launcher,
    #: and ``devices="auto"`` means every visible GPU rather than one per started process.
    started_alone: bool = False
    #: A torch elastic agent watches the workers: a worker ends with its agent, and its excepthook
    #: hands the agent the failure report (the agent restarts the group if asked, ``--max-restarts``).
    agent_watches: bool = False
    #: The scheduler announces preemption with a signal and a grace period (SLURM: USR1 before the time
    #: limit, TERM at preemption): ``rt.should_stop`` turns it into a stop every rank agrees on.
    preempts_with_grace: bool = False
    #: The job can put itself back in the scheduler's queue (SLURM's ``scontrol requeue``, when the job
    #: script asked for it): ``rt.requeue`` after a preemption stop.
    requeues: bool = False
    #: The engine gives notice before it reclaims a node of the job (Ray Train: a drain with a deadline) and
    #: restarts the job from its newest checkpoint once the node is gone: ``rt.should_checkpoint`` is True
    #: once per notice, and the Trainer checkpoints and trains on.
    warns_of_reclaim: bool = False
    #: The engine keeps a record of the job's checkpoints (Ray Train: ``ray.train.report``): each committed
    #: checkpoint is reported to it, and a resume also considers the newest one it holds.
    records_checkpoints: bool = False
    #: The setting that says how many processes a node runs, to name in a mismatch ('' when none).
    processes_per_node_setting: str = ""
    #: The batch scheduler that allotted the tasks (its job script holds the setting above); '' for none.
    scheduler: str = ""


ROUTES: dict[str, Capabilities] = {
    "none": Capabilities(started_alone=True),
    "torchrun": Capabilities(agent_watches=True,
                             processes_per_node_setting="--nproc-per-node (lockstep run: --devices)"),
    # torch's legacy launcher is its elastic agent too (since torch 1.9): its workers end with it
    "torch.distributed.launch": Capabilities(agent_watches=True, processes_per_node_setting="--nproc-per-node"),
    "lockstep.launch": Capabilities(processes_per_node_setting="lockstep.launch(fn, nprocs=...)"),
    "slurm": Capabilities(preempts_with_grace=True, requeues=True,
                          processes_per_node_setting="#SBATCH --ntasks-per-node", scheduler="SLURM"),
    # torch elastic (lockstep run, torchrun) inside a SLURM job: the scheduler's USR1 (the time limit) and TERM
    # (preemption) reach the workers (lockstep run's agent passes USR1 and USR2 on; torch's passes TERM on)
    "torchrun-slurm": Capabilities(agent_watches=True, preempts_with_grace=True, requeues=True,
                                   processes_per_node_setting="--nproc-per-node (lockstep run: --devices)",
                                   scheduler="SLURM"),
    # torch elastic (torchrun, lockstep run) in a Kubernetes pod: an eviction or a node drain sends TERM
    # with the pod's grace period (terminationGracePeriodSeconds); the Job or JobSet starts the pods again.
    "kubernetes": Capabilities(agent_watches=True, preempts_with_grace=True,
                               processes_per_node_setting="the TrainJob's trainer.numProcPerNode (PET_NPROC_PER_NODE; "
                               "lockstep run: --devices)", scheduler="Kubernetes"),
    # a Ray Train worker (TorchTrainer, or lockstep run --engine ray): Ray restarts the worker group after a
    # failure (FailureConfig) and resizes an elastic one; its checkpoints are reported to Ray Train
    "ray": Capabilities(records_checkpoints=True, warns_of_reclaim=True,
                        processes_per_node_setting="ScalingConfig(num_workers=...) and resources_per_worker "
                        "(lockstep run --engine ray: --devices)"),
    "mpi": Capabilities(processes_per_node_setting="mpirun's processes per node (--npernode)"),
    "env": Capabilities(processes_per_node_setting="LOCAL_WORLD_SIZE"),
}


def capabilities_of(launcher: str) -> Capabilities:
    """The capabilities of the route named ``launcher`` (an unknown name: none of them)."""
    return ROUTES.get(launcher, Capabilities())
