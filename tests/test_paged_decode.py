"""Numerics of mla_jax.paged_decode against the float64 NumPy reference.

Every backend ("cpu", "xla", and "cuda" on a GPU machine) is compared with
:func:`mla_jax.testing.reference_paged_decode` evaluated on the *rounded*
inputs (the bf16/fp16 arrays cast back to float32), on fresh random data.

Checks made on every result (``assert_matches_reference``):
  * shapes and dtypes;
  * the NaN pattern of out and lse equals the reference's exactly (NaN only
    for invalid requests), lse is -inf exactly where nothing is visible and
    out is exactly 0 there, every other element is finite;
  * ||out - ref|| / ||ref|| <= 1e-2 over the valid rows, and per row <= 2e-2
    (so that one wrong row among many cannot hide in the global norm);
  * |lse - ref_lse| <= 2e-2 where finite.

The CPU kernel is scalar C++ and CI has 2 cores: the cases are chosen
(not the full cross product) and big head counts use short sequences.
"""

from __future__ import annotations

import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import mla_jax
from mla_jax.testing import random_paged_inputs, reference_paged_decode



def _has_gpu() -> bool:
  try:
    return len(jax.devices("cuda")) > 0
  except RuntimeError:
    return False


HAS_GPU = _has_gpu()

DN, DR = 512, 64
D = DN + DR
SM_SCALE = 1.0 / np.sqrt(192.0)  # DeepSeek-V3's softmax scale

GPU = pytest.mark.gpu
BACKENDS = ["cpu", "xla", pytest.param("cuda", marks=GPU)]
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}

OUT_REL_TOL = 1e-2      # global relative error over valid rows
ROW_REL_TOL = 2e-2      # worst single row
LSE_ABS_TOL = 2e-2


# --- helpers ------------------------------------------------------------------
def device_for(backend: str):
  """The device a backend's inputs must live on.

  The CPU custom call is registered for the CPU platform only: on a GPU
  machine backend "cpu" must run on the CPU device.
  """
  if backend == "cpu":
    return jax.devices("cpu")[0]
  if backend == "cuda":
    return jax.devices("cuda")[0]
  return jax.devices()[0]


def run_decode(backend, query, kv_cache, block_table, seq_lens, plan, *, fn=None, **kwargs):
  """Runs paged_decode (or ``fn`` with its signature) on ``backend``'s device."""
  fn = mla_jax.paged_decode if fn is None else fn
  dev = device_for(backend)
  args = jax.device_put((query, kv_cache, block_table, seq_lens), dev)
  with jax.default_device(dev):
    res = fn(*args, plan=plan, **kwargs)
    return jax.block_until_ready(res)


def make_plan(backend, num_heads, page_size, q_len=1, causal=True):
  return mla_jax.DecodePlan(num_heads=num_heads, page_size=page_size, sm_scale=SM_SCALE,
                            q_len=q_len, causal=causal, backend=backend)


class Case:
  """Random paged inputs rounded to ``dtype`` and their float64 reference."""

  def __init__(self, seed, seq_lens, *, num_heads, page_size, q_len=1, dtype=jnp.bfloat16,
               scatter=True, extra_pages=3, causal=True, table_width=None):
    rng = np.random.default_rng(seed)
    d = random_paged_inputs(rng, seq_lens, num_heads=num_heads, page_size=page_size,
                            q_len=q_len, scatter=scatter, extra_pages=extra_pages)
    bt = d["block_table"]
    if table_width is not None and table_width > bt.shape[1]:  # unused entries: -1
      bt = np.concatenate([bt, np.full((bt.shape[0], table_width - bt.shape[1]), -1, np.int32)], 1)
    self.query = d["query"].astype(dtype)          # [B, Q, H, 576] rounded
    self.kv_cache = d["kv_cache"].astype(dtype)    # [P, S, 576] rounded
    self.block_table = np.ascontiguousarray(bt, np.int32)
    self.seq_lens = np.asarray(d["seq_lens"], np.int32)
    self.dtype = jnp.dtype(dtype)
    self.q_len, self.num_heads, self.page_size, self.causal = q_len, num_heads, page_size, causal
    assert np.all(np.isfinite(self.query.astype(np.float32)))
    assert np.any(self.query.astype(np.float32) != 0) and np.any(self.kv_cache.astype(np.float32) != 0)

  def plan(self, backend):
    return make_plan(backend, self.num_heads, self.page_size, self.q_len, self.causal)

  def query_as(self, layout: str, with_q_axis: bool = True):
    q = self.query if with_q_axis else self.query[:, 0]
    if layout == "packed":
      return q
    return (np.ascontiguousarray(q[..., :DN]), np.ascontiguousarray(q[..., DN:]))

  def cache_as(self, layout: str):
    if layout == "packed":
      return self.kv_cache
    return (np.ascontiguousarray(self.kv_cache[..., :DN]),
            np.ascontiguousarray(self.kv_cache[..., DN:]))

  def reference(self, block_table=None, seq_lens=None, kv_cache=None):
    """float64 (out [B, Q, H, 512], lse [B, Q, H]) on the rounded inputs."""
    kv = self.kv_cache if kv_cache is None else kv_cache
    plan = make_plan("xla", self.num_heads, self.page_size, self.q_len, self.causal)
    return reference_paged_decode(
        self.query.astype(np.float32), kv.astype(np.float32),
        self.block_table if block_table is None else block_table,
        self.seq_lens if seq_lens is None else seq_lens, plan)


