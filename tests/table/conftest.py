"""Fixtures of the table tests."""

import pytest

from ple.table import FORMATS


@pytest.fixture(params=FORMATS)
def fmt(request):
    return request.param
