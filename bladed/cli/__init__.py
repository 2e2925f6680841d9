"""Command-line tools: ``bladectl`` (:mod:`bladed.cli.bladectl`)."""
