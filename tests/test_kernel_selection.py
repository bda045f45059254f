"""Kernel selection (csrc/dispatch/select.cc) as a user sees it: mla_jax.explain,
the plan's kernel field, and the FFI attributes in the lowered program.

Selection needs no GPU: explain() takes a described device (CudaDevice), so
these tests run on CPU hosts (CI) and check the capability table of
docs/design.md. Expectations for the Hopper kernels need a build with sm_90a
code (the default CUDA build); a CPU-only build selects "portable" for sm_90.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mla_jax
from mla_jax import KernelChoice

H200 = mla_jax.CudaDevice(arch=90, sm_count=132)
B200 = mla_jax.CudaDevice(arch=100, sm_count=148)
SM_SCALE = 1 / 192**0.5
needs_sm90a = pytest.mark.skipif(not (mla_jax._ffi.has_extension() and mla_jax._ffi.ext().has_sm90a()),
                                 reason="this build has no sm_90a code")


def _paged(batch, heads, page_size, q_len=1, kv_dtype=jnp.bfloat16, pages=50):
  q_shape = (batch, heads, 576) if q_len == 1 else (batch, q_len, heads, 576)
  return (jax.ShapeDtypeStruct(q_shape, jnp.bfloat16), jax.ShapeDtypeStruct((pages, page_size, 576), kv_dtype),
          jax.ShapeDtypeStruct((batch, 8), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32))


def _explain_paged(batch, heads, page_size, q_len=1, kernel="auto", device=H200, **kw):
  plan = mla_jax.DecodePlan(num_heads=heads, page_size=page_size, sm_scale=SM_SCALE, q_len=q_len,
                            backend="cuda", kernel=kernel)
  return mla_jax.explain(plan, *_paged(batch, heads, page_size, q_len, **kw), device=device)


@needs_sm90a
@pytest.mark.parametrize("batch,heads,page_size,q_len,want", [
    # schedule "step" (paged decode's own schedule call) above 32 requests;
    # combine grid: "block" below 2048 (request, row) pairs with >= 32 partitions
    # per request (132 SMs / 64-row blocks), else "slices" below 1024 pairs, else "rows";
    # the combine fused into the seesaw kernel with the inline schedule in the block grid's
    # order where one round of its CTAs covers the (request, row, 128-column slice) tasks
    (4, 128, 64, 1, KernelChoice("sm90_seesaw", "inline", "slices", False, False)),
    (64, 16, 64, 1, KernelChoice("sm90_seesaw", "step", "rows", True, False)),
    (128, 128, 64, 2, KernelChoice("sm90_seesaw", "step", "rows", True, False)),
    (1, 16, 256, 1, KernelChoice("sm90_seesaw", "inline", "block", False, True)),
    (4, 128, 16, 1, KernelChoice("sm90_lockstep", "kernel", "slices", False, False)),
    (4, 16, 2, 4, KernelChoice("sm90_lockstep", "kernel", "block", False, False)),   # 64 rows: q_len x heads
    (4, 16, 16, 1, KernelChoice("portable", "kernel", "block", False, False)),
    (4, 32, 32, 1, KernelChoice("portable", "kernel", "block", False, False)),
    (40, 32, 32, 1, KernelChoice("portable", "step", "rows", False, False)),
])
def test_hopper_capability_table(batch, heads, page_size, q_len, want):
  got = _explain_paged(batch, heads, page_size, q_len)
  assert got.backend == "cuda" and got.kernel == want, str(got)


@pytest.mark.parametrize("device", [B200, mla_jax.CudaDevice(arch=80, sm_count=108)])
def test_other_architectures_run_the_portable_kernel(device):
  got = _explain_paged(4, 128, 64, device=device)
  assert got.kernel.kernel == "portable", str(got)
  assert any("sm_" + str(device.arch) in line for line in got.reasons), str(got)


@needs_sm90a
@pytest.mark.parametrize("heads,page_size,want", [(128, 64, "sm90_seesaw"), (64, 16, "sm90_lockstep"),
                                                  (33, 64, "sm90_seesaw"), (96, 128, "sm90_seesaw"),
                                                  (32, 16, "sm90_lockstep"),
                                                  (24, 32, "sm90_lockstep"), (32, 64, "sm90_swapab"),
                                                  (24, 128, "sm90_swapab"), (17, 64, "sm90_swapab"),
                                                  (16, 64, "sm90_swapab"), (12, 128, "sm90_swapab"),
                                                  (1, 64, "sm90_swapab"), (16, 16, "portable"),
                                                  (12, 32, "portable")])
def test_fp8_cache_kernel_choice(heads, page_size, want):
  # Where TMA loads whole tiles (page size a multiple of 64): up to 32
  # query rows the swap-AB kernel, more the seesaw kernel (raw e4m3 tiles
  # converted on chip). Otherwise more than 16 rows: the lock-step kernel,
  # which gathers and converts the e4m3 rows on chip; 16 or fewer: the
  # portable kernel's 16-row blocks.
  plan = mla_jax.DecodePlan(num_heads=heads, page_size=page_size, sm_scale=SM_SCALE, backend="cuda")
  got = mla_jax.explain(plan, *_paged(4, heads, page_size, kv_dtype=jnp.float8_e4m3fn),
                        kv_scale=jax.ShapeDtypeStruct((), jnp.float32), device=H200)
  assert got.kernel.kernel == want, str(got)
  if want == "sm90_lockstep":
    assert any("FP8 rows, converted on chip" in line for line in got.reasons), str(got)
  if want == "sm90_seesaw":
    assert any("float8_e4m3fn cache" in line and "converts" in line for line in got.reasons), str(got)
  if want == "sm90_swapab":
    assert any("tokens as wgmma's M" in line for line in got.reasons), str(got)
  else:
    with pytest.raises(ValueError, match="sm90_swapab"):
      mla_jax.explain(dataclasses.replace(plan, kernel="sm90_swapab"),
                      *_paged(4, heads, page_size, kv_dtype=jnp.float8_e4m3fn),
                      kv_scale=jax.ShapeDtypeStruct((), jnp.float32), device=H200)
  forced = dataclasses.replace(plan, kernel="sm90_seesaw")
  args = (*_paged(4, heads, page_size, kv_dtype=jnp.float8_e4m3fn),)
  if page_size % 64 == 0:  # any number of rows, zero-filled to 64
    got = mla_jax.explain(forced, *args, kv_scale=jax.ShapeDtypeStruct((), jnp.float32), device=H200)
    assert got.kernel.kernel == "sm90_seesaw", str(got)
  else:
    with pytest.raises(ValueError, match="'sm90_seesaw' needs TMA loads"):
      mla_jax.explain(forced, *args, kv_scale=jax.ShapeDtypeStruct((), jnp.float32), device=H200)


@needs_sm90a
def test_swapab_serves_fp8_caches_with_few_rows_only():
  plan = mla_jax.DecodePlan(num_heads=8, page_size=64, sm_scale=SM_SCALE, q_len=2, backend="cuda",
                            kernel="sm90_swapab")
  got = mla_jax.explain(plan, *_paged(4, 8, 64, q_len=2, kv_dtype=jnp.float8_e4m3fn),
                        kv_scale=jax.ShapeDtypeStruct((), jnp.float32), device=H200)
  # Four requests: one warp of every CTA schedules them (no scheduler kernel).
  assert got.kernel == KernelChoice("sm90_swapab", "inline", "block", False, False), str(got)
  for heads, q_len, kv_dtype in ((16, 2, jnp.float8_e4m3fn), (32, 1, jnp.float8_e4m3fn)):
    ok = dataclasses.replace(plan, num_heads=heads, q_len=q_len)
    got = mla_jax.explain(ok, *_paged(4, heads, 64, q_len=q_len, kv_dtype=kv_dtype),
                          kv_scale=jax.ShapeDtypeStruct((), jnp.float32), device=H200)
    assert got.kernel.kernel == "sm90_swapab", str(got)
  for heads, q_len, kv_dtype in ((16, 3, jnp.float8_e4m3fn), (33, 1, jnp.float8_e4m3fn), (16, 1, jnp.bfloat16)):
    bad = dataclasses.replace(plan, num_heads=heads, q_len=q_len)
    kw = {"kv_scale": jax.ShapeDtypeStruct((), jnp.float32)} if kv_dtype != jnp.bfloat16 else {}
    with pytest.raises(ValueError, match="sm90_swapab.*32 query rows"):
      mla_jax.explain(bad, *_paged(4, heads, 64, q_len=q_len, kv_dtype=kv_dtype), device=H200, **kw)


@needs_sm90a
@pytest.mark.parametrize("heads,kv_format,q_dtype,topk,want", [
    (64, "bf16", jnp.bfloat16, 2048, "sm90_lockstep"), (128, "fp8_ds_mla", jnp.bfloat16, 2048, "sm90_seesaw"),
    (32, "fp8_ds_mla", jnp.bfloat16, 2048, "sm90_swapab"), (17, "fp8_ds_mla", jnp.bfloat16, 2048, "sm90_swapab"),
    (33, "fp8_ds_mla", jnp.bfloat16, 2048, "sm90_seesaw"),
    (128, "fp8_ds_mla", jnp.bfloat16, 1023, "sm90_lockstep"), (64, "fp8_ds_mla", jnp.bfloat16, 1024, "sm90_seesaw"),
    (64, "fp8_ds_mla", jnp.bfloat16, 768, "sm90_lockstep"), (64, "fp8_ds_mla", jnp.bfloat16, 512, "sm90_lockstep"),
    (128, "fp8_ds_mla", jnp.float16, 2048, "sm90_lockstep"),
    (32, "bf16", jnp.bfloat16, 2048, "sm90_lockstep"), (16, "fp8_ds_mla", jnp.bfloat16, 2048, "sm90_swapab"),
    (12, "fp8_ds_mla", jnp.bfloat16, 128, "sm90_swapab"), (1, "fp8_ds_mla", jnp.bfloat16, 2048, "sm90_swapab"),
    (16, "fp8_ds_mla", jnp.float16, 2048, "portable"), (16, "bf16", jnp.bfloat16, 2048, "sm90_lockstep"),
    (1, "bf16", jnp.bfloat16, 64, "sm90_lockstep")])
def test_sparse_capability_table(heads, kv_format, q_dtype, topk, want):
  # fp8_ds_mla with a bf16 query and 32 heads or fewer: the swap-AB kernel
  # (rows gathered by index); more heads: the seesaw kernel (its gathering
  # form) from top-k 1024 on, else the lock-step kernel, as with an fp16
  # query. A bf16/fp16 cache in the query dtype: the lock-step kernel at
  # every head count.
  plan = mla_jax.SparseDecodePlan(num_heads=heads, page_size=64, sm_scale=SM_SCALE, topk=topk, kv_format=kv_format,
                                  backend="cuda")
  kv = (jax.ShapeDtypeStruct((20, 64, 656), jnp.uint8) if kv_format == "fp8_ds_mla"
        else jax.ShapeDtypeStruct((20, 64, 576), jnp.bfloat16))
  args = (jax.ShapeDtypeStruct((3, heads, 576), q_dtype), kv, jax.ShapeDtypeStruct((3, topk), jnp.int32))
  got = mla_jax.explain(plan, *args, device=H200)
  # The seesaw and swap-AB kernels schedule a batch of 3 themselves (one
  # warp of every CTA).
  schedule = "inline" if want in ("sm90_seesaw", "sm90_swapab") else "kernel"
  assert got.kernel.kernel == want and got.kernel.schedule == schedule, str(got)
  if want == "sm90_lockstep" and kv_format == "fp8_ds_mla" and q_dtype == jnp.bfloat16:
    assert any(f"top-k {topk} is below the 1024" in line for line in got.reasons), str(got)
  if want != "sm90_swapab":
    with pytest.raises(ValueError, match="sm90_swapab"):
      mla_jax.explain(dataclasses.replace(plan, kernel="sm90_swapab"), *args, device=H200)
  seesaw = dataclasses.replace(plan, kernel="sm90_seesaw")
  if kv_format == "fp8_ds_mla" and q_dtype == jnp.bfloat16:
    assert mla_jax.explain(seesaw, *args, device=H200).kernel.kernel == "sm90_seesaw"
  else:
    with pytest.raises(ValueError, match="sm90_seesaw"):
      mla_jax.explain(seesaw, *args, device=H200)


@needs_sm90a
@pytest.mark.parametrize("batch,q_len,want", [(32, 1, "inline"), (33, 1, "step"), (20, 2, "step"), (16, 2, "inline")])
def test_sparse_schedule_step_above_32_requests(batch, q_len, want):
  # Every query token is a request: B x Q of them. Above 32 the schedule
  # comes from the op's schedule call (over topk_lens only).
  plan = mla_jax.SparseDecodePlan(num_heads=128, page_size=64, sm_scale=SM_SCALE, topk=2048, q_len=q_len,
                                  kv_format="fp8_ds_mla", backend="cuda")
  args = (jax.ShapeDtypeStruct((batch, q_len, 128, 576), jnp.bfloat16),
          jax.ShapeDtypeStruct((20, 64, 656), jnp.uint8), jax.ShapeDtypeStruct((batch, q_len, 2048), jnp.int32))
  got = mla_jax.explain(plan, *args, device=H200)
  assert (got.kernel.kernel, got.kernel.schedule) == ("sm90_seesaw", want), str(got)


def test_sparse_facts_without_topk_are_rejected():
  # The sparse choice depends on top-k: facts that leave it out are an
  # error, in Python and in the C++ selection, not a silent short-item choice.
  f = dict(op="sparse", q_dtype=jnp.bfloat16, kv_dtype=jnp.uint8, kv_format="fp8_ds_mla", kv_lora_rank=512,
           qk_rope_head_dim=64, page_size=64, q_len=1, num_heads=128, batch=3, num_pages=20)
  with pytest.raises(ValueError, match="topk >= 1"):
    mla_jax.kernels.facts(**f)
  if not mla_jax._ffi.has_extension():
    pytest.skip("no native extension: the C++ selection is not built")
  facts = mla_jax.kernels.facts(**f, topk=2048)
  facts["topk"] = 0
  with pytest.raises(ValueError, match="topk >= 1"):
    mla_jax.kernels.select(facts, KernelChoice(), requests=3, rows=128, dv=512, device=H200)
  assert mla_jax.kernels.select(mla_jax.kernels.facts(**f, topk=2048), KernelChoice(), requests=3, rows=128,
                                dv=512, device=H200).config.kernel != "auto"


def test_forced_fields_are_kept_and_explained():
  choice = KernelChoice(kernel="portable", schedule="kernel", combine_grid="slices", programmatic_combine=True,
                        fused_combine=False)
  got = _explain_paged(4, 128, 64, kernel=choice)
  assert got.kernel == choice
  assert sum("requested by the plan" in line for line in got.reasons[1:]) == 5, str(got)


@needs_sm90a
def test_fused_combine_where_the_seesaw_kernel_schedules_inline():
  # Up to 32 requests the seesaw kernel schedules inline and can merge the
  # splits itself (a cooperative launch); auto does in the block grid's
  # order where the grid's 132 CTAs take the batch x rows x 4 tasks in one
  # round, not in a warp grid's order (measured no faster). Never above 32
  # requests, after another schedule, or where the plan asks for a
  # programmatic combine launch.
  for batch, heads, grid, want in ((1, 16, "block", True),      # 64 tasks, 132 CTAs
                                   (2, 16, "block", True),      # 128 tasks
                                   (1, 12, "block", True),
                                   (1, 128, "block", False),    # 512 tasks
                                   (2, 128, "block", False),    # 1,024 tasks
                                   (8, 12, "slices", False),    # a warp grid
                                   (4, 128, "slices", False),
                                   (33, 16, "slices", False)):  # schedule "step"
    got = _explain_paged(batch, heads, 64)
    assert (got.kernel.schedule, got.kernel.combine_grid, got.kernel.fused_combine) == (
        "inline" if batch <= 32 else "step", grid, want), str(got)
    assert any(line.startswith("fused combine: " + ("on" if want else "off")) for line in got.reasons), str(got)
  assert _explain_paged(4, 128, 64, kernel=KernelChoice(fused_combine=True)).kernel.fused_combine is True
  for choice in (KernelChoice(schedule="kernel"), KernelChoice(programmatic_combine=True),
                 KernelChoice(kernel="sm90_lockstep")):
    got = _explain_paged(1, 16, 64, kernel=choice)
    assert got.kernel.fused_combine is False, str(got)
  assert _explain_paged(1, 16, 64, kernel=KernelChoice(fused_combine=False)).kernel.programmatic_combine is False


def test_configuration_text_of_four_fields_still_parses():
  # Programs exported before fused_combine existed carry four fields; the
  # fifth is then auto. Other counts are refused.
  ext = mla_jax._ffi.ext()
  f = mla_jax.kernels.facts(op="paged", q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, kv_format="bf16",
                            kv_lora_rank=512, qk_rope_head_dim=64, page_size=64, q_len=1, num_heads=16,
                            batch=4, num_pages=20)
  four, err4, _ = ext.select_kernel(f, "portable,kernel,rows,off")
  five, err5, _ = ext.select_kernel(f, "portable,kernel,rows,off,auto")
  assert not err4 and four == five and four.endswith(",off"), (four, err4)
  for bad in ("portable,kernel,rows", "portable,kernel,rows,off,auto,auto"):
    assert "comma-separated" in ext.select_kernel(f, bad)[1]


@needs_sm90a
def test_fused_combine_with_a_symbolic_batch_is_left_to_the_device():
  # A forced inline schedule and grid with a symbolic batch: the task count
  # is unknown at trace time.
  b, = jax.export.symbolic_shape("b")
  choice = KernelChoice(kernel="sm90_seesaw", schedule="inline", combine_grid="slices")
  plan = mla_jax.DecodePlan(num_heads=16, page_size=64, sm_scale=SM_SCALE, backend="cuda", kernel=choice)
  args = (jax.ShapeDtypeStruct((b, 16, 576), jnp.bfloat16), jax.ShapeDtypeStruct((50, 64, 576), jnp.bfloat16),
          jax.ShapeDtypeStruct((b, 8), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32))
  got = mla_jax.explain(plan, *args, device=H200)
  assert got.kernel.fused_combine is None, str(got)
  assert any(line == "fused combine: auto, chosen on the device" for line in got.reasons), str(got)


@pytest.mark.parametrize("kernel,page_size,batch,match", [
    ("sm90_seesaw", 16, 4, "TMA"),
    (KernelChoice(kernel="portable", schedule="inline"), 64, 4, "seesaw"),
    (KernelChoice(schedule="inline"), 64, 40, "at most 32 requests"),
    (KernelChoice(schedule="kernel", fused_combine=True), 64, 4, "fused combine is the sm90_seesaw kernel's"),
    (KernelChoice(kernel="sm90_lockstep", fused_combine=True), 64, 4, "fused combine is the sm90_seesaw kernel's"),
    (KernelChoice(fused_combine=True, programmatic_combine=True), 64, 4, "exclude each other"),
])
def test_forced_choice_that_cannot_serve_the_call_is_a_trace_time_error(kernel, page_size, batch, match):
  heads = 128
  with pytest.raises(ValueError, match="DecodePlan.kernel") as e:
    _explain_paged(batch, heads, page_size, kernel=kernel)
  if mla_jax._ffi.ext().has_sm90a():
    assert match in str(e.value)


@needs_sm90a
def test_swapab_schedules_small_batches_itself():
  # Up to 32 requests one warp of every swap-AB CTA schedules; above, paged
  # decode takes its schedule from its own call ("step"), and without that
  # operand (the facts of a direct call) the scheduler kernel
  # runs first; the block schedule is the seesaw kernel's.
  plan = mla_jax.DecodePlan(num_heads=16, page_size=64, sm_scale=SM_SCALE, backend="cuda")
  fp8 = lambda batch: _paged(batch, 16, 64, kv_dtype=jnp.float8_e4m3fn)
  scale = dict(kv_scale=jax.ShapeDtypeStruct((), jnp.float32), device=H200)
  for batch, want in ((1, "inline"), (32, "inline"), (33, "step"), (128, "step")):
    got = mla_jax.explain(plan, *fp8(batch), **scale)
    assert (got.kernel.kernel, got.kernel.schedule) == ("sm90_swapab", want), str(got)
  f = dict(op="paged", q_dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn, kv_format="bf16", kv_lora_rank=512,
           qk_rope_head_dim=64, page_size=64, q_len=1, num_heads=16, num_pages=20)
  for batch, want in ((1, "inline"), (32, "inline"), (33, "kernel"), (128, "kernel")):
    got = mla_jax.kernels.select(mla_jax.kernels.facts(**f, batch=batch), KernelChoice(), requests=batch, rows=16,
                                 dv=512, device=H200)
    assert (got.config.kernel, got.config.schedule) == ("sm90_swapab", want), got
    if batch == 33:
      assert any("more than sm90_swapab schedules itself" in line for line in got.explanation), got
  forced = dataclasses.replace(plan, kernel=KernelChoice(kernel="sm90_swapab", schedule="inline"))
  assert mla_jax.explain(forced, *fp8(8), **scale).kernel.schedule == "inline"
  with pytest.raises(ValueError, match="at most 32 requests"):
    mla_jax.explain(forced, *fp8(40), **scale)
  with pytest.raises(ValueError, match="'block' is the sm90_seesaw kernel's"):
    mla_jax.explain(dataclasses.replace(plan, kernel=KernelChoice(kernel="sm90_swapab", schedule="block")),
                    *fp8(8), **scale)


@needs_sm90a
@pytest.mark.parametrize("heads", [1, 16, 32])
def test_forced_lockstep_serves_a_partial_row_block(heads):
  # Auto picks the portable kernel for these (bf16, page 16); forced, the
  # lock-step kernel runs them in one 64-row block with the rows past the
  # request's zero.
  got = _explain_paged(4, heads, 16, kernel="sm90_lockstep")
  assert got.kernel.kernel == "sm90_lockstep", str(got)
  assert _explain_paged(4, heads, 16).kernel.kernel == "portable"


def test_hopper_kernel_on_another_architecture_is_an_error():
  with pytest.raises(ValueError, match="sm_100"):
    _explain_paged(4, 128, 64, kernel="sm90_seesaw", device=B200)


@pytest.mark.parametrize("gpu_visible", [False, True])
def test_unknown_device_leaves_the_choice_to_the_device(monkeypatch, gpu_visible):
  # A device that is no CUDA device gives no facts, also on a host where JAX
  # sees a GPU (simulated here, so that CPU hosts check it too): explain must
  # not fall back to the visible GPU's facts.
  if gpu_visible:
    monkeypatch.setattr(mla_jax.kernels, "visible_cuda_device", lambda: H200)
  got = _explain_paged(4, 128, 64, device=jax.devices("cpu")[0])
  assert got.kernel == KernelChoice(), str(got)
  assert any("chosen on the device" in line for line in got.reasons)


def test_symbolic_batch_leaves_batch_dependent_fields_open():
  if not mla_jax._ffi.ext().has_sm90a():
    pytest.skip("this build has no sm_90a code")
  b, = jax.export.symbolic_shape("b")
  plan = mla_jax.DecodePlan(num_heads=128, page_size=64, sm_scale=SM_SCALE, backend="cuda")
  args = (jax.ShapeDtypeStruct((b, 128, 576), jnp.bfloat16), jax.ShapeDtypeStruct((50, 64, 576), jnp.bfloat16),
          jax.ShapeDtypeStruct((b, 8), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32))
  got = mla_jax.explain(plan, *args, device=H200)
  assert got.kernel == KernelChoice(kernel="sm90_seesaw", schedule="step", fused_combine=False), str(got)


@pytest.mark.parametrize("bad", [dict(kernel="sm90"), dict(schedule="warp"), dict(combine_grid="slice"),
                                 dict(programmatic_combine=1), dict(fused_combine="on")])
def test_kernel_choice_validates_its_fields(bad):
  with pytest.raises((ValueError, TypeError)):
    KernelChoice(**bad)
  if "kernel" in bad:  # a plan's kernel string names the kernel
    with pytest.raises(ValueError, match="DecodePlan.kernel"):
      mla_jax.DecodePlan(num_heads=16, page_size=64, sm_scale=SM_SCALE, kernel=bad["kernel"])


def test_plan_kernel_of_another_type_is_a_type_error():
  with pytest.raises(TypeError, match="DecodePlan.kernel"):
    mla_jax.DecodePlan(num_heads=16, page_size=64, sm_scale=SM_SCALE, kernel=3)


def test_plan_kernel_string_is_a_kernel_choice_and_hashable():
  a = mla_jax.DecodePlan(num_heads=16, page_size=64, sm_scale=SM_SCALE, kernel="portable")
  b = mla_jax.DecodePlan(num_heads=16, page_size=64, sm_scale=SM_SCALE, kernel=KernelChoice(kernel="portable"))
  assert a == b and hash(a) == hash(b) and a.kernel == KernelChoice("portable")


def test_cpu_backend_and_xla_are_explained():
  plan = mla_jax.DecodePlan(num_heads=16, page_size=64, sm_scale=SM_SCALE)
  got = mla_jax.explain(plan, *_paged(4, 16, 64), device=jax.devices("cpu")[0])
  assert got.backend == "cpu" and got.kernel is None
  xla = mla_jax.explain(mla_jax.DecodePlan(num_heads=16, page_size=64, sm_scale=SM_SCALE, backend="xla"),
                        *_paged(4, 16, 64))
  assert xla.backend == "xla"


def test_choice_travels_as_attributes_in_the_lowered_program():
  if not mla_jax._ffi.has_cuda_target(mla_jax._ffi.CUDA_TARGET):
    pytest.skip("this build has no CUDA kernels")
  choice = KernelChoice(kernel="portable", schedule="kernel", combine_grid="rows", programmatic_combine=False)
  plan = mla_jax.DecodePlan(num_heads=16, page_size=64, sm_scale=SM_SCALE, backend="cuda", kernel=choice)
  f = jax.jit(lambda q, kv, bt, sl: mla_jax.paged_decode(q, kv, bt, sl, plan=plan))
  text = f.trace(*_paged(4, 16, 64)).lower(lowering_platforms=("cuda",)).as_text()
  assert 'kernel_config = "portable,kernel,rows,off,off"' in text, text[-2000:]
  assert 'kernel_request = "portable,kernel,rows,off,auto"' in text
  assert "workspace_parts" in text


def test_workspace_is_affine_in_the_batch():
  ext = mla_jax._ffi.ext()
  per_request, fixed = ext.workspace_size(128, 512, 132)
  assert per_request > 0 and fixed > 0 and per_request % 8 == 0
  # every request brings its partial output rows (16-bit, the output's
  # dtype), LSEs, items and metadata, each region's per-request share
  # rounded up to a 128-byte line
  assert per_request == 128 * 512 * 2 + 128 * 4 + 128 + 128
  assert per_request % 128 == 0 and fixed % 128 == 0
  assert np.all(np.asarray(ext.workspace_size(1, 512, 1)) > 0)
