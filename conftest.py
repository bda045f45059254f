"""Makes `python -m pytest -q tests` from the repo root test the *installed* mla_jax.

`python -m` puts the current directory first on sys.path, so after a regular
(non-editable) `pip install .` the bare source folder ./mla_jax, which has no
compiled extension, would shadow the installed package. When the source
folder holds no extension and an installed copy exists elsewhere, a finder
placed first on sys.meta_path resolves `mla_jax` to that copy (its
submodules follow through the package's __path__). Editable installs and
in-place builds are left alone. Nothing is imported here (JAX must not be
initialised before tests/conftest.py configures it).
"""

import importlib.abc
import importlib.machinery
import os
import sys

_ROOT = os.path.dirname(os.path.abspath(__file__))
_SRC = os.path.join(_ROOT, "mla_jax")


def _installed_paths():
  return [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]


def _is_source(spec) -> bool:
  return spec is None or spec.origin is None or os.path.dirname(os.path.abspath(spec.origin)) == _SRC


class _InstalledMlaJax(importlib.abc.MetaPathFinder):
  def find_spec(self, fullname, path=None, target=None):
    if fullname != "mla_jax":
      return None
    return importlib.machinery.PathFinder.find_spec(fullname, _installed_paths())


def _source_has_extension() -> bool:
  return any(f.startswith("_mla_jax_ext") for f in os.listdir(_SRC)) if os.path.isdir(_SRC) else False


if "mla_jax" not in sys.modules and not _source_has_extension():
  _spec = importlib.machinery.PathFinder.find_spec("mla_jax", _installed_paths())
  if not _is_source(_spec):  # a real installed copy (an editable one maps back to _SRC)
    sys.meta_path.insert(0, _InstalledMlaJax())
