"""Run an ``rfkit`` command with the window mixers' training forwards on a chosen path: the tiled
linear-time path (``tiled``, the default) or the rank-masked reference path that builds every
``L x (sink + window + L)`` score (``rank-masked``, what training ran before issue 36). Everything
else is the command as given, so two fits of one recipe differ only in that path.

    python benchmarks/fit_path.py --path rank-masked -- fit --config recipes/smollm2_b05.yaml \
        --trainer.max_steps 6 --trainer.default_root_dir /tmp/fit_rank_masked

The phases' seconds land in the run's ``summary.json`` (``phases``), as in any fit.
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", choices=("tiled", "rank-masked"), required=True, help="the training forwards' path")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the rfkit command and its arguments, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command

    from rfkit.cli import main as rfkit_main
    from rfkit.models.window import WindowAttention

    WindowAttention.fast = args.path == "tiled"
    rfkit_main(command)


if __name__ == "__main__":
    main()
