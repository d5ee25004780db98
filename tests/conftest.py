"""Shared by every test folder: this file puts ``tests/`` on ``sys.path`` (pytest's
rootdir-relative import of a conftest), so ``support`` (small helpers: free ports, SSE
reading) imports from any test module."""
