"""FlashMLA's dense decode, timed in this process on the benchmark's own data.

bench_paged_decode.py uses this module when ``torch`` and ``flash_mla``
(deepseek-ai/FlashMLA, built outside this project: see benchmarks/README.md)
are importable on a GPU host; without them every FlashMLA cell reads "-".

FlashMLA is timed as serving stacks run it: n calls captured in one
``torch.cuda.CUDAGraph`` (after a warm-up on a side stream), replayed and
timed with CUDA events; per call = the slope between two n, the same n as
mla_jax's programs, every call on its own query and on cache copy i % R.
The scheduling metadata is computed by the first (warm-up) call and reused
by every captured call, as a serving step reuses it across layers. Beside
it, for reference only, a do_bench-style figure: CUDA events around one call
after an L2 flush, median over calls.

The data are the benchmark's JAX arrays, shared with torch through DLPack
(no copy): query [B, q_len, H, 576], cache [pages, page_size, 576] viewed as
[pages, page_size, 1, 576], the same block table and lengths.
"""

from __future__ import annotations

import gc
import statistics

import numpy as np


def load():
  """(Peer, None) when FlashMLA can run here, else (None, why not)."""
  try:
    import torch
  except Exception as e:  # noqa: BLE001 - any import failure means "no peer"
    return None, f"torch is not importable ({type(e).__name__}: {e})"
  if not torch.cuda.is_available():
    return None, "torch sees no CUDA device"
  try:
    import flash_mla
  except Exception as e:  # noqa: BLE001
    return None, f"flash_mla is not importable ({type(e).__name__}: {e})"
  return Peer(torch, flash_mla), None


def torch_ceilings(reps=5):
  """Peer.ceilings() with torch alone (FlashMLA need not be built); None without torch or a CUDA device."""
  try:
    import torch
  except Exception:  # noqa: BLE001
    return None
  if not torch.cuda.is_available():
    return None
  return Peer(torch, None).ceilings(reps)


