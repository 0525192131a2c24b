"""Worked examples of code a run names by import path (docs/extending.md): a tool that is not Python and a reward."""
