"""The ``remat`` command line: its parser and ``main`` (main.py), what each command does
(commands.py), budget sweeps (sweep.py) and plans written as Python files (standalone.py).  Nothing
else in remat imports this package; it uses the public API and the planner like any caller."""
from .main import build_parser, main

__all__ = ["build_parser", "main"]
