"""The ``stratagem`` command: ``run`` (launch a script on N replicas), ``demo`` (the main job)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from typing import Any

from stratagem._version import __version__
from stratagem.core import stop_guard

#: what ``stratagem --help`` prints above the commands (plain text)
DESCRIPTION = """\
stratagem: tf.distribute's strategies, tf.data's pipelines and GPipe for PyTorch.

commands:
  stratagem run -n 2 train.py    run a script on 2 replicas (see: stratagem run --help)
  stratagem demo                 the main job: a convnet on scikit-learn's digits, 2 replicas
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="stratagem", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"stratagem {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a convnet on scikit-learn's digits on 2 replicas")
    demo.add_argument("--replicas", type=int, default=2, help="number of replicas (processes)")
    demo.add_argument("--epochs", type=int, default=12)
    demo.add_argument("--batch-size", type=int, default=64, help="global batch size")
    demo.add_argument("--plot", default="demo_history.png",
                      help="where to write the training plot ('' for none: then matplotlib is not needed)")
    demo.add_argument("--custom-loop", action="store_true", help="the hand-written loop instead of fit")
    demo.add_argument("--devices", choices=["cpu", "cuda"], default=None,
                      help="where the replicas run (default: one per GPU if there are enough, else CPU)")

    run_cmd: Any = importlib.import_module("stratagem.cli.run")  # an error here is shown, not hidden
    run_cmd.add_parser(sub)

    args = parser.parse_args(argv)
    if args.command == "demo":
        for flag, value in (("--replicas", args.replicas), ("--epochs", args.epochs), ("--batch-size", args.batch_size)):
            if value < 1:  # said at once, not after torch and scikit-learn are imported
                demo.error(f"{flag} must be >= 1, got {value}")
        missing = missing_demo_packages(plot=bool(args.plot))
        if missing:  # before torch is imported and before any replica starts: said once
            print(demo_missing_message(missing, plot=bool(args.plot)), file=sys.stderr, flush=True)
            return 2
        from stratagem.cli.demo import run_demo

        stop_guard.release()  # the demo's replicas report and end as any program's do

        return run_demo(args.replicas, args.epochs, args.batch_size, args.plot, args.custom_loop, args.devices)
    if args.command == "run":
        return int(run_cmd.main(args))
    parser.error(f"unknown command {args.command}")
    return 2


#: what the demo imports beyond stratagem's own dependencies: (module, the package that provides it)
DEMO_PACKAGES = (("sklearn", "scikit-learn"), ("matplotlib", "matplotlib"))


def missing_demo_packages(plot: bool = True) -> list[str]:
    """The packages of the ``[demo]`` extra this environment lacks (matplotlib only if ``plot``)."""
    needed = [(mod, pkg) for mod, pkg in DEMO_PACKAGES if plot or mod != "matplotlib"]
    return [pkg for mod, pkg in needed if importlib.util.find_spec(mod) is None]


def demo_missing_message(missing: Sequence[str], plot: bool = True) -> str:
    """The one line ``stratagem demo`` prints when its extra is not installed."""
    names = " and ".join(missing)
    line = (f"stratagem demo needs {names}, which {'is' if len(missing) == 1 else 'are'} not installed "
            f"in {sys.executable}: pip install 'stratagem[demo]'")
    if plot and list(missing) == ["matplotlib"]:
        line += " (or run it with --plot '' to skip the plot)"
    return line


if __name__ == "__main__":
    sys.exit(main())
