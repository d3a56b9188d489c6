"""``python -m rfkit.cli``: the ``rfkit`` command."""

from rfkit.cli import main

main()
