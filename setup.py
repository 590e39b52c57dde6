"""A thin setup.py: every piece of metadata is in pyproject.toml.

setuptools reads pyproject.toml (PEP 621); this file exists for tools and
habits that look for it (``python setup.py --version``). Install with
``pip install .`` or ``pip install -e .``.
"""

from setuptools import setup

setup()
