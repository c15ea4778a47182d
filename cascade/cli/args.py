"""What every subcommand shares: argument types, the parser class that reports a bad value, the
default topology, the generation options (:func:`add_generation_args`) and :func:`guarded`, which
reports cascade's own errors as one line. A leaf: the subcommand modules (here, in
:mod:`cascade.tools`, :mod:`cascade.train` and :mod:`cascade.serve`) import it, it imports none
of them.

A bad value is refused while the command line is parsed, before any model loads: one line on
stderr, ``cascade <command>: error: argument --repeats: must be an integer >= 1 (got '0')``,
and exit status 2 (:class:`Parser`). The checks are the API's (:mod:`cascade.validation`), so
the command line and ``Cascade.generate`` accept the same values (ints, finite floats, the
same ranges and device names).
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import Callable, NoReturn

DEFAULT_TOPOLOGY = "topologies/4level.yaml"  # the bundled family: always here, fast, what the tests use
REAL_TOPOLOGY = "topologies/smollm2.yaml"  # SmolLM2-135M-Instruct, its feature head and drafter, once pulled
REAL_MODEL = "smollm2-135m-instruct"
MAIN_TOPOLOGY_HELP = (f"topology file (default: {REAL_TOPOLOGY} when its model is in the cache - "
                      f"cascade pull {REAL_MODEL} - else {DEFAULT_TOPOLOGY})")


def bundled_topologies() -> Path | None:
    """Where the bundled topologies live: ``topologies/`` in the working directory (a command run
    in the checkout), else beside the installed package (an editable install's checkout, run
    from anywhere); None where neither holds them (an installed wheel ships none)."""
    name = Path(DEFAULT_TOPOLOGY).name
    for folder in (Path(DEFAULT_TOPOLOGY).parent, Path(__file__).resolve().parents[2] / "topologies"):
        if (folder / name).is_file():
            return folder
    return None


def main_topology(say: Callable[[str], None] | None = None) -> str:
    """The topology the main commands (``demo``, ``serve``, ``run``) use when none is named: the
    real model's once ``cascade pull`` has put it in the cache (and the repository's drafters are
    beside the topology), else the bundled family's, saying how to get the real one (and, when
    the model is pulled already, what else is missing). A TopologyError naming where they were
    looked for when the bundled topologies are not there at all."""
    from cascade.errors import TopologyError
    from cascade.pull import MANIFEST, cache_dir

    folder = bundled_topologies()
    if folder is None:
        raise TopologyError(
            f"{DEFAULT_TOPOLOGY}: topology file not found, neither in {Path.cwd()} nor in "
            f"{Path(__file__).resolve().parents[2]} (the bundled topologies live in the cascade checkout's "
            "topologies/); run from the checkout or name a topology file with --topology")
    real, default = folder / Path(REAL_TOPOLOGY).name, str(folder / Path(DEFAULT_TOPOLOGY).name)
    drafter = folder / "../examples/models/smollm2/draft-s/config.json"
    pulled = (cache_dir(REAL_MODEL) / MANIFEST).is_file()
    if real.is_file() and pulled and drafter.is_file():
        return str(real)
    if say is not None:
        if pulled:  # the model is there: say what is not, not to pull it again
            missing = real if not real.is_file() else drafter.resolve().parent
            say(f"using the bundled family ({default}): tiny models whose text is noise. The real model is "
                f"pulled, but {missing} is missing")
        else:
            say(f"using the bundled family ({default}): tiny models whose text is noise. For the real "
                f"model, SmolLM2-135M-Instruct with its drafters: cascade pull {REAL_MODEL}")
    return default


def topology_file(path: str | None, say: Callable[[str], None] | None = None) -> str:
    """The topology a command runs: ``path`` (``--topology``), checked to exist, or
    :func:`main_topology` when none is named. A missing file is a TopologyError that names it,
    where a relative one was looked for, and where the bundled topologies live."""
    from cascade.errors import TopologyError

    if path is None:
        return main_topology(say)
    if not Path(path).exists():
        where = f" (relative to {Path.cwd()})" if not Path(path).is_absolute() else ""
        folder = bundled_topologies()
        bundled = (f"the bundled topologies are in {folder.resolve()}" if folder is not None else
                   "the bundled topologies live in the cascade checkout's topologies/, not found here")
        raise TopologyError(f"{path}: topology file not found{where}; {bundled}")
    return path


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block) with exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _integer(minimum: int, below: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer (got {text!r})") from None
        if value < minimum or (below is not None and value >= below):
            bound = f">= {minimum}" if below is None else f"in [{minimum}, {below})"
            raise argparse.ArgumentTypeError(f"must be an integer {bound} (got {text!r})")
        return value
    parse.__name__ = f"integer >= {minimum}"
    return parse


positive_int = _integer(1)
nonnegative_int = _integer(0)
seed = _integer(0, 2**63)


def _number(check: Callable[[float], bool], what: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
            if not math.isfinite(value):
                raise ValueError(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a finite number (got {text!r})") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"must be {what} (got {text!r})")
        return value
    parse.__name__ = what
    return parse


temperature = _number(lambda v: v >= 0, "a number >= 0 (0 = greedy)")
top_p = _number(lambda v: 0 < v <= 1, "a number in (0, 1]")


def positive_int_list(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]``; every item an integer >= 1, at least one."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 1 (got {text!r})")
    try:
        return [positive_int(x) for x in items]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 1 (got {text!r})") from None


def device(text: str) -> str:
    from cascade.validation import DEVICE_PATTERN  # imported late: `cascade --help` stays cheap

    if not re.fullmatch(DEVICE_PATTERN, text):
        raise argparse.ArgumentTypeError(f"must be auto, cpu or cuda:N (got {text!r})")
    return text


def nonempty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must be a non-empty string")
    return text


def policy_spec(text: str) -> str:
    """``NAME[:key=value,...]``, checked by building the policy (its graph is checked later,
    when it is bound to the topology); returned as given."""
    from policies import REGISTRY, PolicyError, from_spec

    try:
        from_spec(text)
    except PolicyError as exc:
        hint = ""
        if str(exc).startswith("name:"):  # e.g. 'fixed:3', read as a 'module:Class' path: say what a spec is
            hint = ("; a spec is NAME[:key=value,...], NAME a registered policy "
                    f"({', '.join(sorted(REGISTRY))}) or a 'module:Class' path, "
                    "e.g. fixed:lookahead=3 or fixed:lookahead={tiny: 3}")
        raise argparse.ArgumentTypeError(f"{exc}{hint} (got {text!r})") from None
    return text


def add_sampling_args(p: argparse.ArgumentParser, default_temperature: float = 0.0, default_top_p: float = 1.0,
                      default_top_k: int = 0, default_seed: int = 0, what: str = "") -> None:
    """``--temperature``, ``--top-p``, ``--top-k`` and ``--seed`` for a measuring command
    (bench, demo, ab), with that command's defaults; every value checked as above (finite, in
    range). ``what`` says in the help which runs they set."""
    where = f" of {what}" if what else ""
    p.add_argument("--temperature", type=temperature, default=default_temperature,
                   help=f"sampling temperature{where}; 0 = greedy (default {default_temperature})")
    p.add_argument("--top-p", type=top_p, default=default_top_p,
                   help=f"nucleus sampling: keep the smallest set of this mass, in (0, 1]; 1 = off "
                        f"(default {default_top_p})")
    p.add_argument("--top-k", type=nonnegative_int, default=default_top_k,
                   help=f"keep the k most likely tokens; 0 = off (default {default_top_k})")
    p.add_argument("--seed", type=seed, default=default_seed,
                   help=f"seed of the sampled runs, an integer in [0, 2^63) (default {default_seed})")


def add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topology", "-t", default=None, help=MAIN_TOPOLOGY_HELP)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=temperature, default=None, help="0 = greedy (default: the topology's)")
    p.add_argument("--top-k", type=nonnegative_int, default=None, help="0 = off")
    p.add_argument("--top-p", type=top_p, default=None, help="in (0, 1]; 1 = off")
    p.add_argument("--seed", type=seed, default=None)
    p.add_argument("--coupling", choices=("residual", "gumbel"), default=None,
                   help="gumbel: a seed gives the same tokens whatever the policy; residual: the most "
                        "acceptance (default: the topology's; unset there, gumbel with --seed, else residual)")
    p.add_argument("--stop", action="append", type=nonempty, default=None, help="stop string (repeatable)")
    p.add_argument("--policy", type=policy_spec, default=None,
                   help="NAME[:key=value,...], e.g. fixed:lookahead=4")
    p.add_argument("--device", type=device, default=None,
                   help="override every level's device (cpu, cuda:0, auto)")


def guarded(func):
    """Report cascade's own errors as one line on stderr with exit status 1."""
    def wrapper(args) -> int:
        from cascade.errors import CascadeError
        from policies import PolicyError

        try:
            return func(args)
        except (CascadeError, PolicyError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    wrapper.__name__ = func.__name__
    wrapper.__doc__ = func.__doc__
    return wrapper