def assert_matches_reference(out, lse, ref_out, ref_lse, dtype):
  """The comparison every numerics test makes (see the module docstring)."""
  assert out.dtype == jnp.dtype(dtype), out.dtype
  chex.assert_shape(out, ref_out.shape)
  out = np.asarray(out.astype(jnp.float32), np.float64)
  ref_out = np.asarray(ref_out, np.float64)
  ref_nan = np.isnan(ref_out)
  np.testing.assert_array_equal(np.isnan(out), ref_nan, err_msg="NaN pattern of out")
  valid = ~ref_nan
  assert np.all(np.isfinite(out[valid])), "non-finite out element in a valid row"

  if lse is not None:
    assert lse.dtype == jnp.float32, lse.dtype
    chex.assert_shape(lse, ref_lse.shape)
    lse = np.asarray(lse, np.float64)
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse), err_msg="NaN pattern of lse")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse),
                                  err_msg="-inf pattern of lse")
    assert not np.any(np.isposinf(lse)), "lse is +inf somewhere"
    fin = np.isfinite(ref_lse)
    if fin.any():
      err = np.abs(lse[fin] - ref_lse[fin]).max()
      assert err <= LSE_ABS_TOL, f"lse abs error {err:.3g} > {LSE_ABS_TOL}"

  # Rows with nothing visible: out exactly 0 (the reference gives 0 there).
  empty = np.all(ref_out == 0, axis=-1) & ~np.isnan(ref_out).any(-1)
  assert np.all(out[empty] == 0), "out is not 0 for a row with no visible position"

  rows_ref = ref_out.reshape(-1, ref_out.shape[-1])
  rows_out = out.reshape(-1, out.shape[-1])
  rows = ~np.isnan(rows_ref).any(-1) & np.any(rows_ref != 0, -1)
  if rows.any():
    diff = rows_out[rows] - rows_ref[rows]
    rel = np.linalg.norm(diff) / np.linalg.norm(rows_ref[rows])
    assert rel <= OUT_REL_TOL, f"relative error {rel:.3g} > {OUT_REL_TOL}"
    row_rel = np.linalg.norm(diff, axis=-1) / np.linalg.norm(rows_ref[rows], axis=-1)
    worst = row_rel.max()
    assert worst <= ROW_REL_TOL, f"worst row relative error {worst:.3g} > {ROW_REL_TOL}"


def lengths_around(page_size, table_pages):
  """0, 1, page_size - 1, page_size, page_size + 1 and a full table."""
  lens = [0, 1, page_size - 1, page_size, page_size + 1, table_pages * page_size]
  return sorted(set(lens))


