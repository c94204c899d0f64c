"""Import-time stand-ins for heavy packages that a client module imports but whose request
path never calls (e.g. `torch`, imported at the top of `sglang/__init__.py` through
`sglang.srt.utils`). Every stubbed name is printed so a run says exactly what was faked; a
call that reaches a stub would return a MagicMock and fail the check that uses it."""

import importlib.abc
import importlib.machinery
import sys
from unittest import mock


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = set(roots)

    def find_spec(self, name, path, target=None):
        if any(name == r or name.startswith(r + ".") for r in self.roots):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = mock.MagicMock(name=spec.name)
        m.__path__ = []
        m.__spec__ = spec
        m.__version__ = "0.0.0+stub"
        return m

    def exec_module(self, module):
        pass


def install(roots):
    """Makes `import ROOT` (and its submodules) succeed with MagicMock modules; a ROOT may
    be a dotted module (`sglang.srt.server_args`) to stub only that part of a package."""
    for r in roots:
        print(f"stub {r} (import only)")
    sys.meta_path.insert(0, _StubFinder(roots))
