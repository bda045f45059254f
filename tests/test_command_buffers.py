"""The op inside an on-device decode loop, with XLA command buffers on and off.

A decode loop (lax.scan and lax.fori_loop) in which every step
  * moves one live page of one request to a free page (block_table changes),
  * appends a token to every request, allocating a page when one fills
    (seq_lens and often block_table change, the cache is written),
  * decodes with backend "auto" (the CUDA kernel on a GPU).
The step's inputs are computed on the device from the loop carry, so a
command buffer (CUDA graph) that baked in the first step's lengths, table or
split schedule would give wrong results from step 2 on. Each step is checked
against the float64 reference.

XLA flags must be set before the backend starts, so each mode runs in a
subprocess (this file run as a script) with its own XLA_FLAGS.
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

B, H, PAGE, STEPS = 4, 16, 64, 12
INIT_LENS = [1, 62, 64, 130]
SM_SCALE = 192 ** -0.5

# "": command buffers off. "default": XLA's own choice (jax 0.11.2 captures
# the whole loop body, kernel included). The explicit list turns on custom
# calls and dynamic-slice fusions (XLA wraps the kernel's call in one inside
# scan/fori: without it the kernel stays outside the graph) and loops, and
# captures even the smallest graphs.
MODES = {
    "off": "--xla_gpu_enable_command_buffer=",
    "default": "",
    "on": ("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,DYNAMIC_SLICE_FUSION,WHILE,"
           "CONDITIONAL --xla_gpu_graph_min_graph_size=1"),
}


def trajectory():
  """Host-side plan of the loop, and the state before each step's decode.

  Returns (inputs, states): inputs feed the device loop; states[t] holds the
  cache, block table and lengths the decode of step t must see.
  """
  rng = np.random.default_rng(0)
  final = [n + STEPS for n in INIT_LENS]
  max_pages = -(-max(final) // PAGE) + 1
  num_pages = sum(-(-n // PAGE) for n in final) + 6
  free = list(rng.permutation(num_pages))
  d = 576
  cache = rng.standard_normal((num_pages, PAGE, d)).astype(np.float32)
  bt = np.full((B, max_pages), -1, np.int32)
  for b, n in enumerate(INIT_LENS):
    for j in range(-(-n // PAGE)):
      bt[b, j] = free.pop()
  sl = np.array(INIT_LENS, np.int32)
  init = dict(cache=cache.copy(), block_table=bt.copy(), seq_lens=sl.copy())
  queries = rng.standard_normal((STEPS, B, H, d)).astype(np.float32)
  new_kv = rng.standard_normal((STEPS, B, d)).astype(np.float32)
  moves = np.zeros((STEPS, 3), np.int32)          # request, table column, new page
  allocs = np.full((STEPS, B), -1, np.int32)      # page allocated by the append, or -1
  states = []
  for t in range(STEPS):
    r = t % B
    j = int(rng.integers(0, -(-sl[r] // PAGE)))
    new = free.pop(0)
    old = bt[r, j]
    cache[new] = cache[old]
    bt[r, j] = new
    free.append(old)
    moves[t] = (r, j, new)
    for b in range(B):
      pos = sl[b]
      if pos % PAGE == 0:
        allocs[t, b] = free.pop(0)
        bt[b, pos // PAGE] = allocs[t, b]
      cache[bt[b, pos // PAGE], pos % PAGE] = new_kv[t, b]
    sl = sl + 1
    states.append(dict(cache=cache.copy(), block_table=bt.copy(), seq_lens=sl.copy()))
  inputs = dict(init, queries=queries, new_kv=new_kv, moves=moves, allocs=allocs)
  return inputs, states


def _child(out_path, choice=""):
  """Runs both loops under the XLA_FLAGS of this process; saves the results.

  choice: "on" or "off" forces the combine's launch
  (KernelChoice.programmatic_combine); "fused" the combine fused into the
  seesaw kernel (KernelChoice.fused_combine, a cooperative launch); a kernel name ("portable",
  "sm90_lockstep") forces that decode kernel after the scheduler kernel
  (schedule "kernel"); empty: the plan's default (schedule "step": the
  schedule call, then the decode)."""
  import jax
  import jax.numpy as jnp

  import mla_jax
  from mla_jax import _ffi

  if choice in ("on", "off"):
    kernel = mla_jax.KernelChoice(programmatic_combine=choice == "on")
  elif choice == "fused":
    kernel = mla_jax.KernelChoice(fused_combine=True)
  elif choice:
    kernel = mla_jax.KernelChoice(kernel=choice, schedule="kernel")
  else:
    kernel = "auto"
  plan = mla_jax.DecodePlan(num_heads=H, page_size=PAGE, sm_scale=SM_SCALE, backend="auto", kernel=kernel)
  inputs, _ = trajectory()
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  rows = jnp.arange(B)

  def step(state, x):
    cache, bt, sl = state
    q, new_kv, move, alloc = x
    r, j, new = move[0], move[1], move[2]
    cache = cache.at[new].set(cache[bt[r, j]])          # move a live page
    bt = bt.at[r, j].set(new)
    col, slot = sl // PAGE, sl % PAGE                     # append one token per request
    page = jnp.where(alloc >= 0, alloc, bt[rows, col])
    bt = bt.at[rows, col].set(page)
    cache = cache.at[page, slot].set(new_kv)
    sl = sl + 1
    out, lse = mla_jax.paged_decode(q, cache, bt, sl, plan=plan, return_lse=True)
    return (cache, bt, sl), (out, lse, bt, sl)

  xs = (bf(inputs["queries"]), bf(inputs["new_kv"]), jnp.asarray(inputs["moves"]),
        jnp.asarray(inputs["allocs"]))
  init = (bf(inputs["cache"]), jnp.asarray(inputs["block_table"]),
          jnp.asarray(inputs["seq_lens"]))

  @jax.jit
  def scan_loop(init, xs):
    return jax.lax.scan(step, init, xs)[1]

  @jax.jit
  def fori_loop(init, xs):
    shapes = jax.eval_shape(lambda: step(init, jax.tree.map(lambda a: a[0], xs))[1])
    bufs = jax.tree.map(lambda s: jnp.zeros((STEPS,) + s.shape, s.dtype), shapes)

    def body(i, carry):
      state, bufs = carry
      state, res = step(state, jax.tree.map(lambda a: a[i], xs))
      return state, jax.tree.map(lambda buf, v: buf.at[i].set(v), bufs, res)

    return jax.lax.fori_loop(0, STEPS, body, (init, bufs))[1]

  results, info = {}, {"platform": jax.devices()[0].platform,
                       "cuda_kernels": _ffi.has_cuda_kernels(), "jax": jax.__version__}
  for name, fn in (("scan", scan_loop), ("fori", fori_loop)):
    compiled = fn.lower(init, xs).compile()
    hlo = compiled.as_text()
    info[name] = {"command_buffer": "%command_buffer" in hlo,
                  "cuda_target": _ffi.CUDA_TARGET in hlo,
                  "target_in_command_buffer": _target_in_command_buffer(hlo, _ffi.CUDA_TARGET)}
    out, lse, bt, sl = compiled(init, xs)
    results.update({f"{name}_out": np.asarray(out, np.float32), f"{name}_lse": np.asarray(lse),
                    f"{name}_bt": np.asarray(bt), f"{name}_sl": np.asarray(sl)})
  np.savez(out_path, info=json.dumps(info), **results)


def _target_in_command_buffer(hlo, target):
  """Whether a computation named %command_buffer* holds the custom call."""
  block, found = None, False
  for line in hlo.splitlines():
    if line and not line.startswith(" ") and "{" in line:
      block = line
    elif block and "%command_buffer" in block.split("(")[0] and target in line:
      found = True
  return found


def _captured_custom_calls(thunk_text):
  """Custom-call thunks nested in a command-buffer thunk (XLA's thunk dump)."""
  stack, n = [], 0                                   # (indent, thunk kind)
  for line in thunk_text.splitlines():
    m = re.match(r"( *)\d+: (\w+)", line)
    if not m:
      continue
    indent, kind = len(m.group(1)), m.group(2)
    while stack and stack[-1][0] >= indent:
      stack.pop()
    n += kind == "kCustomCall" and any(k == "kCommandBuffer" for _, k in stack)
    stack.append((indent, kind))
  return n


def _command_buffer_evidence(dump_dir, loop):
  """Files of the loop's dumped module that show a command buffer.

  Older XLA forms command buffers on HLO (a %command_buffer computation in
  the optimized module), newer XLA on thunks (kCommandBuffer in the thunk
  sequence after the thunk passes); either counts.
  """
  hits = []
  for path in sorted(dump_dir.glob(f"*{loop}_loop*")):
    if not path.is_file():
      continue
    text = path.read_text(errors="replace")
    if "kCommandBuffer" in text or "%command_buffer" in text:
      hits.append(path.name)
  return hits


def _run_mode(mode, tmp_path, choice=""):
  dump = tmp_path / f"dump_{mode}"
  env = dict(os.environ)
  env["XLA_FLAGS"] = " ".join(filter(None, [
      env.get("XLA_FLAGS", ""), MODES[mode], f"--xla_dump_to={dump}",
      "--xla_dump_hlo_module_re=.*(scan|fori)_loop.*"]))
  env.pop("JAX_PLATFORMS", None)
  out_path = tmp_path / f"{mode}.npz"
  proc = subprocess.run([sys.executable, __file__, str(out_path), choice], env=env,
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, f"mode {mode}: child failed\n{proc.stdout}\n{proc.stderr[-4000:]}"
  res = dict(np.load(out_path))
  info = json.loads(str(res.pop("info")))
  for loop in ("scan", "fori"):
    info[loop]["evidence"] = _command_buffer_evidence(dump, loop)
    info[loop]["captured_custom_calls"] = sum(
        _captured_custom_calls(p.read_text(errors="replace"))
        for p in dump.glob(f"*{loop}_loop*thunk_sequence_after_thunk_passes*"))
  return info, res


@pytest.fixture(scope="module")
def reference():
  import jax.numpy as jnp

  import mla_jax
  from mla_jax.testing import reference_paged_decode
  plan = mla_jax.DecodePlan(num_heads=H, page_size=PAGE, sm_scale=SM_SCALE)
  inputs, states = trajectory()
  r64 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
  outs, lses = [], []
  for t, s in enumerate(states):
    o, l = reference_paged_decode(r64(inputs["queries"][t])[:, None], r64(s["cache"]),
                                  s["block_table"], s["seq_lens"], plan)
    outs.append(o[:, 0])
    lses.append(l[:, 0])
  return dict(out=np.stack(outs), lse=np.stack(lses),
              bt=np.stack([s["block_table"] for s in states]),
              sl=np.stack([s["seq_lens"] for s in states]))


def _check_run(mode, info, res, reference):
  assert info["platform"] == "gpu", info
  for loop in ("scan", "fori"):   # the flags took effect
    if mode == "off":
      assert not info[loop]["evidence"], info
    if mode == "on":
      assert info[loop]["evidence"], info
      if info["cuda_kernels"] and info[loop]["cuda_target"]:
        # The kernel itself runs inside the CUDA graph (its FFI handler is
        # command-buffer compatible); the only custom call in the loop.
        assert info[loop]["captured_custom_calls"] >= 1 or info[loop][
            "target_in_command_buffer"], info
  if info["cuda_kernels"]:
    assert info["scan"]["cuda_target"] and info["fori"]["cuda_target"], info
  for loop in ("scan", "fori"):
    np.testing.assert_array_equal(res[f"{loop}_sl"], reference["sl"])
    np.testing.assert_array_equal(res[f"{loop}_bt"], reference["bt"])
    for t in range(STEPS):
      msg = f"mode {mode}, {loop}, step {t}"
      np.testing.assert_allclose(res[f"{loop}_out"][t], reference["out"][t], atol=2e-2, rtol=0,
                                 err_msg=msg)
      np.testing.assert_allclose(res[f"{loop}_lse"][t], reference["lse"][t], atol=1e-2, rtol=0,
                                 err_msg=msg)


@pytest.mark.gpu
def test_decode_loop_with_and_without_command_buffers(reference, tmp_path):
  runs = {mode: _run_mode(mode, tmp_path) for mode in MODES}
  for mode, (info, res) in runs.items():
    _check_run(mode, info, res, reference)
  base = runs["off"][1]
  for mode in ("default", "on"):
    for key in base:
      np.testing.assert_allclose(runs[mode][1][key], base[key], atol=1e-3, rtol=0,
                                 err_msg=f"{mode} vs off: {key}")
  print({mode: info for mode, (info, _) in runs.items()})


@pytest.mark.gpu
def test_decode_loop_in_command_buffers_with_programmatic_combine(reference, tmp_path):
  # A forced programmatic combine launch (csrc/smxx/pdl.cuh): captured into
  # the CUDA graph, it becomes a programmatic edge; the results must be
  # those of the plain launch, bit for bit.
  (tmp_path / "plain").mkdir()
  (tmp_path / "pdl").mkdir()
  _, plain = _run_mode("on", tmp_path / "plain", "off")
  info, res = _run_mode("on", tmp_path / "pdl", "on")
  _check_run("on", info, res, reference)
  for key in plain:
    np.testing.assert_array_equal(res[key], plain[key], err_msg=key)


@pytest.mark.gpu
def test_decode_loop_in_command_buffers_with_fused_combine(reference, tmp_path):
  # The combine fused into the seesaw kernel (a cooperative launch with a
  # grid barrier; auto leaves it off at this shape): captured into the CUDA
  # graph, its results must be those of the combine kernel, bit for bit.
  from test_cuda_kernel import _hopper_kernels_available
  if not _hopper_kernels_available():
    pytest.skip("the fused combine is the sm90_seesaw kernel's: an sm_90 GPU and a build with sm_90a code")
  (tmp_path / "plain").mkdir()
  (tmp_path / "fused").mkdir()
  _, plain = _run_mode("on", tmp_path / "plain", "off")
  info, res = _run_mode("on", tmp_path / "fused", "fused")
  _check_run("on", info, res, reference)
  for key in plain:
    np.testing.assert_array_equal(res[key], plain[key], err_msg=key)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["portable", "sm90_lockstep"])
def test_decode_loop_in_command_buffers_after_the_scheduler_kernel(kernel, reference, tmp_path):
  # These kernels follow the scheduler kernel as its programmatic dependents
  # (csrc/smxx/pdl.cuh): in the CUDA graph that is a programmatic edge. The
  # lengths grow every step, and at step 2 a request gains a 64-token
  # block, which changes the split schedule: a decode that read the
  # schedule before the scheduler wrote it would see the previous step's
  # items there.
  from test_cuda_kernel import _hopper_kernels_available
  if kernel.startswith("sm90") and not _hopper_kernels_available():
    pytest.skip(f"{kernel} needs an sm_90 GPU and a build with sm_90a code")
  info, res = _run_mode("on", tmp_path, kernel)
  _check_run("on", info, res, reference)


if __name__ == "__main__":
  _child(*sys.argv[1:])