# --- tests ----------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_layout", ["packed", "tuple"])
@pytest.mark.parametrize("kv_layout", ["packed", "tuple"])
@pytest.mark.parametrize("q_form", ["BHD", "BQHD_q1", "BQHD_q2"])
def test_layouts(backend, q_layout, kv_layout, q_form):
  """Query [B,H,576] / [B,Q,H,576] / (q_nope, q_pe) x cache packed / (ckv, kpe)."""
  q_len = 2 if q_form == "BQHD_q2" else 1
  with_q_axis = q_form != "BHD"
  seed = zlib.crc32(f"{q_layout}/{kv_layout}/{q_form}".encode())
  case = Case(seed, [0, 1, 15, 16, 17, 40],
              num_heads=16, page_size=16, q_len=q_len)
  plan = case.plan(backend)
  out, lse = run_decode(backend, case.query_as(q_layout, with_q_axis), case.cache_as(kv_layout),
                        case.block_table, case.seq_lens, plan, return_lse=True)
  ref_out, ref_lse = case.reference()
  if not with_q_axis:  # the Q axis is present exactly when the query had one
    ref_out, ref_lse = ref_out[:, 0], ref_lse[:, 0]
  assert_matches_reference(out, lse, ref_out, ref_lse, case.dtype)


# (num_heads, page_size, q_len, dtype): the head counts and page sizes of the
# issue, with short sequences for the big head counts.
HEAD_PAGE_CASES = [
    (1, 1, 1, "bf16"),
    (1, 256, 2, "fp16"),
    (12, 16, 1, "bf16"),
    (16, 64, 2, "bf16"),
    (64, 256, 1, "bf16"),
    (96, 16, 1, "fp16"),
    (128, 1, 1, "bf16"),
    (128, 64, 2, "bf16"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_heads,page_size,q_len,dtype", HEAD_PAGE_CASES)
def test_heads_and_page_sizes(backend, num_heads, page_size, q_len, dtype):
  table_pages = 2 if page_size >= 64 else 3 if page_size > 1 else 4
  lens = lengths_around(page_size, table_pages)
  case = Case(num_heads * 1000 + page_size, lens, num_heads=num_heads, page_size=page_size,
              q_len=q_len, dtype=DTYPES[dtype])
  # The longest request fills its whole table.
  assert case.block_table.shape[1] * page_size == max(lens)
  plan = case.plan(backend)
  query = case.query if q_len > 1 else case.query[:, 0]
  out, lse = run_decode(backend, query, case.kv_cache, case.block_table, case.seq_lens, plan,
                        return_lse=True)
  ref_out, ref_lse = case.reference()
  if q_len == 1:
    ref_out, ref_lse = ref_out[:, 0], ref_lse[:, 0]
  assert_matches_reference(out, lse, ref_out, ref_lse, case.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_len,causal", [(1, True), (2, True), (4, True), (4, False),
                                          (8, True)])
def test_q_len_and_causality(backend, q_len, causal):
  """Lengths around q_len: some causal query tokens see nothing (lse -inf)."""
  lens = [0, 1, 2, 3, 4, 5, 9, 16, 17, 33]
  case = Case(100 + q_len + 10 * causal, lens, num_heads=8, page_size=16, q_len=q_len,
              causal=causal)
  plan = case.plan(backend)
  out, lse = run_decode(backend, case.query, case.kv_cache, case.block_table, case.seq_lens,
                        plan, return_lse=True)
  ref_out, ref_lse = case.reference()
  if causal and q_len > 1:  # the test is about partially visible requests
    assert np.isneginf(ref_lse[1]).any() and np.isfinite(ref_lse[1]).any()
  if not causal:  # every token of a non-empty request sees all of it
    assert np.all(np.isfinite(ref_lse[1:]))
  assert_matches_reference(out, lse, ref_out, ref_lse, case.dtype)


def test_causality_changes_the_result():
  """causal=True and False differ for q_len > 1 (the flag is honoured)."""
  case = Case(7, [5, 20], num_heads=4, page_size=16, q_len=4)
  outs = [run_decode("cpu", case.query, case.kv_cache, case.block_table, case.seq_lens,
                     make_plan("cpu", 4, 16, 4, causal), return_lse=True)[1]
          for causal in (True, False)]
  # The last query token sees everything in both cases; the others differ.
  np.testing.assert_allclose(outs[0][:, -1], outs[1][:, -1], rtol=1e-5)
  assert np.all(np.asarray(outs[0][:, :-1]) < np.asarray(outs[1][:, :-1]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["packed", "tuple"])
def test_dtypes(backend, dtype, layout):
  case = Case(11 + (dtype == "fp16"), [3, 31, 32, 50, 1], num_heads=16, page_size=32, q_len=2,
              dtype=DTYPES[dtype])
  plan = case.plan(backend)
  out, lse = run_decode(backend, case.query_as(layout), case.cache_as(layout), case.block_table,
                        case.seq_lens, plan, return_lse=True)
  ref_out, ref_lse = case.reference()
  assert_matches_reference(out, lse, ref_out, ref_lse, case.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scatter", [True, False], ids=["scattered", "contiguous"])
def test_page_tables(backend, scatter):
  """Scattered and contiguous page tables; a table wider than needed."""
  case = Case(21 + scatter, [17, 0, 64, 35, 1, 48], num_heads=8, page_size=16, q_len=1,
              scatter=scatter, table_width=7)
  if not scatter:
    live = case.block_table[case.block_table >= 0]
    np.testing.assert_array_equal(live, np.arange(live.size))
  plan = case.plan(backend)
  out, lse = run_decode(backend, case.query, case.kv_cache, case.block_table, case.seq_lens,
                        plan, return_lse=True)
  ref_out, ref_lse = case.reference()
  assert_matches_reference(out, lse, ref_out, ref_lse, case.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_len", [1, 2])
def test_unused_slots_and_entries_are_never_read(backend, q_len):
  """NaN past seq_len in the last page and garbage in unused table entries.

  Unused table entries hold -1, huge or negative garbage, and ids of pages
  that are entirely NaN; the result must equal the clean run bit for bit
  and match the reference.
  """
  page_size = 16
  lens = [0, 1, 15, 16, 17, 40, 33]
  case = Case(31 + q_len, lens, num_heads=8, page_size=page_size, q_len=q_len, extra_pages=4,
              table_width=5)
  plan = case.plan(backend)
  clean = run_decode(backend, case.query, case.kv_cache, case.block_table, case.seq_lens, plan,
                     return_lse=True)

  kv = case.kv_cache.copy()
  bt = case.block_table.copy()
  used = set(int(i) for i in bt[bt >= 0])
  nan_pages = [p for p in range(kv.shape[0]) if p not in used]
  assert len(nan_pages) == 4
  kv[nan_pages] = np.nan
  num_pages = kv.shape[0]
  garbage = [-1, num_pages, 2**31 - 1, -2**31, -7, nan_pages[0], nan_pages[1], 10**6]
  k = 0
  for b, n in enumerate(case.seq_lens):
    live = -(-int(n) // page_size)
    if n % page_size:  # NaN in the unused slots of the last page
      kv[bt[b, live - 1], n % page_size:] = np.nan
    for j in range(live, bt.shape[1]):
      bt[b, j] = garbage[k % len(garbage)]
      k += 1
  assert np.isnan(kv.astype(np.float32)).any()
  poisoned = run_decode(backend, case.query, kv, bt, case.seq_lens, plan, return_lse=True)

  ref_out, ref_lse = case.reference()
  assert_matches_reference(*poisoned, ref_out, ref_lse, case.dtype)
  chex.assert_trees_all_equal(jax.device_get(poisoned), jax.device_get(clean))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_len", [1, 2])
def test_invalid_requests_are_nan(backend, q_len):
  """Bad lengths / live page ids: that request's out and lse are NaN, others exact."""
  page_size = 16
  base = [20, 20, 20, 20, 20, 20, 20, 20, 20, 5]
  case = Case(41 + q_len, base, num_heads=8, page_size=page_size, q_len=q_len, extra_pages=2)
  num_pages, width = case.kv_cache.shape[0], case.block_table.shape[1]
  assert width == 2
  bt, sl = case.block_table.copy(), case.seq_lens.copy()
  bad = {
      1: "negative live page id",
      2: "live page id == num_pages",
      3: "live page id huge",
      4: "seq_len > max_pages_per_seq * page_size",
      5: "negative seq_len",
      6: "seq_len = INT32_MIN",
      7: "seq_len = INT32_MAX",
      8: "negative id in the last live page",
  }
  bt[1, 0] = -1
  bt[2, 1] = num_pages
  bt[3, 0] = 2**31 - 1
  sl[4] = width * page_size + 1
  sl[5] = -1
  sl[6] = -2**31
  sl[7] = 2**31 - 1
  bt[8, 1] = -2**31
  plan = case.plan(backend)
  out, lse = run_decode(backend, case.query, case.kv_cache, bt, sl, plan, return_lse=True)
  ref_out, ref_lse = case.reference(block_table=bt, seq_lens=sl)
  expect_nan = np.zeros(len(base), bool)
  expect_nan[list(bad)] = True
  np.testing.assert_array_equal(np.isnan(ref_lse).all(axis=(1, 2)), expect_nan)
  assert_matches_reference(out, lse, ref_out, ref_lse, case.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_q_axis", [False, True])
def test_return_lse_false(backend, with_q_axis):
  q_len = 1 if not with_q_axis else 2
  case = Case(51, [9, 30], num_heads=4, page_size=16, q_len=q_len)
  plan = case.plan(backend)
  query = case.query if with_q_axis else case.query[:, 0]
  out = run_decode(backend, query, case.kv_cache, case.block_table, case.seq_lens, plan)
  assert isinstance(out, jax.Array), type(out)
  want = (2, q_len, 4, DN) if with_q_axis else (2, 4, DN)
  chex.assert_shape(out, want)
  out2, lse = run_decode(backend, query, case.kv_cache, case.block_table, case.seq_lens, plan,
                         return_lse=True)
  chex.assert_shape(lse, want[:-1])
  chex.assert_trees_all_equal(out, out2)
  ref_out, ref_lse = case.reference()
  if not with_q_axis:
    ref_out, ref_lse = ref_out[:, 0], ref_lse[:, 0]
  assert_matches_reference(out, None, ref_out, ref_lse, case.dtype)


def test_auto_backend():
  """backend "auto" on the default device (cuda kernel or cpu kernel)."""
  case = Case(61, [0, 7, 40], num_heads=16, page_size=16, q_len=2)
  plan = case.plan("auto")
  out, lse = mla_jax.paged_decode(case.query, case.kv_cache, case.block_table, case.seq_lens,
                                  plan=plan, return_lse=True)
  ref_out, ref_lse = case.reference()
  assert_matches_reference(out, lse, ref_out, ref_lse, case.dtype)


def test_backends_agree():
  """cpu and xla agree with each other more tightly than with the tolerance."""
  case = Case(71, [1, 16, 45], num_heads=16, page_size=16, q_len=2)
  res = {b: run_decode(b, case.query, case.kv_cache, case.block_table, case.seq_lens,
                       case.plan(b), return_lse=True) for b in ("cpu", "xla")}
  np.testing.assert_allclose(res["cpu"][1], res["xla"][1], atol=1e-4, rtol=0)
  chex.assert_trees_all_close(res["cpu"][0].astype(jnp.float32), res["xla"][0].astype(jnp.float32),
                              atol=2e-2, rtol=2e-2)


# --- chex variants: the op called directly and inside an outer jit -------------
class VariantsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      dict(testcase_name="cpu", backend="cpu"),
      dict(testcase_name="xla", backend="xla"),
      dict(testcase_name="cuda", backend="cuda"),
  )
  def test_matches_reference(self, backend):
    # (A chex.TestCase cannot carry the per-case `gpu` marker; skip here.)
    if backend == "cuda" and not HAS_GPU:
      self.skipTest("needs a CUDA GPU")
    case = Case(81, [0, 1, 16, 17, 50], num_heads=12, page_size=16, q_len=2)
    plan = case.plan(backend)

    @self.variant
    def decode(query, kv_cache, block_table, seq_lens):
      return mla_jax.paged_decode(query, kv_cache, block_table, seq_lens, plan=plan,
                                  return_lse=True)

    out, lse = run_decode(backend, case.query_as("tuple"), case.cache_as("packed"),
                          case.block_table, case.seq_lens, None,
                          fn=lambda *a, plan: decode(*a))
    ref_out, ref_lse = case.reference()
    assert_matches_reference(out, lse, ref_out, ref_lse, case.dtype)


@pytest.mark.parametrize("backend", ["auto", "cpu", "xla"])
def test_empty_batch_table_and_cache(backend):
  """B = 0, a table with no columns, and a cache with no pages: nothing to
  read, so B = 0 gives empty results and the others give out 0 / lse -inf
  for an empty request and NaN for one that claims tokens."""
  plan = mla_jax.DecodePlan(num_heads=4, page_size=16, sm_scale=SM_SCALE, backend=backend)
  if backend == "auto" and HAS_GPU:
    pytest.skip("auto picks cuda here; this checks the CPU-side paths")
  dev = jax.devices("cpu")[0]
  q = jnp.ones((2, 4, D), jnp.bfloat16)
  kv = jnp.zeros((3, 16, D), jnp.bfloat16)
  with jax.default_device(dev):
    out, lse = mla_jax.paged_decode(q[:0], kv, np.zeros((0, 2), np.int32), np.zeros(0, np.int32),
                                    plan=plan, return_lse=True)
    assert out.shape == (0, 4, DN) and lse.shape == (0, 4)
    lens = np.array([0, 3], np.int32)
    for cache, table in ((kv, np.zeros((2, 0), np.int32)), (kv[:0], np.zeros((2, 2), np.int32))):
      out, lse = mla_jax.paged_decode(q, cache, table, lens, plan=plan, return_lse=True)
      out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
      assert (out[0] == 0).all() and np.isneginf(lse[0]).all()
      assert np.isnan(out[1]).all() and np.isnan(lse[1]).all()


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_equal_latent_and_rope_widths(backend):
  """kv_lora_rank == qk_rope_head_dim: split operands have equal widths, yet
  they are not packed ones; both forms must give the same result."""
  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.standard_normal((2, 2, 128)), jnp.bfloat16)
  c = jnp.asarray(rng.standard_normal((4, 4, 128)), jnp.bfloat16)
  bt, sl = np.array([[0, 1], [2, 3]], np.int32), np.array([5, 8], np.int32)
  plan = mla_jax.DecodePlan(num_heads=2, page_size=4, sm_scale=0.1, kv_lora_rank=64,
                            qk_rope_head_dim=64, backend=backend)
  with jax.default_device(jax.devices("cpu")[0]):
    packed = mla_jax.paged_decode(q, c, bt, sl, plan=plan)
    split = mla_jax.paged_decode((q[..., :64], q[..., 64:]), (c[..., :64], c[..., 64:]), bt, sl,
                                 plan=plan)
  np.testing.assert_array_equal(np.asarray(packed.astype(jnp.float32)),
                                np.asarray(split.astype(jnp.float32)))
  ref, _ = reference_paged_decode(np.asarray(q.astype(jnp.float32))[:, None], np.asarray(
      c.astype(jnp.float32)), bt, sl, plan)
  np.testing.assert_allclose(np.asarray(packed.astype(jnp.float32)), ref[:, 0], atol=3e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_overflowing_score_gets_weight_zero(backend):
  """A q.k that overflows float32 to -inf (here at a request's first
  position, the first score its row sees) has weight 0, as in the float64
  reference, instead of turning the row into NaN."""
  rng = np.random.default_rng(7)
  d = random_paged_inputs(rng, [40, 20], num_heads=4, page_size=16)
  q, kv = d["query"].copy(), d["kv_cache"].copy()
  kv[..., DN] = 0.0                              # kpe feature 0 is 0 everywhere ...
  kv[d["block_table"][0, 0], 0, DN] = 1e30       # ... but at request 0's position 0,
  q[0, :, :, DN] = -1e30                         # where q_pe . kpe is about -1e60
  q, kv = q.astype(jnp.bfloat16), kv.astype(jnp.bfloat16)
  plan = make_plan(backend, num_heads=4, page_size=16)
  out, lse = run_decode(backend, q[:, 0], kv, d["block_table"], d["seq_lens"], plan, return_lse=True)
  ref_out, ref_lse = reference_paged_decode(np.asarray(q.astype(jnp.float32)),
                                            np.asarray(kv.astype(jnp.float32)), d["block_table"],
                                            d["seq_lens"], plan)
  assert np.isfinite(ref_lse).all()
  assert_matches_reference(out, lse, ref_out[:, 0], ref_lse[:, 0], jnp.bfloat16)
