"""The `erpo` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    from erpo_jax.demo import run_demo
    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="erpo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the embedded CPU demo (no download)")
    demo.add_argument("--out", default="runs/demo", help="output directory")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
