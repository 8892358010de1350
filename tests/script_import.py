"""A repository script that is no package's module (benchmarks/*.py, scripts/*.py), imported by
its path so that a test can call its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_script(path: Path, name: str) -> ModuleType:
    """The file at `path` run as module `name` (registered in sys.modules: dataclasses look
    their module up there)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
