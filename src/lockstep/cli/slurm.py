"""``lockstep slurm``: write a readable sbatch script beside the run, and submit it."""

from __future__ import annotations

import argparse
import ast
import shlex
import subprocess
import sys
from pathlib import Path


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = commands.add_parser(
        "slurm", allow_abbrev=False,
        help="write an sbatch script for SCRIPT and submit it (or print it with --dry-run)",
        description="Write a commented sbatch script that runs SCRIPT on --nodes nodes with one task per "
        "device, save it under --dir, and submit it with sbatch. See docs/slurm.md.",
    )
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--devices", type=int, default=1, help="per node: GPUs with cuda, tasks with cpu")
    parser.add_argument("--accelerator", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--cpus-per-task", type=int, default=None)
    parser.add_argument("--time", help="time limit, e.g. 04:00:00")
    parser.add_argument("--partition")
    parser.add_argument("--account")
    parser.add_argument("--job-name", default=None, help="default: the script's name")
    parser.add_argument("--requeue", action=argparse.BooleanOptionalAction, default=None,
                        help="on the time-limit warning, checkpoint and requeue the job (default: on when "
                        "the script checkpoints on the signal, i.e. uses the Trainer or rt.should_stop())")
    parser.add_argument("--signal-lead", type=int, default=90, help="seconds of warning before the time limit")
    parser.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                        help="extra #SBATCH line, repeatable, e.g. --sbatch-arg=--mem=64G")
    parser.add_argument("--dir", default=None, help="where the script and output go (default slurm/JOB_NAME)")
    parser.add_argument("--dry-run", action="store_true", help="print the script; do not submit")
    parser.add_argument("script", metavar="SCRIPT")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS")
    parser.set_defaults(func=slurm_command)


def _breaks_a_line(args: argparse.Namespace, name: str, folder: Path) -> str:
    """The first value written into a line of the script's header that a control character would break
    (named with its option), or ''. The script's own arguments are quoted on the srun line; the header's
    comment shows them escaped."""
    values = [("--job-name (or the script's name)", name), ("--dir", str(folder.resolve())), ("--time", args.time),
              ("--partition", args.partition), ("--account", args.account),
              *(("--sbatch-arg", extra) for extra in args.sbatch_arg)]
    return next((f"{option} {value!r}" for option, value in values
                 if value and not all(c.isprintable() for c in str(value))), "")


def sbatch_script(args: argparse.Namespace, folder: Path, python: str) -> str:
    """The job script, commented line by line: its #SBATCH directives, then the shell that runs the tasks."""
    return "\n".join(_directives(args, folder) + _task_shell(args, python))


def _directives(args: argparse.Namespace, folder: Path) -> list[str]:
    """The script's first line and its #SBATCH lines."""
    name = args.job_name or Path(args.script).stem
    lines = [
        "#!/bin/bash",
        "# Written by: lockstep slurm " + one_line(shlex.join(sys.argv[2:])),
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={args.nodes}",
        f"#SBATCH --ntasks-per-node={args.devices}   # one task per device; lockstep checks it matches devices",
    ]
    if args.accelerator == "cuda":
        lines.append(f"#SBATCH --gpus-per-node={args.devices}")
    if args.cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={args.cpus_per_task}   # DataLoader workers + the training loop")
    for option, value in (("time", args.time), ("partition", args.partition), ("account", args.account)):
        if value:
            lines.append(f"#SBATCH --{option}={value}")
    lines.append(f"#SBATCH --output={folder.resolve()}/%x-%j.out   # one file per job id (a requeue appends)")
    lines.append("#SBATCH --open-mode=append")
    if args.requeue:
        lines += ["#SBATCH --requeue   # may be put back in the queue after preemption",
                  f"#SBATCH --signal=B:USR1@{args.signal_lead}   # warn {args.signal_lead}s before the time limit"]
    else:
        lines += ["#SBATCH --no-requeue",
                  f"#SBATCH --signal=B:USR1@{args.signal_lead}   # still warn: checkpoint and exit cleanly"]
    return lines + [f"#SBATCH {extra}" for extra in args.sbatch_arg]


