"""Runnable studies and lab equipment, kept out of the `moaspec` wheel.

Each module reproduces one table of docs/ (its docstring names the command, `python -m experiments.<name>`
from the repository root); the tests import the harnesses here (the shaping proxy, the fault and soak runs).
"""
