import doctest

import pytest

import paged_ref as pr


def test_every_public_name_resolves():
    for name in pr.__all__:
        assert getattr(pr, name) is not None, name


def test_unknown_attribute_raises():
    with pytest.raises(AttributeError, match="not_a_name"):
        _ = pr.not_a_name


def test_package_docstring_example():
    result = doctest.testmod(pr)
    assert result.attempted > 0 and result.failed == 0


def test_lazy_modules_the_readme_names_resolve():
    assert pr.lab.stats.wilson(0, 0) == (0.0, 1.0)
    assert pr.hf.register_backend is not None and "sdpa" in pr.hf.BACKENDS