class Peer:
  def __init__(self, torch, flash_mla):
    self.torch = torch
    self.fm = flash_mla
    self.device = torch.device("cuda", 0)
    self.version = getattr(flash_mla, "__version__", "unknown")
    self._flush = None

  def _event_pair(self):
    t = self.torch
    return t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)

  def _timed(self, fn):
    """Seconds of fn() on the current stream, by CUDA events."""
    start, end = self._event_pair()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3

  def _capture(self, call, n):
    """A CUDA graph of call(0) .. call(n - 1); returns the graph and its outputs (kept alive)."""
    t = self.torch
    side = t.cuda.Stream()
    side.wait_stream(t.cuda.current_stream())
    with t.cuda.stream(side):  # capture needs its kernels warmed up off the capturing stream
      for i in range(n):
        call(i)
    t.cuda.current_stream().wait_stream(side)
    t.cuda.synchronize()
    gc.collect()  # no Python-side frees of device buffers during the capture
    graph = t.cuda.CUDAGraph()
    # thread_local: CUDA calls of JAX's runtime threads during the capture must not invalidate it.
    with t.cuda.graph(graph, capture_error_mode="thread_local"):
      outs = [call(i) for i in range(n)]
    return graph, outs

  def _l2_flush(self):
    if self._flush is None:  # 256 MB, over 4x the H100/H200 L2
      self._flush = self.torch.empty(256 << 20, dtype=self.torch.int8, device=self.device)
    self._flush.zero_()

  def dense_decode(self, qs, caches, block_table, seq_lens, *, causal, sm_scale, n_lo, n_hi, reps,
                   dobench_calls=30):
    """Times FlashMLA on one benchmark row. qs: n_hi or more JAX query arrays; caches:
    the rotation's JAX cache arrays; block_table, seq_lens: host int32 arrays.

    Returns a JSON-able dict (us, samples_us, us_dobench, ...) and, under the
    key "result", (out [B, q_len, H, 512], lse [B, q_len, H]) of call 0 as
    NumPy arrays, for the benchmark's reference check.
    """
    import jax
    t = self.torch
    jax.block_until_ready((qs, caches))
    q_t = [t.from_dlpack(q) for q in qs[:n_hi]]
    c_t = [t.from_dlpack(c).unsqueeze(2) for c in caches]
    bt = t.from_numpy(np.ascontiguousarray(block_table, np.int32)).to(self.device)
    sl = t.from_numpy(np.ascontiguousarray(seq_lens, np.int32)).to(self.device)
    meta, _ = self.fm.get_mla_metadata()

    def call(i):
      return self.fm.flash_mla_with_kvcache(q_t[i], c_t[i % len(c_t)], bt, sl, 512, meta, None,
                                            softmax_scale=sm_scale, causal=causal)

    return self._time_calls(call, len(q_t), n_lo, n_hi, reps, dobench_calls)

  def sparse_decode(self, qs, caches, indices, *, sm_scale, n_lo, n_hi, reps, dobench_calls=30):
    """Times FlashMLA's sparse decode (DeepSeek V3.2) on one row. qs: JAX queries
    [B, q_len, H, 576]; caches: the rotation's JAX caches, uint8 [pages, page_size, 656] in
    the fp8_ds_mla layout (FlashMLA's own byte layout, read as it is) or bf16 [pages,
    page_size, 576] (FlashMLA is asked for its bf16 sparse decode; a build without one raises,
    and the caller records that); indices: JAX int32 [B, q_len, topk] global slots. Returns
    what dense_decode returns."""
    import jax
    t = self.torch
    jax.block_until_ready((qs, caches, indices))
    q_t = [t.from_dlpack(q) for q in qs[:n_hi]]
    fp8 = caches[0].dtype == np.uint8
    c_t = [(t.from_dlpack(c).view(t.float8_e4m3fn) if fp8 else t.from_dlpack(c)).unsqueeze(2) for c in caches]
    idx = t.from_dlpack(indices)
    meta, _ = self.fm.get_mla_metadata()

    def call(i):
      return self.fm.flash_mla_with_kvcache(q_t[i], c_t[i % len(c_t)], None, None, 512, meta, None,
                                            softmax_scale=sm_scale, is_fp8_kvcache=fp8, indices=idx)

    return self._time_calls(call, len(q_t), n_lo, n_hi, reps, dobench_calls)

  def _time_calls(self, call, n_q, n_lo, n_hi, reps, dobench_calls):
    t = self.torch
    try:
      out0, lse0 = call(0)  # also computes the scheduling metadata every later call reuses
      t.cuda.synchronize()
      result = (out0.float().cpu().numpy(), lse0.transpose(1, 2).float().cpu().numpy())
      del out0, lse0
      slopes, per_call_hi, dobench = [], [], []
      graphs = [self._capture(call, n) for n in (n_lo, n_hi)]
      (g_lo, _), (g_hi, _) = graphs
      self._timed(g_lo.replay)
      self._timed(g_hi.replay)
      for _ in range(reps):
        t_lo = self._timed(g_lo.replay)
        t_hi = self._timed(g_hi.replay)
        slopes.append((t_hi - t_lo) / (n_hi - n_lo))
        per_call_hi.append(t_hi / n_hi)
      del graphs, g_lo, g_hi
      for i in range(dobench_calls):
        self._l2_flush()
        dobench.append(self._timed(lambda: call(i % n_q)))
    finally:
      # Hand the graphs' and outputs' memory back, also after a failure: JAX allocates
      # from the same GPU.
      self._flush = None
      gc.collect()
      t.cuda.empty_cache()
    slope = statistics.median(slopes)
    return dict(
        us=(slope if slope > 0 else statistics.median(per_call_hi)) * 1e6,
        samples_us=[round(s * 1e6, 3) for s in slopes],
        us_graph_per_call=statistics.median(per_call_hi) * 1e6,
        us_dobench=statistics.median(dobench) * 1e6,
        n_lo=n_lo, n_hi=n_hi, reps=reps, result=result,
        method=("CUDA graph of n calls (own query each, cache copy i % R, metadata from a warm-up "
                "call), replay timed by CUDA events, slope between n_lo and n_hi; us_dobench: events "
                "around one call after an L2 flush, median"))

  def ceilings(self, reps=5):
    """Device-to-device copy (bytes read + written) and bf16 matmul, by CUDA events."""
    t = self.torch
    res = {}
    src = t.empty(1 << 30, dtype=t.uint8, device=self.device).view(t.bfloat16)
    dst = t.empty_like(src)
    src.fill_(1)

    def copies(n):
      for _ in range(n):
        dst.copy_(src)

    copies(2)
    slopes = [(self._timed(lambda: copies(10)) - self._timed(lambda: copies(5))) / 5 for _ in range(reps)]
    s = statistics.median(slopes)
    nbytes = 2 * src.numel() * 2
    res["memcpy"] = dict(bytes_per_call=nbytes, us=s * 1e6, bw_Bps=nbytes / s,
                         method="torch dst.copy_(src), 1 GiB device to device, events, slope 5 -> 10 copies; "
                                "bytes = read + write")
    del src, dst
    m = 8192
    a = t.randn(m, m, device=self.device, dtype=t.bfloat16)
    b = t.randn(m, m, device=self.device, dtype=t.bfloat16)

    def mms(n):
      for _ in range(n):
        t.matmul(a, b)

    mms(2)
    slopes = [(self._timed(lambda: mms(10)) - self._timed(lambda: mms(5))) / 5 for _ in range(reps)]
    s = statistics.median(slopes)
    res["matmul"] = dict(m=m, us=s * 1e6, flops_per_s=2 * m ** 3 / s,
                         method=f"torch.matmul bf16 [{m}x{m}]@[{m}x{m}], events, slope 5 -> 10 calls")
    del a, b
    t.cuda.empty_cache()
    return res
