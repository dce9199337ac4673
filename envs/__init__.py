"""Environments behind one protocol (see envs/base.py)."""
