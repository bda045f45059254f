"""Randomized differential test of paged_decode against the float64 reference.

Each case draws, from its own seed, a point of the input space: batch, q_len,
heads, page size, dtype (bf16, fp16, or a float8_e4m3fn cache with kv_scale),
query and cache layouts (packed or pairs, with or without the Q axis), causal
or not, request lengths (0, 1, around page boundaries, random), scattered or
ordered tables with unused entries holding -1 or arbitrary ids, invalid
requests (negative length, length past the table, a bad live page id), and
every cache slot no valid request may see poisoned with NaN. The result is
compared with :func:`mla_jax.testing.reference_paged_decode` by
``assert_matches_reference`` (tests/test_paged_decode.py).

On the cuda backend each case also draws the kernel (auto, or one forced
through ``plan.kernel`` where it can serve the call).

Cases per backend: ``--differential-cases N`` (default: 200 for cpu, 30 for
xla, whose compilation dominates, and 300 for cuda, so that the GPU suite
fits one device call; a dedicated GPU run takes a few thousand, see
scripts/gpu_tests.sh); ``--differential-seed S`` moves the whole set. A failure
names every failing case's seed and parameters; rerun one with
``-k <backend> --differential-seed <seed> --differential-cases 1``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mla_jax
from mla_jax.testing import reference_paged_decode, scattered_block_table
from test_paged_decode import BACKENDS, assert_matches_reference, make_plan, run_decode

DN = 512
DEFAULT_CASES = {"cpu": 200, "xla": 30, "cuda": 300}
DEFAULT_SEED = 20261202
# Work per case (B x Q x H x sum(seq_lens)) is capped so that a case stays
# cheap for the float64 reference and the CPU kernel.
MAX_WORK = 3_000_000


@dataclasses.dataclass
class Case:
  seed: int
  batch: int
  q_len: int
  heads: int
  page_size: int
  dtype: str                 # "bf16", "fp16" or "fp8" (float8_e4m3fn cache, bf16 query, kv_scale)
  causal: bool
  q_layout: str              # "packed" or "pair"
  kv_layout: str
  q_axis: bool               # query given with its Q axis (always when q_len > 1)
  scatter: bool
  seq_lens: list
  spare_cols: int            # table columns past the longest request
  spare_fill: str            # what unused table entries hold: "-1" or "junk"
  invalid: dict              # request -> "negative", "past_table", "bad_page"
  kernel: str                # plan.kernel on the cuda backend (auto where the forced one cannot serve)

  def describe(self) -> str:
    return ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())


def _lengths(rng, batch, page_size, q_len, budget):
  menu = [0, 1, q_len, page_size - 1, page_size, page_size + 1, 2 * page_size + 1]
  lens = []
  for _ in range(batch):
    if rng.random() < 0.5:
      n = int(rng.choice(menu))
    else:
      n = int(rng.integers(0, max(2, budget)))
    lens.append(max(0, min(n, budget)))
  return lens


def draw(seed: int) -> Case:
  rng = np.random.default_rng(seed)
  page_size = int(rng.choice([1, 2, 4, 8, 16, 16, 32, 64, 64, 64, 128, 256]))
  heads = int(rng.choice([1, 2, 3, 8, 12, 16, 16, 32, 64, 96, 128]))
  q_len = int(rng.choice([1, 1, 1, 2, 3, 4, 8]))
  batch = int(rng.integers(1, 7))
  budget = max(1, MAX_WORK // (batch * q_len * heads))
  lens = _lengths(rng, batch, page_size, q_len, min(budget, 1500))
  invalid = {}
  for b in range(batch):
    if rng.random() < 0.12:
      invalid[b] = str(rng.choice(["negative", "past_table", "bad_page"]))
  return Case(seed=seed, batch=batch, q_len=q_len, heads=heads, page_size=page_size,
              dtype=str(rng.choice(["bf16", "bf16", "fp16", "fp8"])), causal=bool(rng.random() < 0.7),
              q_layout=str(rng.choice(["packed", "pair"])), kv_layout=str(rng.choice(["packed", "pair"])),
              q_axis=bool(q_len > 1 or rng.random() < 0.5), scatter=bool(rng.random() < 0.8),
              seq_lens=lens, spare_cols=int(rng.integers(0, 3)), spare_fill=str(rng.choice(["-1", "junk"])),
              invalid=invalid,
              kernel=str(rng.choice(["auto", "auto", "portable", "sm90_lockstep", "sm90_seesaw", "sm90_swapab"])))


def build(case: Case):
  """Host inputs (already rounded to their dtypes), kv_scale, and the float64 reference."""
  rng = np.random.default_rng(case.seed + 1)
  s = case.page_size
  lens = np.asarray(case.seq_lens, np.int32)
  bt, num_pages = scattered_block_table(rng, lens, s, extra_pages=int(rng.integers(0, 4)), scatter=case.scatter)
  num_pages = max(num_pages, 1)
  cols = bt.shape[1] + case.spare_cols
  fill = (np.full((case.batch, cols), -1, np.int32) if case.spare_fill == "-1"
          else rng.integers(-2**31, 2**31 - 1, size=(case.batch, cols), dtype=np.int64).astype(np.int32))
  live_cols = np.arange(cols)[None, :] < (-(-lens // s))[:, None]
  bt = np.where(live_cols, np.pad(bt, ((0, 0), (0, case.spare_cols))), fill).astype(np.int32)

  q_dtype = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp8": ml_dtypes.bfloat16}[case.dtype]
  kv_dtype = ml_dtypes.float8_e4m3fn if case.dtype == "fp8" else q_dtype
  query = rng.standard_normal((case.batch, case.q_len, case.heads, 576)).astype(q_dtype)
  kv = (rng.standard_normal((num_pages, s, 576)) * (8.0 if case.dtype == "fp8" else 1.0)).astype(kv_dtype)
  kv_scale = np.float32(rng.uniform(0.02, 0.5)) if case.dtype == "fp8" else None

  # Every slot no valid request may see holds NaN (rows of invalid requests
  # are NaN whatever they read).
  seen = np.zeros((num_pages, s), bool)
  for b, n in enumerate(lens):
    if b not in case.invalid and n > 0:
      pos = np.arange(n)
      seen[bt[b, pos // s], pos % s] = True
  kv = kv.copy()
  kv[~seen] = np.nan

  for b, how in case.invalid.items():
    if how == "negative":
      lens[b] = -int(rng.integers(1, 5))
    elif how == "past_table":
      lens[b] = cols * s + int(rng.integers(1, 3))
    else:  # a live page id outside the cache (a request with no live page has none to spoil)
      if lens[b] <= 0:
        lens[b] = 1
      bt[b, int(rng.integers(0, -(-lens[b] // s)))] = int(rng.choice([-1, num_pages, num_pages + 9]))

  plan = make_plan("xla", case.heads, s, case.q_len, case.causal)
  ref_out, ref_lse = reference_paged_decode(query.astype(np.float32), kv.astype(np.float32), bt, lens, plan,
                                            kv_scale=1.0 if kv_scale is None else float(kv_scale))
  return query, kv, bt, lens, kv_scale, ref_out, ref_lse


def _layouts(case: Case, query, kv):
  q = query if case.q_axis else query[:, 0]
  if case.q_layout == "pair":
    q = (np.ascontiguousarray(q[..., :DN]), np.ascontiguousarray(q[..., DN:]))
  if case.kv_layout == "pair":
    kv = (np.ascontiguousarray(kv[..., :DN]), np.ascontiguousarray(kv[..., DN:]))
  return q, kv


def run_case(backend: str, case: Case) -> None:
  query, kv, bt, lens, kv_scale, ref_out, ref_lse = build(case)
  q, cache = _layouts(case, query, kv)
  plan = make_plan(backend, case.heads, case.page_size, case.q_len, case.causal)
  kwargs = {} if kv_scale is None else {"kv_scale": kv_scale}
  if backend == "cuda" and case.kernel != "auto":
    forced = dataclasses.replace(plan, kernel=case.kernel)
    try:
      mla_jax.explain(forced, q, cache, bt, lens, **kwargs)
      plan = forced
    except ValueError:  # this kernel cannot serve the call: auto
      pass
  out, lse = run_decode(backend, q, cache, bt, lens, plan, return_lse=True, **kwargs)
  if not case.q_axis:
    ref_out, ref_lse = ref_out[:, 0], ref_lse[:, 0]
  assert_matches_reference(out, lse, ref_out, ref_lse, jnp.dtype(query.dtype))


def test_draw_covers_the_space():
  # The generator reaches every value of each categorical axis within the
  # default CPU run, so a quiet run means they were all exercised.
  cases = [draw(DEFAULT_SEED + i) for i in range(DEFAULT_CASES["cpu"])]
  for field, want in (("dtype", {"bf16", "fp16", "fp8"}), ("q_layout", {"packed", "pair"}),
                      ("kv_layout", {"packed", "pair"}), ("q_len", {1, 2, 3, 4, 8}), ("causal", {True, False}),
                      ("page_size", {1, 2, 4, 8, 16, 32, 64, 128, 256}), ("spare_fill", {"-1", "junk"})):
    assert {getattr(c, field) for c in cases} == want, field
  assert {h for c in cases for h in c.invalid.values()} == {"negative", "past_table", "bad_page"}
  assert any(0 in c.seq_lens for c in cases) and any(not c.q_axis for c in cases)


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_cases_match_reference(backend, request):
  n = request.config.getoption("--differential-cases") or DEFAULT_CASES[backend]
  base = request.config.getoption("--differential-seed")
  base = DEFAULT_SEED if base is None else base
  failures = []
  for i in range(n):
    case = draw(base + i)
    try:
      run_case(backend, case)
    except Exception as e:  # noqa: BLE001 - every failing seed is reported, whatever failed
      first = (str(e).splitlines() or [""])[0]
      failures.append((case.seed, f"seed {case.seed}: {type(e).__name__}: {first}\n    {case.describe()}"))
  assert not failures, (f"{len(failures)} of {n} cases failed, seeds {[f[0] for f in failures]}:\n"
                        + "\n".join(f[1] for f in failures[:20]))
