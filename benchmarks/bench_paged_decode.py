#!/usr/bin/env python3
"""Benchmark of mla_jax.paged_decode against the pure-JAX "xla" backend and FlashMLA.

Runs a fixed list of paged MLA decode shapes (DeepSeek latent cache: 512 ckv +
64 kpe = 576 features per token, page size 64 unless --page-size, bf16, random normal data,
sm_scale 1/sqrt(192), causal for q_len > 1) and, for each, times

  * the op a user calls: ``jax.jit``-ed ``mla_jax.paged_decode`` with backend
    "auto" (on a GPU: on-device scheduler + split kernel + combine), and
  * the "xla" backend (gather every page + einsums) in the same process,

checks each result on a few requests against the float64 NumPy reference
(``mla_jax.testing.reference_paged_decode``), and reports µs, TFLOP/s, GB/s,
the share of the copy/matmul ceilings measured in the same run, the ratio to
XLA, and the ratio to FlashMLA: timed in this process on the same arrays when
torch and flash_mla are importable (benchmarks/flashmla_peer.py), else its
figure from the anchors file of another session (marked as such).
block_table and seq_lens reach every execution as fresh host buffers, as in a
serving step (--resident-metadata keeps them on the device).

Timing method (JAX has no public CUDA-event API): one jitted
program runs the op n times back to back. Call i reads its own query copy
(so XLA cannot merge two calls by CSE) and cache copy i % R, with R copies
when one cache is small so that the rotation set exceeds 2x L2 (the data of
a call is never warm in L2 from an earlier call). Call i+1's query passes
through ``lax.optimization_barrier`` together with call i's result, which
serialises the calls (one call's temporaries live at a time). block_table and
seq_lens are the same values in every call, as the layers of a decode step
share them, so paged decode's schedule call runs once per program (counted
as schedule_calls_in_hi), as FlashMLA computes its metadata once per step;
for the XLA baseline they pass through the barrier as well, since its page
gathers of one cache copy would otherwise merge. Two programs,
n_lo and n_hi calls, take the same arguments; each repetition times both with
``block_until_ready`` and the wall clock, and the per-call time is the slope
(t_hi - t_lo) / (n_hi - n_lo), which cancels the fixed dispatch/launch/sync
cost. The reported µs is the median slope over the repetitions; ``us_wall``
(t_hi / n_hi, median) is kept too. On a GPU the same two programs then run
three more times under ``jax.profiler`` and ``us_device`` is the same slope
from the kernels' own start and end timestamps (no host clock in it). The op is called with return_lse=True
(the kernels write the LSE either way) so the check can use it.

Run ``python benchmarks/bench_paged_decode.py --help`` for the options; see
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PEER_PAGE_SIZE = 64       # FlashMLA, its anchors and the native timer take 64-token pages only
PAGE_SIZE = PEER_PAGE_SIZE  # --page-size sets it for a run
D_QK, D_V = 576, 512
SM_SCALE = 1.0 / math.sqrt(192.0)
NOMINAL_BW = 4.3e12      # B/s, device copy counting read+write (earlier H200 sessions)
NOMINAL_MM = 790e12      # FLOP/s, bf16 matmul (earlier H200 sessions)
FLASHINFER_NOTE = "not measured (FlashInfer MLA is not installed on the device; no internet)"


# --------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Row:
  b: int
  q: int
  h: int
  sk: int
  varlen: bool = False

  @property
  def name(self) -> str:
    return f"b{self.b}q{self.q}h{self.h}s{self.sk}" + ("v" if self.varlen else "")

  @property
  def causal(self) -> bool:
    return self.q > 1

  def seq_lens(self) -> np.ndarray:
    """Per-request cache lengths. varlen: N(sk, sk/2) clipped to [q, 2 sk], numpy seed 0."""
    if not self.varlen:
      return np.full(self.b, self.sk, np.int32)
    rng = np.random.default_rng(0)
    s = rng.normal(self.sk, self.sk / 2, self.b)
    return np.clip(s, self.q, 2 * self.sk).astype(np.int32)


ROWS = [
    Row(128, 1, 128, 4096),
    Row(128, 1, 128, 8192),
    Row(128, 2, 128, 4096),
    Row(128, 1, 64, 8192),
    Row(128, 1, 16, 4096),
    Row(128, 1, 16, 8192),
    Row(128, 1, 16, 32768),
    Row(64, 1, 16, 8192),
    Row(1, 1, 128, 4096),
    Row(32, 1, 128, 4096),
    Row(16, 1, 128, 32768),
    Row(128, 1, 128, 4096, varlen=True),
    Row(1, 1, 12, 76800),
    Row(8, 1, 12, 42000),
    Row(8, 1, 96, 42000),
    Row(8, 2, 12, 42000),
    Row(8, 4, 12, 42000),
    Row(128, 1, 128, 1024),  # many short requests
    Row(128, 8, 16, 4096),  # MTP: 8 query tokens per request
]


def smoke_row(r: Row) -> Row:
  """A CPU-sized version of a row: same structure (varlen, q_len, multi-page requests)."""
  return Row(min(r.b, 3), r.q, min(r.h, 16), max(2 * r.q, r.sk // 128), r.varlen)


def select_rows(rows, spec):
  if not spec:
    return list(enumerate(rows))
  keep = []
  for tok in (t.strip() for t in spec.split(",")):
    if not tok:
      continue
    if tok.isdigit():
      i = int(tok)
      if not 0 <= i < len(rows):
        raise SystemExit(f"--rows: index {i} out of range 0..{len(rows) - 1}")
      keep.append(i)
    else:
      hits = [i for i, r in enumerate(rows) if r.name == tok] or \
             [i for i, r in enumerate(rows) if tok in r.name]
      if not hits:
        raise SystemExit(f"--rows: no row matches {tok!r}; names: "
                         + " ".join(r.name for r in rows))
      keep.extend(hits)
  seen = sorted(set(keep))
  return [(i, rows[i]) for i in seen]


def row_counts(row: Row, seq: np.ndarray):
  sum_seq = int(seq.sum())
  flops = 2 * row.q * sum_seq * row.h * (D_QK + D_V)
  nbytes = (sum_seq * D_QK + row.b * row.q * row.h * (D_QK + D_V)) * 2
  return sum_seq, flops, nbytes


def floor_us(flops, nbytes, bw, mm):
  return max(nbytes / bw, flops / mm) * 1e6


# --------------------------------------------------------------------------------------------
# Anchors (peer figures). The package never reads these; only this script does.
# --------------------------------------------------------------------------------------------
def find_anchors(arg):
  cands = [Path(arg)] if arg else [REPO / "shared" / "anchors", REPO.parent / "shared" / "anchors",
                                   REPO / "anchors"]
  for c in cands:
    if c.is_file():
      c = c.parent
    if (c / "flashmla_h200.json").is_file():
      return c
  return None


def load_anchors(adir):
  out = {"dir": str(adir) if adir else None, "flashmla": {}, "xla_einsum": {}, "error": None}
  if adir is None:
    out["error"] = "anchors dir not found (pass --anchors)"
    return out
  try:
    for r in json.loads((adir / "flashmla_h200.json").read_text()):
      if r.get("kind") == "dense_bf16":
        key = (r["b"], r["s_q"], r["h"], r["sk"], bool(r.get("varlen", False)))
        # Σseq implied by the anchor's own TFLOP/s (differs from ours for varlen rows).
        sum_seq = r["tflops"] * 1e12 * r["us"] * 1e-6 / (2 * r["s_q"] * r["h"] * (D_QK + D_V))
        out["flashmla"][key] = dict(us=r["us"], sum_seq=round(sum_seq), relerr=r.get("relerr"))
  except Exception as e:  # noqa: BLE001 - anchors are optional
    out["error"] = f"flashmla_h200.json: {type(e).__name__}: {e}"
  try:
    p = adir / "xla_einsum_h200.json"
    if p.is_file():
      for b, h, seq, us, *_ in json.loads(p.read_text()):
        out["xla_einsum"][(b, 1, h, seq, False)] = us
  except Exception as e:  # noqa: BLE001
    out["error"] = (out["error"] or "") + f" xla_einsum_h200.json: {type(e).__name__}: {e}"
  return out


# --------------------------------------------------------------------------------------------
# Timing helpers
# --------------------------------------------------------------------------------------------
def _wall(fn, args):
  import jax
  t0 = time.perf_counter()
  out = fn(*args)
  jax.block_until_ready(out)
  return time.perf_counter() - t0, out


def time_slope(lo, hi, args, n_lo, n_hi, reps):
  """Per-call seconds: median over reps of (t_hi - t_lo) / (n_hi - n_lo); also t_hi / n_hi.

  Returns (per-call s, wall_median_s, per-rep slopes, outputs of one lo run); the per-call
  time is the median slope, or the median wall time per call if noise made the slope <= 0.
  """
  _, keep = _wall(lo, args)   # warm-up (first execution allocates, loads modules)
  _wall(hi, args)
  slopes, walls = [], []
  for _ in range(reps):
    t_lo, out = _wall(lo, args)
    del out
    t_hi, out = _wall(hi, args)
    del out
    slopes.append((t_hi - t_lo) / (n_hi - n_lo))
    walls.append(t_hi / n_hi)
  slope, wall = statistics.median(slopes), statistics.median(walls)
  return (slope if slope > 0 else wall), wall, slopes, keep


def device_slope(lo, hi, args, n_lo, n_hi, reps=3, gap_s=0.05):
  """Per-call device seconds from a profiler trace: median over reps of
  (span_hi - span_lo) / (n_hi - n_lo), where a span runs from the first GPU
  kernel's start to the last one's end in one execution of the program.

  The kernels' own timestamps (CUPTI) leave out host dispatch and the wall
  clock's jitter; the slope again cancels anything that runs once per
  program (device idle time inside a program, e.g. waiting for a launch,
  still counts). The executions are separated by gap_s of idle device time,
  which splits the trace's events into programs. Returns None where the
  trace has no GPU events (CPU runs), a dict with "error" where it cannot be
  split as expected.
  """
  import glob
  import tempfile

  import jax
  try:
    from jax.profiler import ProfileData
  except ImportError:
    return None
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(reps):
        for prog in (lo, hi):
          out = prog(*args)
          jax.block_until_ready(out)
          del out
          time.sleep(gap_s)
    files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    if not files:
      return None
    data = ProfileData.from_file(files[0])
  events = []
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU:0"):
      continue
    for line in plane.lines:
      if "Stream" in line.name:  # kernel and copy activities, one line per stream
        events.extend((e.start_ns, e.start_ns + e.duration_ns) for e in line.events)
  if not events:
    return None
  events.sort()
  spans, first, last = [], events[0][0], events[0][1]
  for start, end in events[1:]:
    if start - last > gap_s * 0.5e9:  # idle for half the gap: the next program
      spans.append(last - first)
      first = start
    last = max(last, end)
  spans.append(last - first)
  if len(spans) != 2 * reps:
    return dict(error=f"trace split into {len(spans)} programs, expected {2 * reps}")
  slopes = [(spans[2 * r + 1] - spans[2 * r]) / (n_hi - n_lo) * 1e-9 for r in range(reps)]
  return dict(s=statistics.median(slopes), slopes=slopes, span_hi_s=statistics.median(spans[1::2]) * 1e-9)


def chain_program(step, n, n_caches=1, feed=False, barrier_shared=False):
  """jit of n chained calls: prog(xs, caches, shared), call i = step(x_i, caches[i % n_caches], shared).

  x_i is xs[i] (every call has its own operand, so no two calls can be merged
  by XLA's CSE) or, with ``feed``, call i-1's result. Call i+1's x passes
  through an optimization barrier together with call i's result, which
  orders the calls (one call's temporaries live at a time). The shared
  operands are the same values in every call, as a decode step's layers
  share block_table and seq_lens: what depends on them alone (paged decode's
  schedule call) XLA computes once. ``barrier_shared`` passes them through
  the barrier too (the XLA baseline: its page gather depends on the cache
  copy and block_table only, and calls on the same copy would merge).
  Returns every result (only the last with ``feed``).
  """
  import jax

  def prog(xs, caches, shared):
    outs = []
    x = xs[0]
    for i in range(n):
      o = step(x, caches[i % n_caches], shared)
      outs.append(o)
      if i + 1 < n:
        nxt = o if feed else xs[i + 1]
        if barrier_shared:
          x, shared, _ = jax.lax.optimization_barrier((nxt, shared, o))
        else:
          x, _ = jax.lax.optimization_barrier((nxt, o))
    return outs[-1] if feed else outs
  # keep_unused: the n_lo program gets the same arguments as the n_hi one, so
  # the fixed per-call dispatch cost cancels in the slope.
  return jax.jit(prog, keep_unused=True)


def time_chained(step, args, n_lo, n_hi, reps, n_caches, device_time=True):
  """chain_program(step) at n_lo and n_hi calls over args = (xs, caches, shared), timed.

  Returns (per-call s, wall_median_s, per-rep slopes, device-trace per-call s or None,
  outputs of one n_lo run), as time_slope and device_slope measure them.
  """
  lo, _ = compile_prog(chain_program(step, n_lo, n_caches), *args)
  hi, _ = compile_prog(chain_program(step, n_hi, n_caches), *args)
  per_call, wall, slopes, keep = time_slope(lo, hi, args, n_lo, n_hi, reps)
  dev = device_slope(lo, hi, args, n_lo, n_hi) if device_time else None
  return per_call, wall, slopes, (dev["s"] if dev and "s" in dev else None), keep


def compile_prog(jitted, *args):
  t0 = time.perf_counter()
  c = jitted.lower(*args).compile()
  return c, time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
# Ceilings: device copy (read+write) and bf16 matmul, measured in this run
# --------------------------------------------------------------------------------------------
def measure_ceilings(smoke: bool, reps: int, gpu: bool):
  import jax
  import jax.numpy as jnp
  res = {}
  small = smoke or not gpu        # full sizes only on a GPU (a CPU takes minutes)
  n_lo, n_hi = (2, 4) if small else (5, 10)
  try:
    # n_hi distinct 512 MiB inputs (no call can be merged or fused with another).
    n_el = (8 << 20) if small else (256 << 20)
    gen = jax.jit(lambda k: jax.random.normal(k, (n_el // 4096, 4096), jnp.bfloat16))
    xs = tuple(gen(k) for k in jax.random.split(jax.random.key(1), n_hi))
    c = (jnp.asarray(1.0, jnp.bfloat16),)
    step = lambda y, s, _: y * s                                  # one read + one write
    args = (xs, c, ())
    lo, _ = compile_prog(chain_program(step, n_lo), *args)
    hi, _ = compile_prog(chain_program(step, n_hi), *args)
    s, w, _, keep = time_slope(lo, hi, args, n_lo, n_hi, reps)
    del keep, xs
    nbytes = 2 * n_el * 2
    res["copy"] = dict(bytes_per_call=nbytes, us=s * 1e6, us_wall=w * 1e6, bw_Bps=nbytes / s,
                       method=f"y = x_i * c, bf16, {n_el * 2 >> 20} MiB, distinct x_i; bytes = read + write")
  except Exception as e:  # noqa: BLE001
    res["copy"] = dict(error=f"{type(e).__name__}: {e}")
  try:
    m = 512 if small else 8192
    a = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16)
    b = (jax.random.normal(jax.random.key(3), (m, m), jnp.float32) / math.sqrt(m)).astype(jnp.bfloat16)
    step = lambda y, bb, _: jnp.dot(y, bb, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    args = ((a,), (b,), ())
    lo, _ = compile_prog(chain_program(step, n_lo, feed=True), *args)
    hi, _ = compile_prog(chain_program(step, n_hi, feed=True), *args)
    s, w, _, keep = time_slope(lo, hi, args, n_lo, n_hi, reps)
    del keep
    flops = 2 * m ** 3
    res["matmul"] = dict(m=m, flops_per_call=flops, us=s * 1e6, us_wall=w * 1e6,
                         flops_per_s=flops / s,
                         method=f"y = y @ b, bf16 [{m}x{m}]@[{m}x{m}], f32 accumulate, chained")
  except Exception as e:  # noqa: BLE001
    res["matmul"] = dict(error=f"{type(e).__name__}: {e}")
  if gpu:  # a result beyond the H200's datasheet means calls were merged or mis-timed
    if res["copy"].get("bw_Bps", 0) > 1.2 * 4.8e12:
      res["copy"]["error"] = "implausible (> 1.2x 4.8 TB/s); nominal used"
      res["copy"]["suspect_bw_Bps"] = res["copy"].pop("bw_Bps")
    if res["matmul"].get("flops_per_s", 0) > 1.2 * 989e12:
      res["matmul"]["error"] = "implausible (> 1.2x 989 TFLOP/s); nominal used"
      res["matmul"]["suspect_flops_per_s"] = res["matmul"].pop("flops_per_s")
  res["bw_Bps"] = res["copy"].get("bw_Bps") or NOMINAL_BW
  res["mm_flops"] = res["matmul"].get("flops_per_s") or NOMINAL_MM
  res["measured"] = "bw_Bps" in res["copy"] and "flops_per_s" in res["matmul"]
  return res


# --------------------------------------------------------------------------------------------
# One row
# --------------------------------------------------------------------------------------------
def make_block_table(rng, seq):
  from mla_jax.testing import scattered_block_table
  return scattered_block_table(rng, seq, PAGE_SIZE, extra_pages=3)


def check_subset(out_lse, q0, cache0, bt, seq, plan, idx):
  """relerr (Frobenius, out) and max |Δlse| on requests idx vs the float64 reference."""
  import jax.numpy as jnp
  from mla_jax.testing import reference_paged_decode
  idx = [int(i) for i in idx]
  # Every request has visible positions (seq_len >= q_len): all of out and lse must be finite.
  finite = bool(jnp.all(jnp.isfinite(out_lse[0]))) and bool(jnp.all(jnp.isfinite(out_lse[1])))
  if not finite:
    return dict(relerr=float("nan"), lse_maxabs=float("nan"), status="FAIL(nan)", checked=idx)
  out, lse = (np.asarray(a) for a in out_lse)
  out = out[idx].astype(np.float64)
  lse = lse[idx].astype(np.float64)
  live = [-(-int(seq[i]) // PAGE_SIZE) for i in idx]
  ids = np.concatenate([bt[i, :n] for i, n in zip(idx, live)])
  sub_cache = np.asarray(cache0[ids])                       # only the pages the subset reads
  sub_bt = np.full((len(idx), max(live)), -1, np.int32)
  k = 0
  for j, n in enumerate(live):
    sub_bt[j, :n] = np.arange(k, k + n)
    k += n
  q_sub = np.asarray(q0[np.asarray(idx)])
  ref_out, ref_lse = reference_paged_decode(q_sub, sub_cache, sub_bt, seq[idx], plan)
  rel = float(np.linalg.norm(out - ref_out) / max(np.linalg.norm(ref_out), 1e-30))
  dl = float(np.max(np.abs(lse - ref_lse)))
  ok = math.isfinite(rel) and rel < 1e-2 and dl < 1e-2
  return dict(relerr=rel, lse_maxabs=dl, status="ok" if ok else "FAIL", checked=idx)


def run_backend(plan, data, n_lo, n_hi, reps, counts, ceil, target=None, device_time=False,
                fresh_metadata=True):
  """Times one backend on one row; returns a JSON-able dict.

  fresh_metadata: block_table and seq_lens go in as host arrays, so every
  execution receives them in new device buffers, as a serving step does
  (XLA then updates any command buffer that holds the calls); otherwise they
  stay resident on the device.
  """
  import mla_jax
  qs, caches, bt_d, sl_d, bt, seq, idx = data

  def step(q, cache, shared):
    block_table, seq_lens = shared
    return mla_jax.paged_decode(q, cache, block_table, seq_lens, plan=plan, return_lse=True)

  args = (tuple(qs[:n_hi]), tuple(caches), (bt, seq) if fresh_metadata else (bt_d, sl_d))
  xla = plan.backend == "xla"
  lo, c_lo = compile_prog(chain_program(step, n_lo, len(caches), barrier_shared=xla), *args)
  hi, c_hi = compile_prog(chain_program(step, n_hi, len(caches), barrier_shared=xla), *args)
  res = dict(backend=plan.backend, n_lo=n_lo, n_hi=n_hi, reps=reps,
             compile_s=round(c_lo + c_hi, 3), fresh_metadata=fresh_metadata)
  if target:  # the op must appear once per call: detects merged (CSE'd) calls
    try:
      text = hi.as_text()
      k = text.count(f'custom_call_target="{target}"')
      res["custom_calls_in_hi"] = k
      # paged decode's schedule call: once per program over shared metadata
      res["schedule_calls_in_hi"] = text.count('custom_call_target="mla_jax_paged_decode_schedule_cuda')
      if k and k < n_hi:
        res["warning"] = f"only {k} custom calls for {n_hi} chained calls (merged?)"
    except Exception:  # noqa: BLE001 - text is diagnostics only
      pass
  s, w, slopes, keep = time_slope(lo, hi, args, n_lo, n_hi, reps)
  if device_time:
    try:
      dev = device_slope(lo, hi, args, n_lo, n_hi)
    except Exception as e:  # noqa: BLE001 - diagnostics only; the wall-clock figure stands
      dev, res["device_time_error"] = None, f"{type(e).__name__}: {str(e)[:200]}"
    if dev and "error" in dev:
      res["device_time_error"] = dev["error"]
    elif dev and not dev["s"] > 0:
      res["device_time_error"] = f"non-positive device slope {dev['s'] * 1e6:.3f} us"
    elif dev:
      res.update(us_device=dev["s"] * 1e6, samples_us_device=[round(x * 1e6, 3) for x in dev["slopes"]],
                 us_device_span_per_call=dev["span_hi_s"] / n_hi * 1e6)
  us = s * 1e6
  if not statistics.median(slopes) > 0:  # noise beat the slope: time_slope fell back to wall
    res["warning"] = (res.get("warning", "") + " non-positive slope; us = wall/call").strip()
  sum_seq, flops, nbytes = counts
  res.update(us=us, us_wall=w * 1e6, samples_us=[round(x * 1e6, 3) for x in slopes],
             tflops=flops / us / 1e6, gbs=nbytes / us / 1e3,
             pct_bw=100 * nbytes / us / 1e-6 / ceil["bw_Bps"],
             pct_mm=100 * flops / us / 1e-6 / ceil["mm_flops"])
  res["pct_roofline"] = 100 * floor_us(flops, nbytes, ceil["bw_Bps"], ceil["mm_flops"]) / us
  res.update(check_subset(keep[0], qs[0], caches[0], bt, seq, plan, idx))
  del keep, lo, hi
  return res


def kernel_request(spec: str):
  """The plan's kernel field for a --compare value of bench_sparse_decode.py
  and bench_fp8_decode.py: a kernel name, or KERNEL:SCHEDULE (e.g.
  sm90_seesaw:block) to force the split schedule too."""
  import mla_jax
  kernel, colon, schedule = spec.partition(":")
  if colon and not schedule:
    raise ValueError(f"--compare {spec!r}: KERNEL:SCHEDULE names no schedule")
  return mla_jax.KernelChoice(kernel=kernel, schedule=schedule) if colon else kernel


def pick_n(est_us, target_us, lo, hi):
  n_hi = int(min(hi, max(lo, round(target_us / max(est_us, 1e-3)))))
  return max(1, n_hi // 2), max(2, n_hi)


@functools.lru_cache(maxsize=None)
def _normal_bf16(shape):
  import jax
  import jax.numpy as jnp
  return jax.jit(lambda k: jax.random.normal(k, shape, jnp.bfloat16))


def bench_row(i, row, args, ceil, anchors, primary, target, t_budget, peer=None):
  import jax
  import jax.numpy as jnp
  from mla_jax import DecodePlan

  seq = row.seq_lens()
  sum_seq, flops, nbytes = row_counts(row, seq)
  bt, num_pages = make_block_table(np.random.default_rng(1000 + i), seq)
  cache_bytes = num_pages * PAGE_SIZE * D_QK * 2
  q_bytes = row.b * row.q * row.h * D_QK * 2
  # Cache copies: the rotation set covers >= 2x L2 (one copy when a cache alone does).
  rot = int(min(64, max(1, math.ceil(2 * args.l2_mb * 1e6 / cache_bytes))))
  rec = dict(index=i, name=row.name, b=row.b, q_len=row.q, h=row.h, sk=row.sk, varlen=row.varlen,
             causal=row.causal, page_size=PAGE_SIZE, sum_seq=sum_seq, max_seq=int(seq.max()),
             flops=flops, bytes=nbytes, cache_bytes=cache_bytes, cache_copies=rot,
             floor_us=floor_us(flops, nbytes, ceil["bw_Bps"], ceil["mm_flops"]),
             floor_us_nominal=floor_us(flops, nbytes, NOMINAL_BW, NOMINAL_MM),
             flashinfer=FLASHINFER_NOTE)
  est = rec["floor_us_nominal"]
  q_cap = max(2, int(4e9 // q_bytes))             # distinct query copies: <= 4 GB of them

  # Calls per program and repetitions.
  if args.smoke:
    n_lo, n_hi, reps = 2, 4, args.reps or 3
  else:
    n_lo, n_hi = pick_n(1.5 * est, 4000 if args.quick else 10000, 8,
                        min(q_cap, 48 if args.quick else 128))
    reps = args.reps or (8 if args.quick else 20)
  gathered = row.b * bt.shape[1] * PAGE_SIZE * D_QK * 2
  scores = row.b * row.q * row.h * bt.shape[1] * PAGE_SIZE * 4
  xla_mem = gathered + 3 * scores
  rec["xla_mem_estimate_gb"] = round(xla_mem / 1e9, 2)
  xla_skip = None
  if primary == "xla" or args.no_xla:
    xla_skip = dict(status="skip", reason="primary is xla" if primary == "xla" else "--no-xla")
  elif xla_mem > args.xla_mem_gb * 1e9:
    xla_skip = dict(status="oom/skip",
                    reason=f"gathered cache + scores ~{xla_mem / 1e9:.1f} GB > {args.xla_mem_gb} GB")
  elif time.perf_counter() - t_budget > args.budget_s:
    xla_skip = dict(status="skip", reason=f"time budget {args.budget_s}s spent")
  if args.smoke:
    x_lo, x_hi, x_reps = 1, 2, 2
  else:
    # Small rows: XLA's fixed per-call cost dominates the floor-based estimate,
    # and 2-6 calls gave slopes spread over +-100 % (negative samples on B = 1,
    # NOTES.md). Up to 32 calls there; the cap stays small where one call's
    # gathered cache is large (compile time and memory).
    x_cap = 32 if xla_mem < 1e9 else (4 if args.quick else 6)
    x_lo, x_hi = pick_n(8 * est, 20000, 2, min(q_cap, x_cap))
    x_reps = args.xla_reps or 5
  n_q = max(n_hi, 0 if xla_skip else x_hi)

  # Device data, random normal bf16 generated on the device: one query per call,
  # `rot` cache copies.
  gen_q = _normal_bf16((row.b, row.q, row.h, D_QK))
  gen_c = _normal_bf16((num_pages, PAGE_SIZE, D_QK))
  keys = jax.random.split(jax.random.key(i), n_q + rot)
  qs = [gen_q(keys[r]) for r in range(n_q)]
  caches = [gen_c(keys[n_q + r]) for r in range(rot)]
  bt_d, sl_d = jnp.asarray(bt), jnp.asarray(seq)
  idx = sorted({0, int(np.argmax(seq)), row.b - 1})[:max(1, args.check_requests)]
  data = (qs, caches, bt_d, sl_d, bt, seq, np.asarray(idx))
  counts = (sum_seq, flops, nbytes)
  # `kernel` is passed only when asked for, so that this script also times trees from before the field
  # existed (scripts/compare_builds.sh).
  forced = dict(kernel=args.kernel) if args.kernel != "auto" else {}
  mk = lambda backend: DecodePlan(num_heads=row.h, page_size=PAGE_SIZE, sm_scale=SM_SCALE,
                                  q_len=row.q, causal=row.causal, backend=backend,
                                  **(forced if backend != "xla" else {}))

  # Primary backend (what users get).
  try:
    rec["mla"] = run_backend(mk(args.backend), data, n_lo, n_hi, reps, counts, ceil, target,
                             device_time=args.device_time, fresh_metadata=not args.resident_metadata)
  except Exception as e:  # noqa: BLE001 - keep going, report the failure
    rec["mla"] = dict(backend=args.backend, error=f"{type(e).__name__}: {str(e)[:400]}",
                      status="ERROR")
  # XLA baseline, same process, same data.
  if xla_skip:
    rec["xla"] = xla_skip
  else:
    try:
      rec["xla"] = run_backend(mk("xla"), data, x_lo, x_hi, x_reps, counts, ceil,
                               fresh_metadata=not args.resident_metadata)
    except Exception as e:  # noqa: BLE001
      rec["xla"] = dict(backend="xla", error=f"{type(e).__name__}: {str(e)[:400]}", status="ERROR")

  # FlashMLA in this process, on the same arrays and call counts.
  fr = {}
  if peer is not None:
    try:
      fr = peer.dense_decode(qs, caches, bt, seq, causal=row.causal, sm_scale=SM_SCALE, n_lo=n_lo,
                             n_hi=n_hi, reps=reps)
      fr.update(check_subset(fr.pop("result"), qs[0], caches[0], bt, seq, mk("xla"), idx))
    except Exception as e:  # noqa: BLE001 - the peer's failure is a result, not the benchmark's
      fr = dict(error=f"{type(e).__name__}: {str(e)[:400]}", status="ERROR")
    rec["flashmla_same_run"] = fr

  m, x = rec["mla"], rec["xla"]
  if "us" in m and "us" in x:
    rec["xla_over_mla"] = x["us"] / m["us"]
  key = (row.b, row.q, row.h, row.sk, row.varlen)
  fm = anchors["flashmla"].get(key)
  if "us" in fr and fr.get("status") == "ok":  # a peer result that failed its check is no reference
    rec["flashmla"] = dict(source="same_run", us=fr["us"], us_scaled_to_our_sum_seq=fr["us"])
  elif fm and not args.smoke:
    # Σseq-normalised FlashMLA time (identical to raw for fixed-length rows).
    fm_scaled = fm["us"] * sum_seq / fm["sum_seq"]
    rec["flashmla"] = dict(source="anchor", us=fm["us"], sum_seq=fm["sum_seq"],
                           us_scaled_to_our_sum_seq=fm_scaled, relerr=fm["relerr"])
  if "flashmla" in rec:
    ref_us = rec["flashmla"]["us_scaled_to_our_sum_seq"]
    if "us" in m:
      rec["mla_over_flashmla"] = m["us"] / ref_us
    if "us_device" in m:
      rec["mla_device_over_flashmla"] = m["us_device"] / ref_us
  # The flat summary of the results format (issue 24): user-level per-call time, its GPU
  # time, the host time the GPU does not hide (their difference), the peer, the XLA path.
  rec.update(kind="dense_bf16", seq=row.sk, mla_jax_us=m.get("us"), mla_jax_gpu_us=m.get("us_device"),
             host_us=m["us"] - m["us_device"] if "us" in m and "us_device" in m else None,
             flashmla_us=fr.get("us"), flashmla_dobench_us=fr.get("us_dobench"), xla_us=x.get("us"))
  xa = anchors["xla_einsum"].get(key)
  if xa and not args.smoke:
    rec["xla_einsum_anchor_us"] = xa
  del qs, caches, data
  return rec


# --------------------------------------------------------------------------------------------
# The kernels without XLA: benchmarks/native/decode_timing.cc
# --------------------------------------------------------------------------------------------
NATIVE_METHOD = (
    "mla_jax_graph_us: the same kernels without XLA (benchmarks/native/decode_timing.cc, a separate "
    "process before this one), timed as flashmla_us is: n calls in one CUDA graph, replayed, slope "
    "between n/2 and n by CUDA events (the schedule computed once before, as in the jitted program); "
    "its own random data of the same shape and lengths (a row whose "
    "token count differs from this run's or whose check failed gets no figure). "
    "jax_over_graph_us = mla_jax_us - mla_jax_graph_us: what the jitted program costs beyond the replayed kernels (launch gaps, host time the GPU does not hide, and run-to-run "
    "spread). host_prepare_us, host_tma_encode_us: the handler's per-call host work without launches.")


def run_native_timing(binary, rows, reps=10, l2_mb=60.0, timeout_s=900):
  """Runs the native timer `binary` on `rows` (Row list; varlen rows get this script's lengths,
  passed in a file), `reps` repetitions, cache rotation over 2 x `l2_mb` MB.

  Returns {row name: the timer's JSON record (times in µs: graph_us, stream_us, host_*_us)};
  key "error" holds why the timer did not finish cleanly (exit status, timeout, not found).
  Never raises for the timer's failures.
  """
  import tempfile
  with tempfile.TemporaryDirectory() as d:
    specs = []
    for r in rows:
      spec = f"{r.b},{r.q},{r.h},{r.sk}"
      if r.varlen:
        lens = Path(d) / f"{r.name}.txt"
        lens.write_text(" ".join(str(int(x)) for x in r.seq_lens()))
        spec += f",@{lens}"
      specs.append(spec)
    cmd = [binary, "--rows", ";".join(specs), "--reps", str(reps), "--l2-mb", str(l2_mb)]
    try:
      done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
      stdout, err = done.stdout, (None if done.returncode == 0 else
                                  f"exit status {done.returncode}: {(done.stderr or done.stdout)[-300:]}")
    except subprocess.TimeoutExpired as e:
      out = e.stdout or ""
      stdout, err = out.decode() if isinstance(out, bytes) else out, f"timed out after {timeout_s} s"
    except OSError as e:
      return {"error": f"{type(e).__name__}: {e}"}
  recs = {}
  for line in stdout.splitlines():
    if line.startswith("{"):
      try:
        r = json.loads(line)
      except json.JSONDecodeError:
        continue  # a line cut short: that row has no figure
      recs[r["name"]] = r
  if err:
    recs["error"] = err
  print(f"native timing: {len(recs) - ('error' in recs)} rows"
        + (f" ({recs['error'][:200]})" if "error" in recs else ""), flush=True)
  return recs


def add_native(rec, nat):
  """Adds the native record `nat` (or None) to the row record `rec`, in place: `native`, and
  mla_jax_graph_us (µs; None unless the timer's check passed on the same token count),
  jax_over_graph_us (µs) and graph_over_flashmla (ratio) where their inputs exist."""
  if not nat:
    return
  rec["native"] = nat
  # A figure counts only for the same work: its check passed and it covers as many tokens.
  same = nat.get("check_ok") and ("sum_seq" not in rec or nat.get("sum_seq") == rec["sum_seq"])
  graph = nat.get("graph_us") if same else None
  rec["mla_jax_graph_us"] = graph
  if graph and rec.get("mla_jax_us"):
    rec["jax_over_graph_us"] = rec["mla_jax_us"] - graph
  if graph and rec.get("flashmla_us"):
    rec["graph_over_flashmla"] = graph / rec["flashmla_us"]


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------
def _f(v, fmt, width):
  if v is None or (isinstance(v, float) and not math.isfinite(v)):
    return "-".rjust(width)
  return format(v, fmt).rjust(width)


def _ratio(v, width):
  if v is None or not math.isfinite(v):
    return "-".rjust(width)
  return format(v, ".2f" if v < 99.5 else ".0f").rjust(width)


def table(meta, rows):
  ceil = meta["ceilings"]
  lines = []
  lines.append(f"== mla_jax paged MLA decode | {meta['device']} | jax {meta['jax_version']} | "
               f"commit {meta['commit'][:12]} (source {meta.get('source_digest', '-')[:12]}) | {meta['date']}")
  if meta.get("env"):
    lines.append("env: " + " ".join(f"{k}={v}" for k, v in meta["env"].items()))
  lines.append(f"backend {meta['backend_requested']} -> {meta['backend_resolved']}; "
               f"ceilings{'' if ceil['measured'] else ' (partly nominal)'}: copy "
               f"{ceil['bw_Bps'] / 1e12:.3g} TB/s (r+w), bf16 mm {ceil['mm_flops'] / 1e12:.3g} TFLOP/s")
  lines.append("us: median per-call slope of chained jitted calls (rotating caches, L2-cold); "
               "%BW/%MM of those ceilings; roof = floor/us")
  hdr = (f"{'#':>2} {'row':<17}{'us':>9}{'TF/s':>7}{'GB/s':>7}{'%BW':>5}{'%MM':>5}{'roof':>5}"
         f"{'floor':>8}{'xla_us':>9}{'xla/us':>7}{'FMLA':>8}{'us/FM':>7}{'dev_us':>8}{'dv/FM':>7}"
         f"{'relerr':>8}  st")
  lines.append(hdr)
  same = any(r.get("flashmla", {}).get("source") == "same_run" for r in rows)
  for r in rows:
    m = r.get("mla", {})
    x = r.get("xla", {})
    fm = r.get("flashmla", {})
    st = m.get("status", "?")
    if x.get("status") not in (None, "ok", "skip"):
      st += f" xla:{x.get('status')}"
    if m.get("warning") or x.get("warning"):
      st += " (warn)"
    if "error" in r:
      st = "ERROR"
    xla_us = x.get("us")
    xla_cell = _f(xla_us, ".1f", 9) if xla_us else x.get("status", "-")[:8].rjust(9)
    name = r["name"] + ("*" if r.get("varlen") and fm.get("source") == "anchor" else "")
    name += "a" if fm.get("source") == "anchor" and same else ""
    lines.append(
        f"{r['index']:>2} {name:<17}{_f(m.get('us'), '.1f', 9)}{_f(m.get('tflops'), '.0f', 7)}"
        f"{_f(m.get('gbs'), '.0f', 7)}{_f(m.get('pct_bw'), '.0f', 5)}{_f(m.get('pct_mm'), '.0f', 5)}"
        f"{_f(m.get('pct_roofline'), '.0f', 5)}{_f(r.get('floor_us'), '.1f', 8)}{xla_cell}"
        f"{_ratio(r.get('xla_over_mla'), 7)}{_f(fm.get('us_scaled_to_our_sum_seq'), '.1f', 8)}"
        f"{_ratio(r.get('mla_over_flashmla'), 7)}{_f(m.get('us_device'), '.1f', 8)}"
        f"{_ratio(r.get('mla_device_over_flashmla'), 7)}{_f(m.get('relerr'), '.1e', 8)}  {st}")
  lines.append("xla/us: XLA-backend time / mla_jax time (same run). FMLA: FlashMLA us, " +
               ("CUDA-graph replay in this process (rows marked a: an anchor from another session)"
                if same else "anchor from another session (do_bench, L2 flushed)") +
               "; us/FM: mla_jax / FlashMLA (>1 = slower)")
  for key, label in (("mla_over_flashmla", "us/FM"), ("mla_device_over_flashmla", "dv/FM")):
    vals = [r[key] for r in rows if (r.get(key) or 0) > 0]
    if vals:
      gm = math.exp(sum(math.log(v) for v in vals) / len(vals))
      lines.append(f"geometric mean of {label} over {len(vals)} rows: {gm:.3f}")
  lines.append("dev_us: the same slope from the kernels' timestamps in a profiler trace (3 reps; "
               "no host clock); dv/FM: dev_us / FlashMLA")
  nat = [r for r in rows if r.get("native")]
  if nat:
    lines.append(f"{'#':>2} {'row':<17}{'graph':>9}{'gr/FM':>7}{'us-gr':>8}{'prep':>7}{'tma':>7}  kernel (native)")
    for r in nat:
      n = r["native"]
      lines.append(f"{r['index']:>2} {r['name']:<17}{_f(r.get('mla_jax_graph_us'), '.1f', 9)}"
                   f"{_ratio(r.get('graph_over_flashmla'), 7)}{_f(r.get('jax_over_graph_us'), '.1f', 8)}"
                   f"{_f(n.get('host_prepare_us'), '.2f', 7)}{_f(n.get('host_tma_encode_us'), '.2f', 7)}"
                   f"  {n.get('kernel_config')}{'' if n.get('check_ok') else ' CHECK FAILED'}")
    vals = [r["graph_over_flashmla"] for r in nat if (r.get("graph_over_flashmla") or 0) > 0]
    if vals:
      lines.append(f"geometric mean of gr/FM over {len(vals)} rows: "
                   f"{math.exp(sum(math.log(v) for v in vals) / len(vals)):.3f}")
    lines.append("graph: the kernels without XLA, CUDA-graph replay (as FlashMLA is timed); us-gr: mla_jax us - "
                 "graph; prep, tma: the handler's host work per call (us)")
  for r in rows:
    if r.get("mla", {}).get("device_time_error"):
      lines.append(f"no dev_us for {r['name']}: {r['mla']['device_time_error'][:160]}")
  lines.append("* varlen: FMLA us scaled by our sum_seq / anchor sum_seq (lengths drawn "
               "differently). FlashInfer MLA: " + FLASHINFER_NOTE + ".")
  for r in rows:
    for what in ("mla", "xla"):
      w = r.get(what, {}).get("warning")
      if w:
        lines.append(f"(warn) {r['name']} {what}: {w[:160]}")
  for r in rows:
    for what, e in (("row", r.get("error")), ("mla", r.get("mla", {}).get("error")),
                    ("xla", r.get("xla", {}).get("error"))):
      if e:
        lines.append(f"error {r['name']} {what}: {e[:160]}")
  return "\n".join(lines)


# What a build compiles or imports, by folder and file suffix (build outputs
# such as an in-place extension module are left out).
SOURCE_DIRS = ("mla_jax", "csrc", "ffi")
SOURCE_TOP_FILES = ("CMakeLists.txt", "pyproject.toml")
SOURCE_SUFFIXES = (".py", ".h", ".hpp", ".cc", ".cpp", ".cu", ".cuh", ".txt", ".toml")


def source_digest(root=REPO):
  """sha256 (hex) of the package's source files under `root`: their paths and contents.

  Identifies the code a result came from without git metadata (a tree copied to
  another machine may carry a stale .git). `--print-source-digest` prints it for
  the current tree, to compare with a results file's `source_digest`.
  """
  root = Path(root)
  files = [root / f for f in SOURCE_TOP_FILES if (root / f).is_file()]
  for d in SOURCE_DIRS:
    files += [f for f in (root / d).rglob("*")
              if f.is_file() and f.suffix in SOURCE_SUFFIXES and "__pycache__" not in f.parts]
  h = hashlib.sha256()
  for f in sorted(files, key=lambda f: f.relative_to(root).as_posix()):
    data = f.read_bytes()
    h.update(f"{f.relative_to(root).as_posix()}\0{len(data)}\0".encode())
    h.update(data)
  return h.hexdigest()


def mla_jax_env(environ=None):
  """The MLA_JAX_* environment switches set for this run (name -> value), sorted.

  They change which kernels run (e.g. MLA_JAX_PDL, MLA_JAX_SCHEDULER_KERNEL), so a
  result is only comparable with one run under the same switches.
  """
  environ = os.environ if environ is None else environ
  return {k: environ[k] for k in sorted(environ) if k.startswith("MLA_JAX_") and environ[k] != ""}


def git_commit(arg):
  if arg:
    return arg, None
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          timeout=10)
    if head.returncode == 0:
      dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                             capture_output=True, text=True, timeout=10)
      return head.stdout.strip(), bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
  except Exception:  # noqa: BLE001
    pass
  return "unknown", None


def write_json(path, meta, rows, done):
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text(json.dumps(dict(meta, complete=done, rows=rows), indent=1, default=str))
  os.replace(tmp, path)


def print_floors(anchors):
  """Markdown table of the nominal floors (used for benchmarks/NOTES.md)."""
  print("| # | row | Σseq | GFLOP | MB | bytes/4.3 TB/s µs | FLOPs/790 TF/s µs | floor µs | bound "
        "| FlashMLA µs | floor/FlashMLA |")
  print("|---|-----|------|-------|----|------|------|------|-----|------|-----|")
  for i, r in enumerate(ROWS):
    s, f, b = row_counts(r, r.seq_lens())
    tb, tf = b / NOMINAL_BW * 1e6, f / NOMINAL_MM * 1e6
    fm = anchors["flashmla"].get((r.b, r.q, r.h, r.sk, r.varlen))
    fm_us = fm["us"] * s / fm["sum_seq"] if fm else None
    fm_cells = (f"{fm_us:.1f}{'*' if r.varlen else ''} | {100 * max(tb, tf) / fm_us:.0f}%"
                if fm else "- | -")
    print(f"| {i} | {r.name} | {s} | {f / 1e9:.1f} | {b / 1e6:.1f} | {tb:.1f} | {tf:.1f} | "
          f"{max(tb, tf):.1f} | {'memory' if tb >= tf else 'compute'} | {fm_cells} |")


def main(argv=None):
  global PAGE_SIZE  # --page-size
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--rows", default="", help="comma list of row indices or (sub)names, e.g. 0,3,b1q1")
  p.add_argument("--quick", action="store_true", help="fewer calls and repetitions")
  p.add_argument("--smoke", action="store_true",
                 help="tiny shapes (B<=4, H<=16, seq/64) and few reps: a CPU check of the script")
  p.add_argument("--backend", default="auto", choices=("auto", "cuda", "cpu", "xla"),
                 help="backend of the timed mla_jax op (default auto)")
  p.add_argument("--no-xla", action="store_true", help="skip the xla-backend baseline")
  p.add_argument("--flashmla", default="auto", choices=("auto", "off"),
                 help="time FlashMLA in this process when torch and flash_mla are importable (auto)")
  p.add_argument("--resident-metadata", action="store_true",
                 help="keep block_table/seq_lens on the device between executions (default: fresh "
                      "host buffers every execution, as a serving step sends them)")
  p.add_argument("--kernel", default="auto", choices=("auto", "portable", "sm90_lockstep", "sm90_seesaw"),
                 help="DecodePlan.kernel of the timed op (default auto); see mla_jax.explain")
  p.add_argument("--anchors", default=None,
                 help="anchors dir (or its flashmla_h200.json); default: shared/anchors in or "
                      "beside the repo")
  p.add_argument("--out", default=None,
                 help="JSON output path (default benchmarks/results/local_<platform>.json, "
                      "git-ignored; with --smoke "
                      "benchmarks/results/smoke.json)")
  p.add_argument("--commit", default=None, help="git commit to record (default: git rev-parse HEAD)")
  p.add_argument("--reps", type=int, default=0, help="repetitions of the timed op (default 20, quick 8)")
  p.add_argument("--xla-reps", type=int, default=0, help="repetitions for xla (default 5)")
  p.add_argument("--xla-mem-gb", type=float, default=20.0,
                 help="skip xla where gathered cache + scores exceed this (default 20)")
  p.add_argument("--budget-s", type=float, default=200.0,
                 help="after this many seconds skip the xla baseline; after 1.25x skip rows")
  p.add_argument("--l2-mb", type=float, default=None,
                 help="L2 size for the cache rotation set (>= 2x L2; default 60, smoke 0.5)")
  p.add_argument("--check-requests", type=int, default=3,
                 help="requests per row checked against the float64 reference (default 3)")
  p.add_argument("--no-device-time", action="store_true",
                 help="skip the profiler-trace device time of the timed op (GPU only)")
  p.add_argument("--page-size", type=int, default=PEER_PAGE_SIZE,
                 help=f"the cache's page_size (default {PEER_PAGE_SIZE}); FlashMLA and --native-timing run at "
                      f"{PEER_PAGE_SIZE} only and are left out at another")
  p.add_argument("--native-timing", default=None, metavar="PATH",
                 help="mla_jax_decode_timing binary (built with MLA_JAX_KERNEL_DRIVER=ON): run it first "
                      "on the same rows and report the kernels' CUDA-graph time beside the JAX figures")
  p.add_argument("--print-floors", action="store_true",
                 help="print the nominal-floor table (NOTES.md) and exit")
  p.add_argument("--print-source-digest", action="store_true",
                 help="print the source digest of this tree (see source_digest) and exit")
  args = p.parse_args(argv)
  if args.page_size < 1:
    p.error(f"--page-size must be positive, got {args.page_size}")
  if args.page_size != PEER_PAGE_SIZE and args.native_timing:
    p.error(f"--native-timing times page_size {PEER_PAGE_SIZE} only, not {args.page_size}")
  PAGE_SIZE = args.page_size
  if args.out is None and args.smoke:
    args.out = str(REPO / "benchmarks" / "results" / "smoke.json")
  if args.l2_mb is None:
    args.l2_mb = 0.5 if args.smoke else 60.0
  if args.print_source_digest:
    print(source_digest())
    return 0
  if args.print_floors:
    print_floors(load_anchors(find_anchors(args.anchors)))
    return 0

  t_start = time.perf_counter()
  rows_all = [smoke_row(r) for r in ROWS] if args.smoke else ROWS
  chosen = select_rows(rows_all, args.rows)
  # Before JAX takes the GPU: the native timer allocates its own buffers.
  native = (run_native_timing(args.native_timing, [r for _, r in chosen], l2_mb=args.l2_mb)
            if args.native_timing else {})
  native_s = time.perf_counter() - t_start
  t_budget = time.perf_counter()  # --budget-s counts from here: the native timer's time is its own
  peer, why = None, "--flashmla off" if args.flashmla == "off" else "--smoke"
  if PAGE_SIZE != PEER_PAGE_SIZE:
    why = f"page_size {PAGE_SIZE} (FlashMLA takes {PEER_PAGE_SIZE})"
  elif args.flashmla == "auto" and not args.smoke:
    import flashmla_peer  # beside this script
    peer, why = flashmla_peer.load()
  if peer is not None:
    # torch shares the GPU with JAX: JAX must not take 75 % of its memory up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  import jax
  import jaxlib
  import mla_jax
  from mla_jax import _ffi

  platform = jax.default_backend()
  dev = jax.devices()[0]
  args.device_time = platform == "gpu" and not args.no_device_time
  if args.backend == "auto":
    if platform == "gpu":
      resolved = "cuda" if _ffi.has_cuda_kernels() else "xla"
    else:
      resolved = "cpu" if platform == "cpu" else "xla"
  else:
    resolved = args.backend
  target = {"cuda": _ffi.CUDA_TARGET, "cpu": _ffi.CPU_TARGET}.get(resolved)
  if args.backend == "auto" and platform == "gpu" and resolved == "xla":
    print("WARNING: mla_jax has no CUDA kernels compiled in: backend auto resolves to xla",
          flush=True)

  commit, dirty = git_commit(args.commit)
  anchors = load_anchors(find_anchors(args.anchors))
  if PAGE_SIZE != PEER_PAGE_SIZE:  # the anchors were measured on 64-token pages
    anchors.update(flashmla={}, xla_einsum={}, error=f"not used at page_size {PAGE_SIZE}")
  if anchors["error"]:
    print(f"note: anchors: {anchors['error']}", flush=True)

  meta = dict(
      device=f"{dev.device_kind} ({platform})", platform=platform,
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      commit=commit, dirty=dirty, source_digest=source_digest(), env=mla_jax_env(),
      jax_version=jax.__version__, jaxlib_version=jaxlib.__version__,
      python=sys.version.split()[0], mla_jax_version=mla_jax.__version__,
      mla_jax_file=mla_jax.__file__, has_cuda_kernels=_ffi.has_cuda_kernels(),
      cuda_archs=_ffi.cuda_archs(), backend_requested=args.backend, backend_resolved=resolved, kernel=args.kernel,
      smoke=args.smoke, quick=args.quick, anchors_dir=anchors["dir"], anchors_error=anchors["error"],
      flashinfer=FLASHINFER_NOTE,
      method=("per-call us = median over reps of (t_hi - t_lo)/(n_hi - n_lo): two jitted programs "
              "of n_lo/n_hi calls serialised by optimization_barrier; call i reads its own query "
              "copy (no CSE) and cache copy i % R (R copies cover >= 2x L2 when one cache is "
              "small); wall clock + block_until_ready; return_lse=True. "
              "block_table/seq_lens: " + ("resident on the device" if args.resident_metadata else
                                          "fresh host buffers every execution") + ", the same values "
              "in every call of a program (as a step's layers share them: one schedule call per program). "
              "mla_jax_gpu_us: the same slope of the device spans in a profiler trace; host_us = "
              "mla_jax_us - mla_jax_gpu_us. flashmla_us: FlashMLA in this process, CUDA graph of n calls "
              "replayed, slope (benchmarks/flashmla_peer.py). "
              "FLOPs = 2*q*sum_seq*H*1088, bytes = (sum_seq*576 + B*q*H*1088)*2."),
      page_size=PAGE_SIZE, sm_scale=SM_SCALE, dtype="bfloat16")
  if args.native_timing:
    meta["native_timing"] = dict(binary=args.native_timing, error=native.get("error"), method=NATIVE_METHOD,
                                 elapsed_s=round(native_s, 1))

  print(f"device {meta['device']}, jax {jax.__version__}, backend {args.backend} -> {resolved}, "
        f"{len(chosen)} rows", flush=True)
  if peer is not None and platform != "gpu":
    peer, why = None, f"JAX runs on {platform}, not the GPU"
  meta["flashmla_same_run"] = dict(available=peer is not None, reason=why,
                                   version=getattr(peer, "version", None))
  meta["xla_python_client_preallocate"] = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")
  print(f"FlashMLA in this process: {'yes' if peer else 'no (' + why + ')'}", flush=True)
  ceil = measure_ceilings(args.smoke, 3 if args.smoke else 5, platform == "gpu")
  if peer is not None:
    # The ceilings the comparison uses: a device-to-device copy and a library bf16 matmul.
    try:
      ceil["torch"] = peer.ceilings()
      ceil["bw_Bps"], ceil["mm_flops"] = ceil["torch"]["memcpy"]["bw_Bps"], ceil["torch"]["matmul"]["flops_per_s"]
      ceil["source"] = "torch memcpy and matmul (this run)"
    except Exception as e:  # noqa: BLE001
      ceil["torch"] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
  ceil.setdefault("source", "JAX x * c copy and jnp.dot (this run)" if ceil["measured"] else "partly nominal")
  meta["ceilings"] = ceil
  print(f"ceilings: copy {ceil['bw_Bps'] / 1e12:.3f} TB/s, matmul {ceil['mm_flops'] / 1e12:.1f} "
        f"TFLOP/s ({time.perf_counter() - t_start:.0f}s)", flush=True)
  if args.out is None:
    # Never the committed results: replacing those takes an explicit --out
    # (local_*.json is git-ignored).
    args.out = str(REPO / "benchmarks" / "results" / f"local_{platform}.json")
  out_path = Path(args.out)
  records = []
  for i, row in chosen:
    elapsed = time.perf_counter() - t_budget
    if elapsed > 1.25 * args.budget_s:
      records.append(dict(index=i, name=row.name, b=row.b, q_len=row.q, h=row.h, sk=row.sk,
                          varlen=row.varlen, mla=dict(status="skip: budget"),
                          xla=dict(status="skip")))
      continue
    t0 = time.perf_counter()
    try:
      rec = bench_row(i, row, args, ceil, anchors, resolved, target, t_budget, peer)
      add_native(rec, native.get(row.name))
    except Exception as e:  # noqa: BLE001 - data generation etc.: record and go on
      rec = dict(index=i, name=row.name, b=row.b, q_len=row.q, h=row.h, sk=row.sk,
                 varlen=row.varlen, error=f"{type(e).__name__}: {str(e)[:400]}",
                 mla=dict(status="ERROR"), xla=dict(status="-"))
    rec["row_s"] = round(time.perf_counter() - t0, 2)
    records.append(rec)
    gc.collect()
    m, x = rec.get("mla", {}), rec.get("xla", {})
    print(f"[{i:2}] {row.name:<16} mla {_f(m.get('us'), '.1f', 8)} us  xla "
          f"{_f(x.get('us'), '.1f', 8) if 'us' in x else x.get('status', '-'):>8}  "
          f"relerr {_f(m.get('relerr'), '.1e', 7)} {m.get('status', '')}  ({rec['row_s']}s)",
          flush=True)
    write_json(out_path, dict(meta, elapsed_s=round(time.perf_counter() - t_start, 1)), records,
               False)
  meta["elapsed_s"] = round(time.perf_counter() - t_start, 1)
  write_json(out_path, meta, records, True)
  print(f"wrote {out_path} ({meta['elapsed_s']}s)", flush=True)
  print(table(meta, records), flush=True)
  bad = [r["name"] for r in records
         if r.get("mla", {}).get("status") not in ("ok",) and
         not str(r.get("mla", {}).get("status", "")).startswith("skip")]
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
