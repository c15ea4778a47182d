"""The ``cascade`` command line.

Each subcommand lives in its own module and exposes ``add_parser(subparsers)``, which
registers the subcommand and sets ``func`` (called with the parsed namespace, returning an
exit code); heavy imports (transformers, ray) happen inside the ``func`` of the command that
needs them.

The modules are listed by name and imported when the parser is built, not imported here: they
import :mod:`cascade.cli.args` (what every subcommand shares), and Python runs this file before
any module of the package, so importing them here would be a circle (``cascade.tools.bench`` ->
``cascade.cli`` -> ``cascade.tools.bench``). The dependency runs one way: subcommand ->
``cascade.cli.args``. Every listed module is imported on each run, ``--help`` included.
"""
from __future__ import annotations

import argparse
import importlib
import sys

_COMMAND_MODULES = (
    "cascade.cli.commands",
    "cascade.tools.demo",
    "cascade.tools.ab",
    "cascade.tools.tune",
    "cascade.tools.bench",
    "cascade.tools.bench_serve",
    "cascade.train.distill",
    "cascade.train.record",
    "cascade.train.pipeline",
    "cascade.tools.pull",
    "cascade.tools.cost_curve",
    "cascade.train.family_eval",
    "cascade.tools.run",
    "cascade.serve.cli",
)


def build_parser() -> argparse.ArgumentParser:
    from cascade.cli.args import Parser

    parser = Parser(
        prog="cascade",
        description="Exact hierarchical speculative decoding over a topology of models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name not in (name, name.rpartition(".")[0]):
                raise
            continue  # an optional part not installed (or not written yet)
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a bad value (one line on stderr already)
        return exc.code if isinstance(exc.code, int) else 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
