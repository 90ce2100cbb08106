"""docs/api.md is what docs/make_api.py writes from the current docstrings and --help."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests import ROOT

MAKE_API = ROOT / "docs" / "make_api.py"


def test_the_api_page_is_current() -> None:
    spec = importlib.util.spec_from_file_location("make_api", MAKE_API)
    assert spec is not None and spec.loader is not None
    make_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_api)
    if sys.version_info[:2] != make_api.PYTHON:
        pytest.skip("the page's --help text is argparse's on Python 3.11")
    assert make_api.PAGE.read_text() == make_api.render(), "run python docs/make_api.py"
