"""Fixtures of the table tests."""

import pytest

from tests.table._helpers import ELEMENT


@pytest.fixture(params=ELEMENT)
def fmt(request):
    return request.param
