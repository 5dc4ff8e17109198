"""Every ``Example:`` in the package's docstrings runs and prints what it shows."""

import doctest
import importlib
import pkgutil

import pytest

import paged_ref

MODULES = sorted(
    m.name for m in pkgutil.walk_packages(paged_ref.__path__, "paged_ref.") if not m.name.endswith("__main__")
)


@pytest.mark.parametrize("name", ["paged_ref", *MODULES])
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_the_examples_are_many():
    # a walk that found nothing would pass every test above
    assert len(MODULES) > 50
