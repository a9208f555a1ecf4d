"""Entry point of the ``lightning-ft`` console script."""

from __future__ import annotations

import argparse
import sys
from importlib import metadata

from lightning_ft_cli import launch, lighthouse, report


def installed_version() -> str:
    """The installed distribution's version (``pyproject.toml``), or a note that the package is not installed."""
    try:
        return metadata.version("lightning-ft")
    except metadata.PackageNotFoundError:
        return "(not installed: run from a source tree)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-ft", description="Fault-tolerant PyTorch Lightning on torchft.")
    parser.add_argument("--version", action="version", version=f"lightning-ft {installed_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    lighthouse.add_arguments(commands.add_parser("lighthouse", help="run a torchft lighthouse in the foreground"))
    launch.add_arguments(
        commands.add_parser(
            "launch",
            help="run N replica groups on this machine, each a torchrun job with restarts",
            usage="lightning-ft launch --replica-groups N [options] -- CMD ...",
        )
    )
    report.add_arguments(
        commands.add_parser(
            "report",
            help="draw a run's fault-tolerance timeline (participants, heals, failures, loss) from its event logs",
        )
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "lighthouse":
        return lighthouse.run(args)
    if args.command == "report":
        return report.run(args)
    return launch.run(args)


if __name__ == "__main__":
    sys.exit(main())
