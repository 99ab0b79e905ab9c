"""What the tests share: factories, fakes and helpers (no tests here; test modules and conftest
files import from this package, never from each other)."""

import pkgutil

import pytest

# The helpers' asserts explain themselves on failure, as the tests' own do.
pytest.register_assert_rewrite(*(f"{__name__}.{m.name}" for m in pkgutil.iter_modules(__path__)))
