"""Torch execution of forwards: loading a model, its forward, attention, KV storage, the runner.

Nothing here decides which requests run: :mod:`engine.core` does, and hands the
runner plain token ids, positions and block tables.
"""
