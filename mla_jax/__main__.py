"""Command line: `python -m mla_jax info` and `python -m mla_jax demo`."""

from __future__ import annotations

import argparse
import importlib.machinery
import os
import sys

_SRC = os.path.dirname(os.path.abspath(__file__))


def _installed_elsewhere():
  """Spec of an installed mla_jax other than this folder (None if there is none)."""
  paths = [p for p in sys.path if os.path.abspath(p or os.curdir) != os.path.dirname(_SRC)]
  spec = importlib.machinery.PathFinder.find_spec("mla_jax", paths)
  if spec is None or spec.origin is None or os.path.dirname(os.path.abspath(spec.origin)) == _SRC:
    return None
  return spec


def _use_installed_copy(argv):
  """Re-runs from the installed package when `python -m mla_jax` picked the source tree.

  `python -m` puts the current directory first on sys.path, so in the repo
  root after a regular `pip install .` it imports the bare source folder,
  which holds no compiled extension. Python's -P (3.11 on, which jax 0.10
  requires) leaves the current directory out.
  """
  from mla_jax import _ffi
  if _ffi.has_extension() or os.environ.get("_MLA_JAX_REEXEC") or _installed_elsewhere() is None:
    return
  env = dict(os.environ, _MLA_JAX_REEXEC="1")
  os.execve(sys.executable, [sys.executable, "-P", "-m", "mla_jax", *argv], env)


def _source_tree_hint() -> str:
  if not os.path.exists(os.path.join(os.path.dirname(_SRC), "pyproject.toml")):
    return ""
  return (f"  mla_jax was imported from its source tree ({_SRC}), which has no compiled "
          "extension: build it with `pip install -e .`, or run from another directory "
          "after `pip install .`")


def info(out=sys.stdout) -> int:
  import jax
  import jaxlib

  import mla_jax
  from mla_jax import _ffi

  p = lambda *a: print(*a, file=out)
  p(f"mla_jax {mla_jax.__version__} ({mla_jax.__file__})")
  p(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}")
  if _ffi.has_extension():
    backends = ["cpu"] + (["cuda"] if _ffi.has_cuda_kernels() else [])
    p(f"compiled backends: {', '.join(backends)} (plus 'xla', the pure-JAX reference)")
  else:
    p(f"compiled backends: none -- the extension failed to import: {_ffi._IMPORT_ERROR}")
    p("  only backend 'xla' (pure JAX) is usable")
    if _source_tree_hint():
      p(_source_tree_hint())
  p(f"CUDA archs: {_ffi.cuda_archs() or '-- (built without CUDA kernels)'}")
  p(f"JAX default backend: {jax.default_backend()}")
  p("JAX devices:")
  for platform in ("cuda", "rocm", "tpu", "cpu"):
    try:
      devices = jax.devices(platform)
    except RuntimeError:  # that platform is not present
      continue
    for d in devices:
      p(f"  {platform}:{d.id}  {d.device_kind}")
  return 0


def _serve(args) -> int:
  if args.requests < 1 or args.slots < 1:
    print("--requests and --slots must be >= 1", file=sys.stderr)
    return 2
  from mla_jax import serving
  if not 0 <= args.draft_tokens <= 7:
    print("--draft-tokens must be in 0..7", file=sys.stderr)
    return 2
  r = serving.demo(args.requests, backend=args.backend, max_slots=args.slots, draft_tokens=args.draft_tokens)
  print(f"{r['requests']} requests, {r['generated_tokens']} tokens generated in {r['wall_s']:.1f} s "
        f"({r['tokens_per_s']:.0f} tokens/s, compilation included)")
  print(f"{r['decode_steps']} decode steps, median {r['step_ms']:.1f} ms per step (host loop included); "
        f"prefill {r['prefill_s']:.1f} s")
  print(f"one step with all {args.slots} slots at {r['probe_seq_len']} tokens: {r['probe_step_ms']:.1f} ms, "
        f"of which attention (paged_decode alone, every layer) {r['probe_attention_ms']:.1f} ms "
        f"({100 * r['probe_attention_ms'] / r['probe_step_ms']:.0f} %)")
  if args.draft_tokens:
    print(f"speculative steps (n-gram drafts, up to {args.draft_tokens} a request, ragged verification): "
          f"{r['accepted']} of {r['drafted']} drafted tokens accepted")
  print(f"pages free after the run: {r['free_pages_after']} of {r['pages']}")
  return 0 if r["free_pages_after"] == r["pages"] else 1


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m mla_jax",
                                   description="Paged MLA decode for JAX.")
  sub = parser.add_subparsers(dest="command", required=True)
  sub.add_parser("info", help="version, compiled backends, CUDA archs, JAX devices")
  demo = sub.add_parser("demo", help="one decode step at DeepSeek-V3 shapes: check and time it")
  demo.add_argument("--backend", default="auto", choices=("auto", "cuda", "cpu", "xla"),
                    help="DecodePlan.backend (default auto: cuda on a GPU, cpu otherwise)")
  demo.add_argument("--scale", type=int, default=None,
                    help="divide every sequence length by this (default: 1 on a GPU, 32 otherwise)")
  demo.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
  demo.add_argument("--heads", type=int, nargs="+", default=[128, 16],
                    help="head counts to run (default: 128 16)")
  demo.add_argument("--scenario", nargs="+", choices=("single", "batch8", "mix"), default=None,
                    help="run only these batches (default: all)")
  serve = sub.add_parser("serve", help="a continuous-batching engine (mla_jax.serving) on random requests")
  serve.add_argument("--backend", default="auto", choices=("auto", "cuda", "cpu", "xla"))
  serve.add_argument("--requests", type=int, default=24, help="number of requests (default 24)")
  serve.add_argument("--slots", type=int, default=8, help="decode slots (default 8)")
  serve.add_argument("--draft-tokens", type=int, default=0,
                     help="speculative decode: up to this many n-gram draft tokens per request and step, "
                          "verified in one ragged paged_decode (default 0: off)")
  args = parser.parse_args(argv)
  if argv is None:  # the command line
    _use_installed_copy(sys.argv[1:])
  if args.command == "info":
    return info()
  if args.command == "serve":
    return _serve(args)
  if args.scale is not None and args.scale < 1:
    parser.error("--scale must be >= 1")
  if any(not 1 <= h <= 128 for h in args.heads):
    parser.error(f"--heads must be in [1, 128], got {args.heads}")
  from mla_jax import demo as demo_mod
  try:
    return demo_mod.run(backend=args.backend, scale=args.scale, dtype=args.dtype,
                        heads=tuple(args.heads), only=args.scenario)
  except RuntimeError as e:  # e.g. backend 'cuda' requested but not compiled in
    print(f"demo failed: {e}", file=sys.stderr)
    from mla_jax import _ffi
    if not _ffi.has_extension() and _source_tree_hint():
      print(_source_tree_hint(), file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
