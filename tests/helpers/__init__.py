"""Helpers shared by test modules: builders of synthetic artifacts, plans, models and reports.

Test modules import them as ``from helpers.<module> import ...`` (``tests/`` is on ``sys.path`` through the
``pythonpath`` setting in pyproject.toml); no test module imports from another test module, nor from
``conftest.py``, which holds fixtures only. ``conftest.py`` registers this
package for pytest's assertion rewriting, so a failing ``assert`` inside a helper reports its operands.
"""
