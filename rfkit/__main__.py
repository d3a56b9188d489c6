"""``python -m rfkit``: the ``rfkit`` command."""

from rfkit.cli import main

main()