def one_line(text: str) -> str:
    """``text`` on one line: each control character (a line break in an argument) written as its escape."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _task_shell(args: argparse.Namespace, python: str) -> list[str]:
    """The shell after the directives: the rendezvous variables, then srun with the signals passed on."""
    command = shlex.join([python, args.script, *args.script_args])
    return [
        "",
        "set -u",
        "# Rank 0 runs on the first node of the allocation; it hosts the rendezvous store.",
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export MASTER_PORT=${MASTER_PORT:-$((10000 + SLURM_JOB_ID % 20000))}",
        f"export LOCKSTEP_ACCELERATOR={args.accelerator}",
        "# One thread pool per task sized to its CPUs (torch would otherwise use every core of the node).",
        "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}",
        f"export LOCKSTEP_REQUEUE={1 if args.requeue else 0}   # rank 0 runs scontrol requeue after USR1",
        'echo "lockstep: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, master $MASTER_ADDR:$MASTER_PORT,'
        ' restart ${SLURM_RESTART_COUNT:-0}"',
        "",
        f"cd {shlex.quote(str(Path.cwd()))}",
        "# srun starts one task per device on every node. It runs in the background so that this shell",
        "# can pass the preemption warning (USR1) and TERM on to the tasks: they checkpoint at the next",
        "# step, rank 0 requeues the job, and the requeued job resumes from that checkpoint.",
        f"srun --kill-on-bad-exit=1 {command} &",
        "tasks=$!",
        'trap \'echo "lockstep: USR1 received, passing it to the tasks"; kill -USR1 $tasks\' USR1',
        "# TERM (scancel, preemption): USR2 asks the tasks for a last checkpoint without requeue; srun",
        "# itself would kill them on TERM.",
        'trap \'echo "lockstep: TERM received, asking the tasks to checkpoint"; kill -USR2 $tasks\' TERM',
        "status=0",
        "while kill -0 $tasks 2>/dev/null; do wait $tasks; status=$?; done",
        "exit $status",
        "",
    ]


CHECKPOINTS_ON_SIGNAL = ("Trainer", "should_stop")


def choose_requeue(args: argparse.Namespace) -> str:
    """Set ``args.requeue`` when the user left it to lockstep; returns the line that says which and why.

    A requeued job only gains from the requeue when the script checkpoints at the signal and
    resumes: the Trainer does, and so does a loop that polls ``rt.should_stop()``. The script's
    code (not its comments) is searched for those names.
    """
    if args.requeue is not None:
        return f"requeue {'on' if args.requeue else 'off'}, as asked"
    try:
        tree = ast.parse(Path(args.script).read_text(errors="replace"))
    except SyntaxError:
        tree = ast.Module(body=[], type_ignores=[])
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    found = [name for name in CHECKPOINTS_ON_SIGNAL if name in names]
    args.requeue = bool(found)
    if found:
        return f"requeue on: {args.script} checkpoints on the signal (it uses {found[0]}); --no-requeue turns it off"
    return (f"requeue off: {args.script} does not checkpoint on the signal (no Trainer, no rt.should_stop()), "
            "so a requeued job would start again from scratch; --requeue turns it on")


def slurm_command(args: argparse.Namespace) -> int:
    if not Path(args.script).is_file():
        print(f"lockstep slurm: {args.script}: no such script.", file=sys.stderr)
        return 2
    print(f"lockstep slurm: {choose_requeue(args)}", file=sys.stderr)
    if args.nodes < 1 or args.devices < 1:
        print("lockstep slurm: --nodes and --devices must be at least 1.", file=sys.stderr)
        return 2
    name = args.job_name or Path(args.script).stem
    folder = Path(args.dir or Path("slurm") / name)
    broken = _breaks_a_line(args, name, folder)
    if broken:
        print(f"lockstep slurm: {broken} holds a line break or another control character: it would end its "
              "#SBATCH line, and the rest would run as a command of the job's shell. Remove it.", file=sys.stderr)
        return 2
    text = sbatch_script(args, folder, sys.executable)
    if args.dry_run:
        print(text)
        return 0
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.sbatch"
    path.write_text(text)
    done = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"lockstep slurm: sbatch failed: {done.stderr.strip()}", file=sys.stderr)
        return 1
    job = done.stdout.strip().split(";")[0]
    print(f"submitted job {job}\nscript: {path}\noutput: {folder.resolve()}/{name}-{job}.out")
    return 0
