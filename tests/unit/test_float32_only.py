"""The ``float32_only`` marker: skipped, with its reason, where matmuls run at TF32."""

from __future__ import annotations

from pathlib import Path

import pytest

from tqbatch.testing import backend

ROOT_CONFTEST = Path(__file__).resolve().parents[2] / "conftest.py"


def _root_conftest(config):
    return next(
        plugin
        for plugin in config.pluginmanager.get_plugins()
        if getattr(plugin, "__file__", None) and Path(plugin.__file__).resolve() == ROOT_CONFTEST
    )


class _Item:
    """What the hook reads of a test item: its closest marker."""

    def __init__(self, marker):
        self.marker = marker

    def get_closest_marker(self, name):
        return self.marker if name == "float32_only" else None


def test_a_float32_only_test_is_skipped_at_tf32_with_its_reason(pytestconfig, monkeypatch):
    setup = _root_conftest(pytestconfig).pytest_runtest_setup
    marker = pytest.mark.float32_only(reason="one flipped code").mark
    monkeypatch.setattr(backend, "matmul_precision", lambda: "tf32")
    with pytest.raises(pytest.skip.Exception, match=r"float32 only .*tf32.*: one flipped code"):
        setup(_Item(marker))
    setup(_Item(None))  # an unmarked test runs at any precision
    monkeypatch.setattr(backend, "matmul_precision", lambda: "float32")
    setup(_Item(marker))  # and a marked one at float32
