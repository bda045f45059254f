"""The repository's structural rules (docs/design.md), checked on the sources.

- Dependency rule: ffi -> dispatch -> {sm80, sm90} -> smxx -> common;
  ffi -> cpu -> common. No arch folder includes another.
- No code in csrc/ or ffi/ reads the environment: kernel choice travels in
  the plan and the FFI attributes.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = [p for d in ("csrc", "ffi") for p in (ROOT / d).rglob("*")
           if p.suffix in (".h", ".cc", ".cu", ".cuh")] if (ROOT / "csrc").is_dir() else []

# What each folder may include of ours.
ALLOWED = {
    "common": {"common"},
    "cpu": {"cpu", "common"},
    "smxx": {"smxx", "common"},
    "sm80": {"sm80", "smxx", "common"},
    "sm90": {"sm90", "smxx", "common"},
    "dispatch": {"dispatch", "sm80", "sm90", "smxx", "common"},
    "ffi": {"ffi", "dispatch", "cpu", "common"},
}


def _folder(path: pathlib.Path) -> str:
  rel = path.relative_to(ROOT).parts
  return rel[0] if rel[0] == "ffi" else rel[1]


def _includes(path: pathlib.Path):
  for line in path.read_text().splitlines():
    m = re.match(r'\s*#include\s+"([^"]+)"', line)
    if m:
      yield m.group(1)


def _target_folder(include: str, source: pathlib.Path) -> str | None:
  parts = include.split("/")
  if parts[0] == "csrc":
    return parts[1]
  if parts[0] == "ffi":
    return "ffi"
  if parts[0] in ("xla", "nanobind", "cute", "cutlass", "cub", "cuda"):
    return None
  # a path relative to the including file's folder (e.g. "../common/x.h")
  resolved = (source.parent / include).resolve()
  try:
    return _folder(resolved)
  except ValueError:
    return None


@pytest.mark.skipif(not SOURCES, reason="needs the source tree")
def test_dependency_rule():
  bad = []
  for src in SOURCES:
    folder = _folder(src)
    for inc in _includes(src):
      target = _target_folder(inc, src)
      if target is not None and target not in ALLOWED[folder]:
        bad.append(f"{src.relative_to(ROOT)} includes {inc} ({folder} -> {target})")
  assert not bad, "\n".join(bad)


@pytest.mark.skipif(not SOURCES, reason="needs the source tree")
def test_no_environment_reads_in_native_code():
  bad = [f"{src.relative_to(ROOT)}:{i + 1}" for src in SOURCES
         for i, line in enumerate(src.read_text().splitlines()) if re.search(r"\b(getenv|secure_getenv)\b", line)]
  assert not bad, "environment reads in: " + ", ".join(bad)
