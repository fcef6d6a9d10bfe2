"""``lockstep`` command: argv -> actions. It never imports the user's training code."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import asdict

import lockstep
from lockstep.cli.checkpoint import add_parser as add_checkpoint_parser
from lockstep.cli.doctor import add_parser as add_doctor_parser
from lockstep.cli.k8s import add_parser as add_k8s_parser
from lockstep.cli.run import add_parser as add_run_parser
from lockstep.cli.slurm import add_parser as add_slurm_parser
from lockstep.cli.verify import add_parser as add_verify_parser
from lockstep.env import DistEnv, EnvError


def _env(args: argparse.Namespace) -> int:
    """Print the launcher environment this process sees, as the runtime will read it."""
    try:
        env = DistEnv.from_environ(argv=[])
    except EnvError as error:
        print(f"lockstep: inconsistent launcher environment: {error}", file=sys.stderr)
        return 2
    for name, value in asdict(env).items():
        print(f"{name:>17}: {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lockstep", description="Run PyTorch training on one device, many GPUs or many nodes."
    )
    parser.add_argument("--version", action="version", version=f"lockstep {lockstep.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    env = commands.add_parser("env", help="print the launcher environment (ranks, master) as detected")
    env.set_defaults(func=_env)
    add_run_parser(commands)
    add_doctor_parser(commands)
    add_slurm_parser(commands)
    add_k8s_parser(commands)
    add_checkpoint_parser(commands)
    add_verify_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
