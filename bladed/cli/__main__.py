"""``python -m bladed.cli``: ``bladectl``."""

from bladed.cli.bladectl import main

main()
