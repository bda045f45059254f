"""CUDA-kernel specific checks: every tile config, split paths, FP8, determinism.

Each case poisons the device allocator with NaN first (so an output element
the kernels forget to write shows up as NaN) and compares to the float64
reference on fresh random data.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mla_jax
from mla_jax.testing import random_paged_inputs, reference_paged_decode

pytestmark = pytest.mark.gpu

SM_SCALE = 1 / 192**0.5
KernelChoice = mla_jax.KernelChoice


def cuda_num_parts(rows):
  """Partitions the schedule uses on the visible GPU for `rows` query rows."""
  return mla_jax.kernels.workspace_parts(rows, mla_jax.kernels.visible_cuda_device())


def _hopper_kernels_available():
  device = mla_jax.kernels.visible_cuda_device()
  return device is not None and device.arch // 10 == 9 and mla_jax._ffi.ext().has_sm90a()


def _poison_allocator():
  # Fill (then free) a large block so fresh XLA buffers start as NaN.
  x = jnp.full((64 << 20,), jnp.nan, jnp.float32)
  x.block_until_ready()
  del x


def _run(d, plan, dtype, *, kv_dtype=None, kv_scale=None):
  q = jnp.asarray(d["query"], dtype)
  kv = jnp.asarray(d["kv_cache"], kv_dtype or dtype)
  scale = None if kv_scale is None else jnp.float32(kv_scale)
  _poison_allocator()
  out, lse = mla_jax.paged_decode(q, kv, jnp.asarray(d["block_table"]), jnp.asarray(d["seq_lens"]),
                                  plan=plan, return_lse=True, kv_scale=scale)
  ref_out, ref_lse = reference_paged_decode(np.asarray(q.astype(jnp.float32)),
                                            np.asarray(kv.astype(jnp.float32)), d["block_table"],
                                            d["seq_lens"], plan, kv_scale=kv_scale or 1.0)
  return np.asarray(out.astype(jnp.float32)), np.asarray(lse), ref_out, ref_lse


def _check(out, lse, ref_out, ref_lse, tol=1e-2):
  bad = np.isnan(ref_lse)
  np.testing.assert_array_equal(np.isnan(lse), bad, err_msg="NaN pattern of lse")
  assert np.all(np.isnan(out[bad])), "invalid requests must give NaN out"
  ok = ~bad
  assert np.all(np.isfinite(out[ok])), "non-finite output in a valid row"
  denom = max(np.linalg.norm(ref_out[ok]), 1e-6)
  rel = np.linalg.norm(out[ok] - ref_out[ok]) / denom
  assert rel <= tol, f"relative error {rel:.3g} > {tol}"
  np.testing.assert_array_equal(np.isneginf(lse[ok]), np.isneginf(ref_lse[ok]))
  fin = np.isfinite(ref_lse) & ok
  np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=2e-2, rtol=1e-3)
  return rel


def _worst_row_error(out, ref_out, ref_lse):
  """Largest relative error of one output row among the rows with a finite, nonzero reference."""
  ok = np.isfinite(ref_lse) & ~np.isneginf(ref_lse)
  norms = np.linalg.norm(ref_out[ok], axis=-1)
  return (np.linalg.norm(out[ok] - ref_out[ok], axis=-1)[norms > 0] / norms[norms > 0]).max()


@pytest.mark.parametrize("heads", [1, 12, 16, 32, 64, 96, 128])
@pytest.mark.parametrize("q_len", [1, 2])
def test_row_block_configs(heads, q_len):
  rng = np.random.default_rng(heads * 10 + q_len)
  lens = [0, 1, 63, 64, 65, 700, 3000]
  d = random_paged_inputs(rng, lens, num_heads=heads, page_size=64, q_len=q_len)
  plan = mla_jax.DecodePlan(num_heads=heads, page_size=64, sm_scale=SM_SCALE, q_len=q_len,
                            backend="cuda")
  _check(*_run(d, plan, jnp.bfloat16))


@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_page_sizes_and_dtypes(page_size, dtype):
  rng = np.random.default_rng(page_size)
  lens = [page_size - 1 if page_size > 1 else 1, page_size, page_size + 1, 1500]
  d = random_paged_inputs(rng, lens, num_heads=16, page_size=page_size, q_len=1)
  plan = mla_jax.DecodePlan(num_heads=16, page_size=page_size, sm_scale=SM_SCALE, backend="cuda")
  _check(*_run(d, plan, dtype))


@pytest.mark.parametrize("max_num_splits", [None, 1, 3])
def test_long_single_request_splits(max_num_splits):
  rng = np.random.default_rng(7)
  d = random_paged_inputs(rng, [20000], num_heads=128, page_size=64, q_len=1)
  plan = mla_jax.DecodePlan(num_heads=128, page_size=64, sm_scale=SM_SCALE, backend="cuda",
                            max_num_splits=max_num_splits)
  _check(*_run(d, plan, jnp.bfloat16))


def test_requests_across_scheduler_chunks():
  # More requests than the scheduler's 256-thread chunk: request metadata,
  # items and their split cuts carry over from chunk to chunk, and long
  # requests in the first, second and third chunk are split.
  rng = np.random.default_rng(13)
  lens = rng.integers(0, 300, size=600)
  lens[[3, 299, 598]] = [9000, 7000, 12000]
  d = random_paged_inputs(rng, lens, num_heads=16, page_size=64)
  plan = mla_jax.DecodePlan(num_heads=16, page_size=64, sm_scale=SM_SCALE, backend="cuda")
  _check(*_run(d, plan, jnp.bfloat16))


def test_mtp_causal_split():
  rng = np.random.default_rng(11)
  d = random_paged_inputs(rng, [1, 2, 3, 9000, 64], num_heads=16, page_size=64, q_len=4)
  plan = mla_jax.DecodePlan(num_heads=16, page_size=64, sm_scale=SM_SCALE, q_len=4, backend="cuda")
  _check(*_run(d, plan, jnp.bfloat16))


def test_bad_inputs_give_nan_rows_even_when_split():
  rng = np.random.default_rng(3)
  d = random_paged_inputs(rng, [9000, 9000, 100, 100, 50], num_heads=16, page_size=64)
  d["block_table"][0, 100] = d["kv_cache"].shape[0] + 5     # out of range, live, in a split request
  d["block_table"][2, 0] = -7                               # negative live page id
  d["seq_lens"][3] = d["block_table"].shape[1] * 64 + 1     # over-long
  d["seq_lens"][4] = -3                                     # negative
  plan = mla_jax.DecodePlan(num_heads=16, page_size=64, sm_scale=SM_SCALE, backend="cuda")
  out, lse, ref_out, ref_lse = _run(d, plan, jnp.bfloat16)
  assert np.isnan(ref_lse[[0, 2, 3, 4]]).all() and np.isfinite(ref_lse[1]).all()
  _check(out, lse, ref_out, ref_lse)


def test_fp8_cache():
  rng = np.random.default_rng(5)
  d = random_paged_inputs(rng, [1, 500, 5000], num_heads=64, page_size=64)
  plan = mla_jax.DecodePlan(num_heads=64, page_size=64, sm_scale=SM_SCALE, backend="cuda")
  _check(*_run(d, plan, jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn, kv_scale=0.37), tol=2e-2)


def test_split_layouts_match_packed_bitwise():
  rng = np.random.default_rng(9)
  d = random_paged_inputs(rng, [300, 4000], num_heads=16, page_size=64)
  plan = mla_jax.DecodePlan(num_heads=16, page_size=64, sm_scale=SM_SCALE, backend="cuda")
  q = jnp.asarray(d["query"][:, 0], jnp.bfloat16)
  kv = jnp.asarray(d["kv_cache"], jnp.bfloat16)
  args = (jnp.asarray(d["block_table"]), jnp.asarray(d["seq_lens"]))
  packed = mla_jax.paged_decode(q, kv, *args, plan=plan)
  split = mla_jax.paged_decode((q[..., :512], q[..., 512:]), (kv[..., :512], kv[..., 512:]), *args,
                               plan=plan)
  np.testing.assert_array_equal(np.asarray(packed.astype(jnp.float32)), np.asarray(split.astype(jnp.float32)))


def test_deterministic_and_matches_cpu_backend():
  rng = np.random.default_rng(13)
  lens = rng.integers(1, 6000, size=24).astype(np.int32)
  d = random_paged_inputs(rng, lens, num_heads=128, page_size=64)
  plan = mla_jax.DecodePlan(num_heads=128, page_size=64, sm_scale=SM_SCALE, backend="cuda")
  q = jnp.asarray(d["query"][:, 0], jnp.bfloat16)
  kv = jnp.asarray(d["kv_cache"], jnp.bfloat16)
  bt, sl = jnp.asarray(d["block_table"]), jnp.asarray(d["seq_lens"])
  runs = []
  for _ in range(3):
    _poison_allocator()
    runs.append(np.asarray(mla_jax.paged_decode(q, kv, bt, sl, plan=plan).astype(jnp.float32)))
  for r in runs[1:]:
    np.testing.assert_array_equal(r, runs[0])


@pytest.fixture(params=["default", "scheduler_kernel", "lockstep", "portable"])
def kernel_choice(request):
  """Runs a test with each kernel that can serve 64-row blocks on sm_90,
  forced through the plan: the default (the seesaw wgmma kernel where the
  cache loads with TMA, i.e. page_size a multiple of 64, else the lock-step
  wgmma kernel; its own schedule up to 32 requests, above that the op's
  schedule call, schedule "step"), schedule "kernel"
  (the same with the scheduler kernel before each decode), "sm90_lockstep"
  (the lock-step kernel everywhere, TMA or cp.async loads; fewer than 64
  rows in one zero-filled block) and "portable" (the
  mma.sync kernel). Yields rows -> KernelChoice for a call with `rows`
  query rows per request (q_len x heads)."""
  if request.param == "lockstep" and not _hopper_kernels_available():
    pytest.skip("the lock-step kernel needs an sm_90 GPU and a build with sm_90a code")
  choices = {
      "default": lambda rows: KernelChoice(),
      "scheduler_kernel": lambda rows: KernelChoice(schedule="kernel"),
      "lockstep": lambda rows: KernelChoice(kernel="sm90_lockstep"),
      "portable": lambda rows: KernelChoice(kernel="portable"),
  }
  return choices[request.param]


@pytest.mark.parametrize("heads,q_len,page_size,dtype", [
    (128, 1, 1, jnp.bfloat16),
    (128, 1, 16, jnp.float16),
    (96, 1, 256, jnp.bfloat16),
    (64, 4, 64, jnp.float16),
    (128, 2, 32, jnp.bfloat16),
    (33, 1, 64, jnp.bfloat16),
    (16, 1, 64, jnp.bfloat16),   # fewer than 64 rows: one zero-filled 64-row block on sm_90
    (1, 2, 256, jnp.float16),
])
def test_64_row_blocks_both_kernels(kernel_choice, heads, q_len, page_size, dtype):
  rng = np.random.default_rng(heads + 7 * q_len + page_size)
  lens = [0, 1, q_len, 63, 64, 65, max(page_size - 1, 1), page_size + 1, 2500, 11000]
  d = random_paged_inputs(rng, lens, num_heads=heads, page_size=page_size, q_len=q_len)
  plan = mla_jax.DecodePlan(num_heads=heads, page_size=page_size, sm_scale=SM_SCALE, q_len=q_len,
                            backend="cuda", kernel=kernel_choice(heads * q_len))
  _check(*_run(d, plan, dtype))


def _check_same_bits_with_scheduler_kernel(d, plan, own="block"):
  # The decode kernel's own schedule (`own`: "inline" or "block", computed by
  # the seesaw CTAs on sm_90; elsewhere the scheduler kernel's) and schedule
  # "step" (the op's schedule call, paged decode's default) against the
  # scheduler kernel before the decode (schedule "kernel"): checked against
  # the reference, then bit for bit.
  own = own if _hopper_kernels_available() else "kernel"
  results = [_run(d, dataclasses.replace(plan, kernel=KernelChoice(schedule=schedule)), jnp.bfloat16)
             for schedule in (own, "step", "kernel")]
  _check(*results[0])
  for other in results[1:]:
    np.testing.assert_array_equal(results[0][0], other[0])
    np.testing.assert_array_equal(results[0][1], other[1])


@pytest.mark.parametrize("heads,max_num_splits,num_requests", [
    (128, None, 7), (128, 3, 7), (16, None, 7),
    (128, None, 32),   # the most requests the inline schedule takes: every lane
    (16, 2, 32),
])
def test_inline_schedule_matches_scheduler_kernel_bitwise(heads, max_num_splits, num_requests):
  # Batches of up to 32 requests are scheduled inside the decode kernel on
  # sm_90 (elsewhere both runs take the scheduler kernel): the same items in
  # the same order, so the outputs must agree bit for bit.
  rng = np.random.default_rng(19 + heads + num_requests)
  lens = [0, 1, 700, 9000, 64, 3000, 20000]
  lens += [int(n) for n in rng.integers(1, 6000, num_requests - len(lens))]
  d = random_paged_inputs(rng, lens, num_heads=heads, page_size=64)
  plan = mla_jax.DecodePlan(num_heads=heads, page_size=64, sm_scale=SM_SCALE, backend="cuda",
                            max_num_splits=max_num_splits)
  _check_same_bits_with_scheduler_kernel(d, plan, own="inline")


@pytest.mark.parametrize("heads,max_num_splits", [(16, None), (16, 2), (128, None)])
def test_inline_schedule_on_a_short_line_matches_scheduler_kernel_bitwise(heads, max_num_splits):
  # A work line of at most num_parts units (requests x (64-token blocks + 2))
  # is cut into one partition per unit (csrc/smxx/schedule_math.cuh): every
  # overhead unit is a partition without an item, an empty request one item
  # of no blocks. The inline schedule, `step` and the scheduler kernel must
  # place the same items; capped at 2 splits the equal pieces take over.
  rng = np.random.default_rng(23 + heads + (max_num_splits or 0))
  lens = [0, 1, 64, 65, 300, 700, 1000]
  parts = cuda_num_parts(heads)
  work = sum(-(-n // 64) + 2 for n in lens)
  assert work <= parts, (work, parts)
  d = random_paged_inputs(rng, lens, num_heads=heads, page_size=64)
  plan = mla_jax.DecodePlan(num_heads=heads, page_size=64, sm_scale=SM_SCALE, backend="cuda",
                            max_num_splits=max_num_splits)
  _check_same_bits_with_scheduler_kernel(d, plan, own="inline")


@pytest.mark.parametrize("heads,q_len,lens,max_num_splits", [
    (128, 1, "mixed40", None),     # cut schedule, one chunk of the block schedule
    (128, 1, "equal130", None),    # whole requests
    (16, 1, "mixed300", None),     # two chunks of 256 requests
    (16, 1, "equal44", None),      # equal pieces (132 partitions, 3 per request)
    (128, 2, "mixed64", 3),        # capped pieces (two 30k requests), 4 row blocks
    (64, 1, "bad40", None),        # empty, invalid and bad-page requests
    (16, 1, "short40", None),      # 40 short requests: most of the 132 partitions get no item
])
def test_schedule_in_decode_matches_scheduler_kernel_bitwise(heads, q_len, lens, max_num_splits):
  # Batches of more than 32 requests are scheduled inside every CTA of the
  # seesaw kernel on sm_90 (csrc/smxx/schedule_block.cuh, the scheduler
  # kernel's own code); schedule "kernel" runs the scheduler kernel instead.
  # The same items in the same order: the outputs agree bit for bit.
  rng = np.random.default_rng(41 + heads + q_len)
  kind, batch = lens.rstrip("0123456789"), int(lens.lstrip("abcdefghijklmnopqrstuvwxyz"))
  if kind == "equal":
    seq = np.full(batch, 1000 if batch > 100 else 3000)
  elif kind == "short":
    seq = rng.integers(1, 60, size=batch)
  else:
    seq = rng.integers(1, 2000 if batch > 100 else 9000, size=batch)
  if max_num_splits is not None:
    seq[[3, 40]] = 30000
  if kind == "bad":
    seq[[0, 5]] = 0
  d = random_paged_inputs(rng, seq.astype(np.int32), num_heads=heads, page_size=64, q_len=q_len)
  if kind == "bad":
    d["seq_lens"][7] = -2
    d["block_table"][9, 3] = d["kv_cache"].shape[0] + 1
  plan = mla_jax.DecodePlan(num_heads=heads, page_size=64, sm_scale=SM_SCALE, q_len=q_len,
                            causal=q_len > 1, backend="cuda", max_num_splits=max_num_splits)
  _check_same_bits_with_scheduler_kernel(d, plan)


def test_bad_page_in_split_request_many_rows():
  # 20 requests x 128 heads: enough (request, row) pairs for the
  # warp-per-row combine, whose NaN path a bad page in a split request takes.
  rng = np.random.default_rng(23)
  lens = [9000, 300, 9000, 50, 12000] + [700] * 15
  d = random_paged_inputs(rng, lens, num_heads=128, page_size=64)
  d["block_table"][2, 120] = d["kv_cache"].shape[0] + 9   # out of range, live, in a split request
  plan = mla_jax.DecodePlan(num_heads=128, page_size=64, sm_scale=SM_SCALE, backend="cuda")
  out, lse, ref_out, ref_lse = _run(d, plan, jnp.bfloat16)
  assert np.isnan(ref_lse[2]).all() and np.isfinite(ref_lse[[0, 1, 3, 4]]).all()
  _check(out, lse, ref_out, ref_lse)


def test_bad_page_in_split_request_few_splits():
  # 48 requests x 16 heads: 768 (request, row) pairs and num_parts / batch
  # below 32 (132 partitions on an H100/H200), so the combine takes a warp
  # per 128-column slice of a row (test_combine_grids forces every grid).
  rng = np.random.default_rng(29)
  lens = [8000, 5, 8000, 0] + list(rng.integers(1, 9000, size=44))
  d = random_paged_inputs(rng, lens, num_heads=16, page_size=64)
  d["block_table"][2, 100] = d["kv_cache"].shape[0] + 3   # out of range, live, in a split request
  plan = mla_jax.DecodePlan(num_heads=16, page_size=64, sm_scale=SM_SCALE, backend="cuda")
  out, lse, ref_out, ref_lse = _run(d, plan, jnp.bfloat16)
  assert np.isnan(ref_lse[2]).all() and np.isfinite(ref_lse[[0, 1]]).all()
  _check(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("heads,q_len,dtype", [(12, 2, jnp.bfloat16), (128, 1, jnp.bfloat16), (12, 1, jnp.float16)])
def test_combine_grids(heads, q_len, dtype):
  # The combine has three grids (csrc/smxx/combine.cu), chosen by the number
  # of (request, row) pairs and of splits per request; the plan's
  # KernelChoice.combine_grid forces each on the same split schedule: a bad page in a split request
  # (NaN), an empty request (-inf LSE), a zero-length neighbour, long and
  # short requests. The two warp grids add the splits in the same order, so
  # they agree bit for bit; the partials they read are in the output's dtype
  # (both 16-bit dtypes are run). On sm_90 these 8 requests run the seesaw
  # kernel with the inline schedule, which combines itself after a grid
  # barrier in each grid's order (KernelChoice.fused_combine): the same bits
  # as that grid's combine kernel.
  rng = np.random.default_rng(37 + heads)
  lens = [9000, 5, 0, 12000, 700, 3000, 20000, 64]
  d = random_paged_inputs(rng, lens, num_heads=heads, page_size=64, q_len=q_len)
  d["block_table"][3, 100] = d["kv_cache"].shape[0] + 4   # out of range, live, in a split request
  plan = mla_jax.DecodePlan(num_heads=heads, page_size=64, sm_scale=SM_SCALE, q_len=q_len,
                            causal=q_len > 1, backend="cuda")
  fusable = _hopper_kernels_available()
  results = {}
  for grid in ("block", "rows", "slices"):
    for fused in (False, True) if fusable else (False,):
      choice = KernelChoice(combine_grid=grid, fused_combine=fused)
      results[grid, fused] = _run(d, dataclasses.replace(plan, kernel=choice), dtype)
      _check(*results[grid, fused])
    if fusable:
      for i in (0, 1):
        np.testing.assert_array_equal(results[grid, True][i], results[grid, False][i], err_msg=f"fused {grid}")
  ref_lse = results["rows", False][3]  # the inputs reach the NaN and -inf paths (checked by _check above)
  assert np.isnan(ref_lse[3]).all() and np.isneginf(ref_lse[2]).all()
  np.testing.assert_array_equal(results["rows", False][0], results["slices", False][0])
  np.testing.assert_array_equal(results["rows", False][1], results["slices", False][1])


@pytest.mark.parametrize("base", [KernelChoice(), KernelChoice(schedule="kernel"), KernelChoice(kernel="portable")])
@pytest.mark.parametrize("lens,heads", [([4096], 128), ([42000] * 3 + [5, 0], 12), ([700, 90, 3000] * 20, 32)])
def test_programmatic_combine_launch_matches_plain_bitwise(lens, heads, base):
  # A programmatic combine launch lets the combine's CTAs be dispatched
  # while the decode kernel runs (csrc/smxx/pdl.cuh); they wait for it
  # before reading, so the bits must be those of the plain launch, and so
  # must the default's (on after the seesaw kernel above 32 requests, as for
  # the 60 requests here). On 132 SMs the shapes reach the block (128 pairs,
  # one request), slice (60 pairs) and row (1920 pairs) grids of the
  # combine; `base` adds the scheduler-kernel and portable decode paths.
  rng = np.random.default_rng(43 + heads)
  d = random_paged_inputs(rng, lens, num_heads=heads, page_size=64)
  plan = mla_jax.DecodePlan(num_heads=heads, page_size=64, sm_scale=SM_SCALE, backend="cuda")
  with_pdl = lambda value: dataclasses.replace(plan, kernel=dataclasses.replace(base, programmatic_combine=value))
  plain = _run(d, with_pdl(False), jnp.bfloat16)
  _check(*plain)
  for value in (True, None):
    for _ in range(3):
      pdl = _run(d, with_pdl(value), jnp.bfloat16)
      np.testing.assert_array_equal(pdl[0], plain[0], err_msg=f"programmatic_combine={value}")
      np.testing.assert_array_equal(pdl[1], plain[1], err_msg=f"programmatic_combine={value}")


def test_forced_kernel_that_cannot_serve_the_call_is_an_error():
  # A plan that forces a kernel the call's cache cannot use fails at trace
  # time with a message naming the plan's kernel, not with a silent run of
  # another kernel.
  rng = np.random.default_rng(41)
  d = random_paged_inputs(rng, [3000, 70], num_heads=16, page_size=16)
  plan = mla_jax.DecodePlan(num_heads=16, page_size=16, sm_scale=SM_SCALE, backend="cuda",
                            kernel="sm90_seesaw")
  with pytest.raises(ValueError, match="DecodePlan.kernel"):
    _run(d, plan, jnp.bfloat16)
  _check(*_run(d, dataclasses.replace(plan, kernel="auto"), jnp.bfloat16))


def test_64_row_blocks_bad_inputs(kernel_choice):
  rng = np.random.default_rng(17)
  d = random_paged_inputs(rng, [9000, 9000, 100, 100, 50], num_heads=128, page_size=64)
  d["block_table"][0, 100] = d["kv_cache"].shape[0] + 5
  d["block_table"][2, 0] = -7
  d["seq_lens"][3] = d["block_table"].shape[1] * 64 + 1
  d["seq_lens"][4] = -3
  plan = mla_jax.DecodePlan(num_heads=128, page_size=64, sm_scale=SM_SCALE, backend="cuda",
                            kernel=kernel_choice(128))
  out, lse, ref_out, ref_lse = _run(d, plan, jnp.bfloat16)
  assert np.isnan(ref_lse[[0, 2, 3, 4]]).all() and np.isfinite(ref_lse[1]).all()
  _check(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("heads,batch", [(16, 24), (96, 24), (128, 24), (16, 160), (128, 160)])
def test_consecutive_items_bad_pages_and_neighbour_queries(kernel_choice, heads, batch):
  # Many short requests put several items (requests or pieces of them) in
  # each partition, one after another in one CTA: a bad page id in tile 0
  # or tile 1 must turn only its own request to NaN (a kernel that loads
  # the next item's first tiles early must not flag the current one),
  # invalid and empty requests sit between valid ones, and a NaN query must
  # not leak into the request before it (a 64-row query block covers rows
  # past its request when H x q_len is not a multiple of 64).
  rng = np.random.default_rng(31 + heads + batch)
  lens = rng.choice([0, 1, 63, 64, 65, 128, 129, 200, 700], size=batch).astype(np.int32)
  lens[:9] = [130, 64, 1, 0, 129, 3000, 65, 200, 64]
  d = random_paged_inputs(rng, lens, num_heads=heads, page_size=64)
  num_pages = d["kv_cache"].shape[0]
  d["block_table"][0, 0] = num_pages + 1     # tile 0 of a 3-tile request
  d["block_table"][4, 1] = -5                # tile 1 of a 3-tile request
  d["block_table"][6, 1] = num_pages         # tile 1 of a 2-tile request
  d["block_table"][batch - 3, 0] = -2        # near the end of the batch
  d["seq_lens"][2] = -1                      # invalid between valid ones
  d["seq_lens"][batch - 5] = d["block_table"].shape[1] * 64 + 1  # over-long
  d["seq_lens"][batch - 3] = max(int(d["seq_lens"][batch - 3]), 1)
  nan_query = 7                              # a 200-token request
  d["query"][nan_query] = np.nan
  plan = mla_jax.DecodePlan(num_heads=heads, page_size=64, sm_scale=SM_SCALE, backend="cuda",
                            kernel=kernel_choice(heads))
  out, lse, ref_out, ref_lse = _run(d, plan, jnp.bfloat16)
  expect_nan = [0, 2, 4, 6, batch - 5, batch - 3]
  assert np.isnan(ref_lse[expect_nan]).all() and np.isfinite(ref_lse[[1, 5, 8]]).all()
  keep = np.arange(batch) != nan_query       # its own output is not specified here
  _check(out[keep], lse[keep], ref_out[keep], ref_lse[keep])


@pytest.mark.parametrize("heads,page_size", [(128, 64), (16, 64), (64, 128)])
def test_nan_in_unused_slots_of_last_page_whole_tile_loads(kernel_choice, heads, page_size):
  # TMA copies whole 64-token tiles (page sizes that are multiples of 64), so
  # the slots past seq_len in a request's last page reach shared memory; P is
  # 0 there, but 0 x NaN is NaN in P V unless those V rows are cleared. The
  # result must equal the clean run bit for bit (tests/test_paged_decode.py
  # checks the same promise on a page size the portable kernel serves).
  rng = np.random.default_rng(41 + heads + page_size)
  lens = [1, 63, 65, 127, 129, 200, 5000, 9001, 64, 128]
  d = random_paged_inputs(rng, lens, num_heads=heads, page_size=page_size)
  plan = mla_jax.DecodePlan(num_heads=heads, page_size=page_size, sm_scale=SM_SCALE, backend="cuda",
                            kernel=kernel_choice(heads))
  clean = _run(d, plan, jnp.bfloat16)
  _check(*clean)
  kv = d["kv_cache"]
  used = set(int(i) for i in d["block_table"][d["block_table"] >= 0])
  for p in range(kv.shape[0]):
    if p not in used:
      kv[p] = np.nan
  for b, n in enumerate(d["seq_lens"]):
    if n % page_size:
      page = d["block_table"][b, (int(n) - 1) // page_size]
      kv[page, n % page_size:] = np.nan if b % 2 else np.inf
  poisoned = _run(d, plan, jnp.bfloat16)
  np.testing.assert_array_equal(poisoned[0], clean[0])
  np.testing.assert_array_equal(poisoned[1], clean[1])


@pytest.mark.parametrize("heads,q_len,per_part", [(16, 1, 1), (16, 1, 2), (128, 1, 1), (128, 2, 2)])
def test_whole_request_schedule_when_balanced(heads, q_len, per_part):
  # Two requests fewer than per_part per partition, all of one length: an
  # equal share cuts most of them (the share does not line up with the
  # requests), while placed whole no partition carries more than 3 % above
  # that share, so the schedulers cut none (csrc/smxx/schedule_math.cuh).
  # The result must then equal the max_num_splits=1 schedule bit for bit; a
  # cut request goes through 16-bit partials and the combine instead. Two
  # per partition at 16 heads is over 256 requests: the scheduler kernel's
  # second chunk.
  batch = per_part * cuda_num_parts(q_len * heads) - 2
  rng = np.random.default_rng(43 + heads + batch)
  d = random_paged_inputs(rng, [1000] * batch, num_heads=heads, page_size=64, q_len=q_len)
  results = []
  for max_num_splits in (None, 1):
    plan = mla_jax.DecodePlan(num_heads=heads, page_size=64, sm_scale=SM_SCALE, q_len=q_len,
                              causal=q_len > 1, backend="cuda", max_num_splits=max_num_splits)
    results.append(_run(d, plan, jnp.bfloat16))
  _check(*results[0])
  np.testing.assert_array_equal(results[0][0], results[1][0])
  np.testing.assert_array_equal(results[0][1], results[1][1])


def _snake_case_lengths(rng, parts, layout):
  """Request lengths on which the snake placement is even while the
  first-block placement is not, and both placements' busiest partition over
  the equal share (the arithmetic of csrc/smxx/schedule_math.cuh: loads are
  64-token blocks + 2, partitions_for, part_of, within_share).

  2 * parts requests whose loads pair up to a constant (two full snake
  rounds: every partition gets exactly the share); "2p-2" drops the two
  smallest (one full round, then a partial one running backward); "3p-2"
  adds parts - 2 one-block requests, one of them empty (a partial third
  round running forward, and an empty request placed whole)."""
  d = rng.choice([0, 2, 4, 6], size=parts)
  blocks = np.sort(np.concatenate([8 + d, 8 - d]))
  if layout == "2p-2":
    blocks = blocks[2:]
  elif layout == "3p-2":
    blocks = np.concatenate([blocks, np.ones(parts - 2, blocks.dtype)])
  blocks = rng.permutation(blocks)
  lens = (64 * blocks - rng.integers(0, 64, size=blocks.size)).astype(np.int32)
  if layout == "3p-2":
    lens[np.flatnonzero(blocks == 1)[0]] = 0
  n = -(-lens.astype(np.int64) // 64)
  load = n + 2
  work = int(load.sum())
  # All `parts` partitions used: the line is longer than num_parts, so kMinPartWork 2 applies.
  assert work > parts and min(-(-work // 2), parts) == parts
  share = -(-work // parts)
  start = np.cumsum(load) - load  # a request's place on the work line
  first_block = np.where(n > 0, start + 2, start)  # (an empty request: its own place)
  in_order = np.bincount(np.minimum(first_block * parts // work, parts - 1), weights=load, minlength=parts)
  snake = np.zeros(parts)
  for rank, b in enumerate(np.argsort(-load, kind="stable")):
    rnd, pos = divmod(rank, parts)
    snake[pos if rnd % 2 == 0 else parts - 1 - pos] += load[b]
  return lens, in_order.max() / share, snake.max() / share


def _snake_parts_or_skip(heads, layout):
  # The block schedule tries the snake for 33 to 1024 requests (below that
  # the inline schedule, which has no sort, takes the batch).
  parts = cuda_num_parts(heads)
  batch = {"2p": 2 * parts, "2p-2": 2 * parts - 2, "3p-2": 3 * parts - 2}[layout]
  if not 32 < batch <= 1024:
    pytest.skip(f"{batch} requests for {parts} partitions: outside the snake's 33-1024")
  return parts


@pytest.mark.parametrize("heads,layout", [(128, "2p"), (16, "2p"), (128, "2p-2"), (64, "3p-2")])
def test_snake_whole_request_schedule_for_varied_lengths(kernel_choice, heads, layout):
  # Requests of varied lengths, about two per partition: whole requests in
  # the partition of their first block leave the busiest partition well
  # over the 5 % slack, so the schedulers would cut; sorted by load and
  # dealt in snake order they fit it, so the block schedule (the scheduler
  # kernel, or every seesaw CTA) cuts none (csrc/smxx/schedule_math.cuh).
  # The result must then equal the max_num_splits=1 schedule (every request
  # whole) bit for bit; a cut request goes through 16-bit partials and the
  # combine instead.
  parts = _snake_parts_or_skip(heads, layout)
  rng = np.random.default_rng(53 + heads + len(layout))
  lens, in_order, snake = _snake_case_lengths(rng, parts, layout)
  assert in_order > 1.05 and snake <= 1.05, (in_order, snake)
  d = random_paged_inputs(rng, lens, num_heads=heads, page_size=64)
  results = []
  for max_num_splits in (None, 1):
    plan = mla_jax.DecodePlan(num_heads=heads, page_size=64, sm_scale=SM_SCALE, backend="cuda",
                              max_num_splits=max_num_splits, kernel=kernel_choice(heads))
    results.append(_run(d, plan, jnp.bfloat16))
  _check(*results[0])
  np.testing.assert_array_equal(results[0][0], results[1][0])
  np.testing.assert_array_equal(results[0][1], results[1][1])


@pytest.mark.parametrize("layout", ["2p", "3p-2"])
def test_snake_schedule_in_decode_matches_scheduler_kernel_bitwise(layout):
  # The snake placement computed in every seesaw CTA against the scheduler
  # kernel's: the same items, so the same bits (and both equal to every
  # request whole, which the test above checks per kernel).
  parts = _snake_parts_or_skip(128, layout)
  rng = np.random.default_rng(59 + len(layout))
  lens, in_order, snake = _snake_case_lengths(rng, parts, layout)
  assert in_order > 1.05 and snake <= 1.05, (in_order, snake)
  d = random_paged_inputs(rng, lens, num_heads=128, page_size=64)
  plan = mla_jax.DecodePlan(num_heads=128, page_size=64, sm_scale=SM_SCALE, backend="cuda")
  _check_same_bits_with_scheduler_kernel(d, plan)


@pytest.mark.parametrize("heads,k,seq_len", [(128, 3, 3072), (64, 4, 2560)])
def test_equal_pieces_schedule_when_requests_are_few(heads, k, seq_len):
  # k partitions per request and equal lengths: every request is cut into k
  # equal pieces, one per partition (csrc/smxx/schedule_math.cuh; the
  # largest piece is within 10 % of the equal share at these lengths), the
  # same pieces as max_num_splits=k, so the results must agree bit for bit;
  # the cut schedule would cut at the work line's shares instead. On an
  # H100/H200 both batches (22 requests at 128 heads, 33 at 64) are
  # scheduled inside the seesaw kernel (by one warp, by the whole CTA); both
  # must also match the scheduler kernel bit for bit.
  batch = cuda_num_parts(heads) // k
  rng = np.random.default_rng(47 + heads + batch)
  d = random_paged_inputs(rng, [seq_len] * batch, num_heads=heads, page_size=64)
  results = []
  for max_num_splits, schedule in ((None, "auto"), (k, "auto"), (None, "kernel")):
    plan = mla_jax.DecodePlan(num_heads=heads, page_size=64, sm_scale=SM_SCALE, backend="cuda",
                              max_num_splits=max_num_splits, kernel=KernelChoice(schedule=schedule))
    results.append(_run(d, plan, jnp.bfloat16))
  _check(*results[0])
  for other in results[1:]:
    np.testing.assert_array_equal(results[0][0], other[0])
    np.testing.assert_array_equal(results[0][1], other[1])


@pytest.mark.parametrize("kernel", ["auto", "sm90_lockstep", "sm90_seesaw", "sm90_swapab", "portable"])
@pytest.mark.parametrize("heads,q_len,page_size,dtype,layout", [
    (128, 1, 64, jnp.bfloat16, "packed"),
    (96, 1, 128, jnp.bfloat16, "pair"),    # > 32 rows, pages of two tiles, ckv and kpe apart: seesaw
    (64, 2, 16, jnp.float16, "pair"),
    (96, 1, 1, jnp.bfloat16, "packed"),
    (33, 2, 256, jnp.bfloat16, "packed"),
    (16, 4, 64, jnp.float16, "packed"),
    (128, 4, 32, jnp.bfloat16, "pair"),
    (32, 1, 16, jnp.bfloat16, "pair"),     # 17-32 rows, pages TMA cannot load: the lock-step kernel
    (12, 2, 64, jnp.float16, "packed"),    # 17-32 rows, page_size a multiple of 64: swap-AB, 32-row block
    (32, 1, 128, jnp.bfloat16, "pair"),
    (20, 1, 64, jnp.bfloat16, "packed"),
    (16, 2, 64, jnp.bfloat16, "pair"),
    (16, 1, 64, jnp.bfloat16, "packed"),   # <= 16 rows, page_size a multiple of 64: swap-AB, 16-row block
    (12, 1, 128, jnp.float16, "pair"),
    (8, 2, 64, jnp.bfloat16, "pair"),
    (1, 1, 256, jnp.bfloat16, "packed"),
    (3, 4, 64, jnp.float16, "packed"),
])
def test_fp8_cache_kernels(kernel, heads, q_len, page_size, dtype, layout):
  # On sm_90 (auto) up to 32 query rows over pages of a multiple of 64
  # tokens run the swap-AB kernel, more rows over such pages the seesaw
  # kernel, other shapes with more than 16 rows the lock-step wgmma kernel;
  # the last two convert the e4m3 rows on chip. Against the reference with
  # ragged and zero lengths, splits, MTP, bad pages, both cache layouts, and
  # NaN (e4m3 0x7F) in every slot no valid request may read.
  rows = heads * q_len
  swapab_shape = rows <= 32 and page_size % 64 == 0
  if kernel.startswith("sm90") and not _hopper_kernels_available():
    pytest.skip(f"{kernel} needs an sm_90 GPU and a build with sm_90a code")
  if kernel == "sm90_swapab" and not swapab_shape:
    pytest.skip("sm90_swapab serves at most 32 query rows over pages of a multiple of 64 tokens")
  if kernel == "sm90_seesaw" and page_size % 64 != 0:
    pytest.skip("sm90_seesaw serves pages of a multiple of 64 tokens")
  rng = np.random.default_rng(heads + 3 * q_len + page_size)
  lens = [0, 1, q_len, 63, 64, 65, max(page_size - 1, 1), page_size + 1, 2500, 11000, 300, 300]
  d = random_paged_inputs(rng, lens, num_heads=heads, page_size=page_size, q_len=q_len)
  bt, sl = d["block_table"], d["seq_lens"]
  kv = d["kv_cache"] * 8.0                                # use the e4m3 range
  seen = np.zeros(kv.shape[:2], bool)
  for b, n in enumerate(sl[:-2]):
    pos = np.arange(n)
    seen[bt[b, pos // page_size], pos % page_size] = True
  kv[~seen] = np.nan
  bt[-2, 1] = kv.shape[0] + 3                             # a live page id outside the cache: NaN request
  sl[-1] = -2                                             # negative length: NaN request
  kv8 = jnp.asarray(kv, jnp.float8_e4m3fn)
  cache = kv8 if layout == "packed" else (kv8[..., :512], kv8[..., 512:])
  q = jnp.asarray(d["query"], dtype)
  plan = mla_jax.DecodePlan(num_heads=heads, page_size=page_size, sm_scale=SM_SCALE, q_len=q_len,
                            causal=q_len > 1, backend="cuda", kernel=kernel)
  if kernel == "auto" and _hopper_kernels_available():
    got = mla_jax.explain(plan, q, cache, bt, sl, kv_scale=jnp.float32(0.37))
    want = ("sm90_swapab" if swapab_shape else "sm90_seesaw" if page_size % 64 == 0 else
            "sm90_lockstep" if rows > 16 else "portable")
    assert got.kernel.kernel == want, str(got)
  _poison_allocator()
  out, lse = mla_jax.paged_decode(q, cache, jnp.asarray(bt), jnp.asarray(sl), plan=plan, return_lse=True,
                                  kv_scale=jnp.float32(0.37))
  ref_out, ref_lse = reference_paged_decode(np.asarray(q.astype(jnp.float32)), np.asarray(kv8.astype(jnp.float32)),
                                            bt, sl, plan, kv_scale=0.37)
  out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
  assert np.isnan(ref_lse[-2:]).all() and np.isfinite(ref_lse[8]).all()
  _check(out, lse, ref_out, ref_lse, tol=2e-2)
  # Row by row too: an error confined to one tile or request must not hide in the global norm.
  worst = _worst_row_error(out, ref_out, ref_lse)
  assert worst <= 2e-2, f"worst row relative error {worst:.3g}"


@pytest.mark.parametrize("heads", [16, 32])
@pytest.mark.parametrize("batch,max_num_splits", [(300, None), (7, None), (40, 3)])
def test_fp8_swapab_items_and_ring(batch, max_num_splits, heads):
  # The swap-AB kernel streams tiles through a ring of four stages (16 rows:
  # each warpgroup refills its own two; 32 rows: both read every tile and
  # the last warp to finish one refills its stage): long requests (many
  # passes of the ring), several items per CTA (300 requests on 132
  # partitions; the stage barriers' phases and the refill counts carry over
  # from item to item), split requests and lengths that leave every count
  # of tiles mod 4 and mod 2.
  if not _hopper_kernels_available():
    pytest.skip("sm90_swapab needs an sm_90 GPU and a build with sm_90a code")
  rng = np.random.default_rng(batch)
  lens = rng.integers(0, 1200 if batch > 100 else 20000, size=batch)
  lens[: min(batch, 11)] = np.arange(min(batch, 11)) * 64 + 1  # 1..11 tiles
  d = random_paged_inputs(rng, list(lens), num_heads=heads, page_size=64)
  plan = mla_jax.DecodePlan(num_heads=heads, page_size=64, sm_scale=SM_SCALE, backend="cuda",
                            max_num_splits=max_num_splits)
  q = jnp.asarray(d["query"], jnp.bfloat16)
  kv8 = jnp.asarray(d["kv_cache"] * 8.0, jnp.float8_e4m3fn)
  bt, sl = d["block_table"], d["seq_lens"]
  assert mla_jax.explain(plan, q, kv8, bt, sl, kv_scale=jnp.float32(0.3)).kernel.kernel == "sm90_swapab"
  _poison_allocator()
  out, lse = mla_jax.paged_decode(q, kv8, jnp.asarray(bt), jnp.asarray(sl), plan=plan, return_lse=True,
                                  kv_scale=jnp.float32(0.3))
  ref_out, ref_lse = reference_paged_decode(np.asarray(q.astype(jnp.float32)), np.asarray(kv8.astype(jnp.float32)),
                                            bt, sl, plan, kv_scale=0.3)
  out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
  _check(out, lse, ref_out, ref_lse, tol=2e-2)
  worst = _worst_row_error(out, ref_out, ref_lse)
  assert worst <= 2e-2, f"worst row relative error {worst:.3g}"


@pytest.mark.parametrize("heads,q_len,page_size,dtype,max_num_splits,num_requests", [
    (16, 1, 64, jnp.bfloat16, None, 12),    # 16-row block
    (32, 1, 128, jnp.bfloat16, 3, 12),      # 32-row block, capped pieces
    (8, 2, 64, jnp.float16, None, 12),      # MTP, fp16 query (three e4m3 parts)
    (16, 2, 64, jnp.bfloat16, 2, 12),       # 32 rows from q_len x heads
    (16, 2, 64, jnp.float16, None, 12),     # 32 rows, fp16 query
    (16, 1, 64, jnp.bfloat16, None, 32),    # the most requests the inline schedule takes: every lane
])
def test_fp8_swapab_inline_schedule_matches_scheduler_kernel_bitwise(heads, q_len, page_size, dtype,
                                                                   max_num_splits, num_requests):
  # Up to 32 requests the swap-AB kernel schedules itself (warp 0 of every
  # CTA, csrc/smxx/schedule_inline.cuh); schedule "kernel" runs the scheduler
  # kernel first. The same items in the same order: the outputs agree bit
  # for bit, empty, negative-length and bad-page requests included. The
  # scheduler-kernel run also keeps that path covered at small batches,
  # where auto no longer takes it.
  if not _hopper_kernels_available():
    pytest.skip("sm90_swapab needs an sm_90 GPU and a build with sm_90a code")
  rng = np.random.default_rng(53 + heads + 5 * q_len + page_size)
  lens = [0, 1, q_len, 700, 9000, 64, 3000, 20000, 129, 30000, 300, 300]
  # More requests go before the last two (the bad-page and negative-length ones).
  lens = lens[:-2] + [int(n) for n in rng.integers(1, 5000, num_requests - len(lens))] + lens[-2:]
  d = random_paged_inputs(rng, lens, num_heads=heads, page_size=page_size, q_len=q_len)
  bt, sl = d["block_table"], d["seq_lens"]
  bt[-2, 2] = d["kv_cache"].shape[0] + 5                  # a live page id outside the cache: NaN request
  sl[-1] = -2                                             # negative length: NaN request
  q = jnp.asarray(d["query"], dtype)
  kv8 = jnp.asarray(d["kv_cache"] * 8.0, jnp.float8_e4m3fn)
  results = []
  for schedule in ("inline", "kernel"):
    plan = mla_jax.DecodePlan(num_heads=heads, page_size=page_size, sm_scale=SM_SCALE, q_len=q_len,
                              causal=q_len > 1, backend="cuda", max_num_splits=max_num_splits,
                              kernel=KernelChoice(kernel="sm90_swapab", schedule=schedule))
    got = mla_jax.explain(plan, q, kv8, bt, sl, kv_scale=jnp.float32(0.3)).kernel
    assert (got.kernel, got.schedule) == ("sm90_swapab", schedule), str(got)
    _poison_allocator()
    out, lse = mla_jax.paged_decode(q, kv8, jnp.asarray(bt), jnp.asarray(sl), plan=plan, return_lse=True,
                                    kv_scale=jnp.float32(0.3))
    results.append((np.asarray(out.astype(jnp.float32)), np.asarray(lse)))
  ref_out, ref_lse = reference_paged_decode(np.asarray(q.astype(jnp.float32)), np.asarray(kv8.astype(jnp.float32)),
                                            bt, sl, plan, kv_scale=0.3)
  assert np.isnan(ref_lse[-2:]).all() and np.isfinite(ref_lse[4]).all()
  _check(*results[0], ref_out, ref_lse, tol=2e-2)
  np.testing.assert_array_equal(results[0][0], results[1][0])
  np.testing.assert_array_equal(results[0][1], results[1][1])
