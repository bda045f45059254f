"""A small JetStream-like serving engine around mla_jax.paged_decode.

A DeepSeek-style decoder with random weights (MLA attention with absorbed
weights over a paged latent cache, RMS-normed latent, rope with YaRN
scaling, a gated MLP; no MoE), served with continuous batching:

* :class:`PageAllocator`: host-side free list of cache pages.
* :class:`Engine`: JetStream's method names, ``init_decode_state``,
  ``prefill``, ``insert``, ``generate``, plus :meth:`Engine.serve`, a loop
  that admits requests into free slots between steps, stops them at their
  length or stop token, and recycles their pages. Unlike JetStream's,
  ``prefill`` writes straight into the decode state's pages (no separate
  prefix cache to copy), so prefill cannot run on other devices.

With ``draft_tokens`` > 0 each step is speculative (:meth:`Engine.verify`):
every request feeds its last token and up to that many drafted tokens (from
a drafter such as :func:`ngram_drafter`) as one ragged query
(``cu_seqlens_q``), and keeps the drafts greedy decoding would have produced,
so each request accepts its own number of tokens per step.

Prefill runs a prompt in chunks: each chunk's latents are written into the
request's pages (:func:`mla_jax.append_kv`), then its queries attend causally
over the request's cache through XLA. Decode is one jitted step for all
slots with the cache donated: latents appended, then ``paged_decode`` per
layer. Block tables and lengths are host arrays sent with every step, as a
serving loop does.

Run ``python -m mla_jax serve`` for a demo.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .paged_cache import append_kv
from .paged_decode import paged_decode
from .plan import DecodePlan

KV_LORA_RANK = 512
ROPE_DIM = 64


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes of the decoder (kv_lora_rank 512 and rope 64 are the kernels')."""
  vocab_size: int = 1024
  hidden: int = 256
  num_layers: int = 2
  num_heads: int = 16
  qk_nope_head_dim: int = 128
  v_head_dim: int = 128
  mlp_hidden: int = 512
  rope_theta: float = 10000.0
  # YaRN (DeepSeek-V2/V3 "rope_scaling"): the low frequencies are divided by
  # `rope_factor`, the high ones kept; original_max_position places the ramp
  # between them (frequencies apply at every position).
  rope_factor: float = 4.0
  original_max_position: int = 1024
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 1.0
  mscale_all_dim: float = 1.0

  @property
  def sm_scale(self) -> float:
    """Softmax scale: 1/sqrt(q head dim), times YaRN's attention factor squared."""
    m = _yarn_mscale(self.rope_factor, self.mscale_all_dim)
    return float(m * m / math.sqrt(self.qk_nope_head_dim + ROPE_DIM))


def _yarn_mscale(factor: float, m: float) -> float:
  return 1.0 if factor <= 1.0 else 0.1 * m * math.log(factor) + 1.0


def rope_tables(cfg: ModelConfig, positions):
  """(cos, sin) float32 ``[..., 32]`` at ``positions`` with YaRN-scaled frequencies.

  YaRN (Peng et al. 2023, arXiv:2309.00071) as DeepSeek-V2 configures it:
  pairs turning more than ``beta_fast`` times over the original context keep
  their frequency, those turning fewer than ``beta_slow`` times are divided
  by ``rope_factor``, a linear ramp blends between; both tables carry the
  attention factor mscale(factor, mscale) / mscale(factor, mscale_all_dim).
  """
  half = ROPE_DIM // 2
  i = np.arange(half, dtype=np.float64)
  extrap = cfg.rope_theta ** (-2.0 * i / ROPE_DIM)
  interp = extrap / cfg.rope_factor
  # Dimension index whose wavelength fits `rot` turns into the original context.
  dim_of = lambda rot: ROPE_DIM * math.log(cfg.original_max_position / (rot * 2 * math.pi)) / (
      2 * math.log(cfg.rope_theta))
  low = max(math.floor(dim_of(cfg.beta_fast)), 0)
  high = min(math.ceil(dim_of(cfg.beta_slow)), ROPE_DIM - 1)
  ramp = np.clip((i - low) / max(high - low, 1e-3), 0.0, 1.0)
  inv_freq = interp * ramp + extrap * (1.0 - ramp)       # high frequencies kept, low ones interpolated
  att = _yarn_mscale(cfg.rope_factor, cfg.mscale) / _yarn_mscale(cfg.rope_factor, cfg.mscale_all_dim)
  angles = jnp.asarray(positions, jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
  return jnp.cos(angles) * att, jnp.sin(angles) * att


def apply_rope(x, cos, sin):
  """Rotate-half rope on the last axis of ``x`` (64); cos/sin broadcast over heads."""
  x1, x2 = x[..., :ROPE_DIM // 2], x[..., ROPE_DIM // 2:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rms_norm(x, w, eps=1e-6):
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * w).astype(x.dtype)


def init_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.bfloat16) -> dict:
  """Random weights, scaled so that activations stay O(1)."""
  keys = iter(jax.random.split(jax.random.key(seed), 4 + 9 * cfg.num_layers))
  w = lambda shape, fan_in: (jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)
  h, n, dn, dv = cfg.hidden, cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
  layers = []
  for _ in range(cfg.num_layers):
    layers.append(dict(
        attn_norm=jnp.ones((h,), jnp.float32), kv_norm=jnp.ones((KV_LORA_RANK,), jnp.float32),
        mlp_norm=jnp.ones((h,), jnp.float32),
        w_q=w((h, n, dn + ROPE_DIM), h), w_dkv=w((h, KV_LORA_RANK + ROPE_DIM), h),
        w_uk=w((n, dn, KV_LORA_RANK), KV_LORA_RANK), w_uv=w((n, KV_LORA_RANK, dv), KV_LORA_RANK),
        w_o=w((n, dv, h), n * dv), w_gate=w((h, cfg.mlp_hidden), h), w_up=w((h, cfg.mlp_hidden), h),
        w_down=w((cfg.mlp_hidden, h), cfg.mlp_hidden)))
  return dict(embed=w((cfg.vocab_size, h), 1.0), final_norm=jnp.ones((h,), jnp.float32),
              lm_head=w((h, cfg.vocab_size), h), layers=layers)


def project(cfg: ModelConfig, layer, x, positions):
  """Absorbed query ``[..., H, 576]`` and new latent ``[..., 576]`` of hidden ``x``."""
  xn = rms_norm(x, layer["attn_norm"])
  q = jnp.einsum("...d,dhe->...he", xn, layer["w_q"])
  q_nope, q_pe = q[..., :cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
  ckv_kpe = xn @ layer["w_dkv"]
  ckv = rms_norm(ckv_kpe[..., :KV_LORA_RANK], layer["kv_norm"])
  cos, sin = rope_tables(cfg, positions)
  q_pe = apply_rope(q_pe, cos[..., None, :], sin[..., None, :]).astype(x.dtype)
  kpe = apply_rope(ckv_kpe[..., KV_LORA_RANK:], cos, sin).astype(x.dtype)
  f32 = lambda a: a.astype(jnp.float32)  # (XLA:CPU has no bf16 x bf16 -> f32 dot)
  q_abs = jnp.einsum("...hn,hnc->...hc", f32(q_nope), f32(layer["w_uk"]))
  return (jnp.concatenate([q_abs.astype(x.dtype), q_pe], -1), jnp.concatenate([ckv, kpe], -1))


def attend_out(layer, latent_out):
  """``[..., H, 512]`` attention output in latent space -> hidden."""
  v = jnp.einsum("...hc,hcv->...hv", latent_out.astype(jnp.float32), layer["w_uv"].astype(jnp.float32))
  return jnp.einsum("...hv,hvd->...d", v.astype(latent_out.dtype), layer["w_o"])


def mlp(layer, x):
  xn = rms_norm(x, layer["mlp_norm"])
  return (jax.nn.silu(xn @ layer["w_gate"]) * (xn @ layer["w_up"])) @ layer["w_down"]


def logits(params, x):
  return (rms_norm(x, params["final_norm"]) @ params["lm_head"]).astype(jnp.float32)


def _greedy(lg):
  """Greedy tokens and their margins (top-1 minus top-2 logit): a small margin
  is a near tie, where float rounding may pick either token."""
  top, idx = jax.lax.top_k(lg, 2)
  return idx[..., 0].astype(jnp.int32), top[..., 0] - top[..., 1]


def ngram_drafter(tokens, k: int, max_ngram: int = 3) -> list:
  """Up to k draft tokens by prompt lookup (n-gram speculative decoding):
  the tokens that followed the latest earlier occurrence of the longest suffix (max_ngram down to 1
  tokens) of ``tokens``; none when no suffix recurs."""
  if k <= 0:
    return []
  tokens = list(tokens)
  for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
    suffix = tokens[-n:]
    for start in range(len(tokens) - n - 1, -1, -1):
      if tokens[start:start + n] == suffix:
        return tokens[start + n:start + n + k]
  return []


class PageAllocator:
  """Free list of cache pages (host side)."""

  def __init__(self, num_pages: int):
    self._free = list(range(num_pages - 1, -1, -1))
    self.num_pages = num_pages

  @property
  def free(self) -> int:
    return len(self._free)

  def alloc(self, n: int) -> list[int]:
    if n > len(self._free):
      raise RuntimeError(f"out of cache pages: {n} wanted, {len(self._free)} free")
    return [self._free.pop() for _ in range(n)]

  def release(self, pages) -> None:
    self._free.extend(reversed(list(pages)))


class Prefix(NamedTuple):
  """What prefill leaves: the request's pages (already written), its length and first token."""
  pages: list
  length: int
  first_token: int
  margin: float       # the first token's logit margin over the runner-up


@dataclasses.dataclass
class DecodeState:
  """The decode state: the paged cache (device) and each slot's metadata (host)."""
  cache: Any                  # one [num_pages, page_size, 576] array per layer
  block_table: np.ndarray     # int32 [slots, max_pages_per_seq], -1 unused
  seq_lens: np.ndarray        # int32 [slots]: tokens in the cache (0 for a free slot)
  tokens: np.ndarray          # int32 [slots]: the last token, input of the next step
  active: np.ndarray          # bool [slots]


@dataclasses.dataclass
class Request:
  prompt: list
  max_new_tokens: int
  stop_token: int | None = None
  output: list = dataclasses.field(default_factory=list)
  margins: list = dataclasses.field(default_factory=list)   # logit margin of each output token


class Engine:
  """Continuous-batching greedy decoder over a paged MLA latent cache."""

  def __init__(self, cfg: ModelConfig, params, *, num_pages: int, page_size: int = 64, max_slots: int = 8,
               max_pages_per_seq: int = 16, prefill_chunk: int = 64, backend: str = "auto", dtype=jnp.bfloat16,
               draft_tokens: int = 0):
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
      raise TypeError(f"dtype: the decode kernels take bfloat16 or float16, got {jnp.dtype(dtype)}")
    if not 0 <= draft_tokens <= 7:
      raise ValueError(f"draft_tokens: expected 0 (no speculation) to 7 (q_len 8), got {draft_tokens}")
    # The CPU kernel is registered for the CPU platform only: on a host with
    # a GPU, backend "cpu" keeps the weights and the cache on the CPU device.
    self.device = jax.devices("cpu")[0] if backend == "cpu" else None
    self.cfg, self.dtype = cfg, dtype
    self.params = params if self.device is None else jax.device_put(params, self.device)
    self.page_size, self.max_slots, self.max_pages = page_size, max_slots, max_pages_per_seq
    self.prefill_chunk = prefill_chunk
    self.allocator = PageAllocator(num_pages)
    self.plan = DecodePlan(num_heads=cfg.num_heads, page_size=page_size, sm_scale=cfg.sm_scale, backend=backend)
    # Speculative (MTP-style) steps verify up to draft_tokens proposed tokens
    # per request: a ragged query of 1 + (that request's drafts) tokens.
    self.draft_tokens = draft_tokens
    self.verify_plan = dataclasses.replace(self.plan, q_len=1 + draft_tokens)
    self._step = jax.jit(self._step_impl, donate_argnums=(1,))
    self._verify_step = jax.jit(self._verify_impl, donate_argnums=(1,))
    self._prefill_chunk = jax.jit(self._prefill_impl, donate_argnums=(1,))
    self.timings = dict(steps=0, step_s=[], prefill_s=0.0, drafted=0, accepted=0, query_lens=[])

  # --- JetStream interface ---------------------------------------------------
  def init_decode_state(self) -> DecodeState:
    shape = (self.allocator.num_pages, self.page_size, KV_LORA_RANK + ROPE_DIM)
    cache = [jnp.zeros(shape, self.dtype) for _ in range(self.cfg.num_layers)]
    if self.device is not None:
      cache = jax.device_put(cache, self.device)
    return DecodeState(cache=cache,
                       block_table=np.full((self.max_slots, self.max_pages), -1, np.int32),
                       seq_lens=np.zeros((self.max_slots,), np.int32),
                       tokens=np.zeros((self.max_slots,), np.int32), active=np.zeros((self.max_slots,), bool))

  def prefill(self, state: DecodeState, prompt) -> Prefix:
    """Writes the prompt's latents into newly allocated pages of ``state.cache``."""
    n = len(prompt)
    if not 1 <= n <= self.max_pages * self.page_size:
      raise ValueError(f"prompt: length {n} outside [1, {self.max_pages * self.page_size}]")
    pages = self.allocator.alloc(-(-n // self.page_size))
    row = np.full((1, self.max_pages), -1, np.int32)
    row[0, :len(pages)] = pages
    c = self.prefill_chunk
    toks = np.zeros((-(-n // c) * c,), np.int32)
    toks[:n] = prompt
    t0 = time.perf_counter()
    last = None
    for start in range(0, n, c):
      valid = min(c, n - start)
      state.cache, last = self._prefill_chunk(self.params, state.cache, jnp.asarray(toks[start:start + c]),
                                              np.int32(start), np.int32(valid), row)
    first, margin = jax.device_get(last)
    self.timings["prefill_s"] += time.perf_counter() - t0
    return Prefix(pages, n, int(first), float(margin))

  def insert(self, prefix: Prefix, state: DecodeState, slot: int) -> DecodeState:
    state.block_table[slot] = -1
    state.block_table[slot, :len(prefix.pages)] = prefix.pages
    state.seq_lens[slot] = prefix.length
    state.tokens[slot] = prefix.first_token
    state.active[slot] = True
    return state

  def generate(self, state: DecodeState) -> tuple[DecodeState, np.ndarray, np.ndarray]:
    """One decode step for every active slot: the next tokens [slots] and their margins."""
    counts = state.active.astype(np.int32)
    self._reserve(state, counts)
    new_lens = np.where(state.active, state.seq_lens + 1, 0).astype(np.int32)
    nxt, margin = self._timed_step(state, self._step, jnp.asarray(state.tokens), jnp.asarray(state.block_table),
                                   jnp.asarray(new_lens))
    state.seq_lens = np.where(state.active, new_lens, state.seq_lens).astype(np.int32)
    state.tokens = np.where(state.active, nxt, state.tokens).astype(np.int32)
    return state, nxt, margin

  def verify(self, state: DecodeState, drafts) -> tuple[DecodeState, list, list]:
    """One speculative step: each active slot's last token and its drafted
    tokens (``drafts[slot]``, at most ``draft_tokens``) run as one ragged
    query; the longest prefix of drafts the model itself would have produced
    (greedy) is accepted, plus the model's next token after it (greedy
    speculative decoding, Leviathan et al. 2023, "Fast Inference from
    Transformers via Speculative Decoding"). Returns the
    state and, per slot, the emitted tokens (1 to 1 + its drafts; empty for
    an inactive slot) and their margins. The cache keeps the accepted
    tokens; the rejected ones' latents lie past ``seq_lens`` and are
    overwritten later.

    Raises:
      RuntimeError: the engine has draft_tokens=0, a request would pass
        max_pages_per_seq * page_size tokens, or the pool is out of pages.
      ValueError: more drafts than draft_tokens, or token ids outside the
        vocabulary.
    """
    if self.draft_tokens == 0:
      raise RuntimeError("verify: this engine was built with draft_tokens=0")
    drafts = [list(drafts[k]) if state.active[k] else [] for k in range(self.max_slots)]
    for k, d in enumerate(drafts):
      if len(d) > self.draft_tokens:
        raise ValueError(f"drafts[{k}]: {len(d)} tokens, more than draft_tokens = {self.draft_tokens}")
      if any(not 0 <= t < self.cfg.vocab_size for t in d):
        raise ValueError(f"drafts[{k}]: token ids outside [0, vocab_size = {self.cfg.vocab_size})")
    counts = np.array([1 + len(d) if state.active[k] else 0 for k, d in enumerate(drafts)], np.int32)
    self._reserve(state, counts)
    width = self.max_slots * (1 + self.draft_tokens)      # fixed: one executable for every mix of counts
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    tokens = np.zeros((width,), np.int32)
    positions = np.zeros((width,), np.int32)
    for k in np.flatnonzero(counts):
      tokens[cu[k]:cu[k + 1]] = [state.tokens[k]] + drafts[k]
      positions[cu[k]:cu[k + 1]] = state.seq_lens[k] + np.arange(counts[k])
    new_lens = (state.seq_lens + counts).astype(np.int32)
    nxt, margin = self._timed_step(state, self._verify_step, jnp.asarray(tokens), jnp.asarray(positions),
                                   jnp.asarray(cu), jnp.asarray(state.block_table), jnp.asarray(new_lens))
    self.timings["query_lens"].append(counts[state.active].tolist())
    emitted, margins = [[] for _ in range(self.max_slots)], [[] for _ in range(self.max_slots)]
    for k in np.flatnonzero(counts):
      model = nxt[cu[k]:cu[k + 1]].tolist()          # the model's token after each fed token
      a = 0
      while a < len(drafts[k]) and drafts[k][a] == model[a]:
        a += 1
      emitted[k] = model[:a + 1]                      # the accepted drafts, then the model's next token
      margins[k] = margin[cu[k]:cu[k] + a + 1].tolist()
      self.timings["drafted"] += len(drafts[k])
      self.timings["accepted"] += a
      state.seq_lens[k] += 1 + a
      state.tokens[k] = model[a]
    return state, emitted, margins

  def _timed_step(self, state: DecodeState, step, *args):
    """Runs a jitted step on state.cache (donated) and returns its host
    (tokens, margins), recording the step's wall time."""
    t0 = time.perf_counter()
    state.cache, out = step(self.params, state.cache, *args)
    nxt, margin = (np.asarray(a) for a in jax.device_get(out))
    self.timings["step_s"].append(time.perf_counter() - t0)
    self.timings["steps"] += 1
    return nxt, margin

  def _reserve(self, state: DecodeState, counts) -> None:
    """Pages for positions seq_lens .. seq_lens + counts - 1 of every slot;
    checked for every slot before any page is taken, so a failure leaves the
    state as it was."""
    need = []
    for k in np.flatnonzero(counts):
      end = int(state.seq_lens[k]) + int(counts[k])
      if end > self.max_pages * self.page_size:
        raise RuntimeError(f"slot {k}: request would pass max_pages_per_seq * page_size tokens")
      need += [(k, j) for j in range(int(state.seq_lens[k]) // self.page_size, -(-end // self.page_size))
               if state.block_table[k, j] < 0]
    for (k, j), page in zip(need, self.allocator.alloc(len(need))):
      state.block_table[k, j] = page

  def attention_share(self, seq_len: int, reps: int = 5) -> tuple[float, float]:
    """(step seconds, attention seconds) of one decode step with every slot at
    ``seq_len`` tokens: the jitted step against a jitted program of the same
    ``num_layers`` paged_decode calls on the same shapes (medians over reps)."""
    pages = -(-seq_len // self.page_size)
    if pages > min(self.max_pages, self.allocator.num_pages // self.max_slots):
      raise ValueError(f"seq_len {seq_len}: more pages than a slot can hold")
    bt = np.full((self.max_slots, self.max_pages), -1, np.int32)
    bt[:, :pages] = np.arange(self.max_slots * pages).reshape(self.max_slots, pages)
    lens = np.full((self.max_slots,), seq_len, np.int32)
    tokens = np.zeros((self.max_slots,), np.int32)
    query = jnp.zeros((self.max_slots, self.cfg.num_heads, KV_LORA_RANK + ROPE_DIM), self.dtype) + 0.01
    attn = jax.jit(lambda q, cache, bt, lens: [paged_decode(q + i, kv, bt, lens, plan=self.plan)
                                               for i, kv in enumerate(cache)])
    state = self.init_decode_state()

    def timed(fn):
      times = []
      for _ in range(reps + 1):                 # the first call compiles
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
      return float(np.median(times[1:]))

    def step():
      state.cache, out = self._step(self.params, state.cache, jnp.asarray(tokens), jnp.asarray(bt),
                                    jnp.asarray(lens))
      return out
    return timed(step), timed(lambda: attn(query, state.cache, jnp.asarray(bt), jnp.asarray(lens)))

  def release(self, state: DecodeState, slot: int) -> None:
    row = state.block_table[slot]
    self.allocator.release(row[row >= 0].tolist())   # speculative steps may hold pages past seq_lens
    state.block_table[slot] = -1
    state.seq_lens[slot] = 0
    state.active[slot] = False

  def _pages_for(self, req: Request) -> int:
    """Pages a request fills: its prompt and every output token but the last, which is never cached."""
    return -(-(len(req.prompt) + req.max_new_tokens - 1) // self.page_size)

  def serve(self, requests: list[Request], drafter=None) -> list[Request]:
    """Runs every request to completion with continuous batching (greedy).

    Requests are admitted in order into free slots between steps, each once
    the pool can hold its whole length (prompt + max_new_tokens), so a
    running request never waits for a page. With ``draft_tokens`` > 0 every
    step is a speculative one (:meth:`verify`): ``drafter(tokens, k)``
    proposes up to k next tokens for a request whose tokens so far (prompt
    and output) are ``tokens`` (default :func:`ngram_drafter`); greedy
    verification makes the output the same as without drafts, up to
    rounding at near ties.

    Raises:
      ValueError: a request longer than a slot (max_pages_per_seq pages) or
        the pool can hold, or with an empty prompt.
    """
    for i, req in enumerate(requests):
      need = self._pages_for(req)
      if not req.prompt or req.max_new_tokens < 1 or need > min(self.max_pages, self.allocator.num_pages):
        raise ValueError(f"requests[{i}]: prompt of {len(req.prompt)} tokens and max_new_tokens "
                         f"{req.max_new_tokens} do not fit a slot of {self.max_pages} pages of {self.page_size} "
                         f"tokens ({self.allocator.num_pages} pages in the pool)")
    state = self.init_decode_state()
    queue, owner = list(requests), [None] * self.max_slots
    while queue or any(r is not None for r in owner):
      for slot in range(self.max_slots):      # admit into free slots between steps
        if owner[slot] is not None or not queue:
          continue
        held = sum(self._pages_for(r) - int(np.sum(state.block_table[k] >= 0))
                   for k, r in enumerate(owner) if r is not None)   # pages running requests will still take
        if self.allocator.free - held < self._pages_for(queue[0]):
          if not any(r is not None for r in owner):   # nothing will free a page
            raise RuntimeError(f"the pool has {self.allocator.free} free pages with nothing running, and the "
                               f"next request needs {self._pages_for(queue[0])}: pages were not released")
          break                                      # wait for running requests to finish
        req = queue.pop(0)
        prefix = self.prefill(state, req.prompt)
        req.output.append(prefix.first_token)
        req.margins.append(prefix.margin)
        owner[slot] = req
        state = self.insert(prefix, state, slot)
        self._maybe_finish(state, owner, slot)
      if not any(r is not None for r in owner):
        continue
      if self.draft_tokens:
        draft = drafter or ngram_drafter
        # Drafts never take a request past max_new_tokens (so never past the pages it reserved).
        room = [0 if r is None else min(self.draft_tokens, r.max_new_tokens - len(r.output) - 1) for r in owner]
        drafts = [[] if r is None else list(draft(r.prompt + r.output, k))[:k] for r, k in zip(owner, room)]
        state, emitted, margins = self.verify(state, drafts)
      else:
        state, nxt, margin = self.generate(state)
        emitted = [[int(t)] for t in nxt]
        margins = [[float(m)] for m in margin]
      for slot, req in enumerate(owner):
        if req is None:
          continue
        for tok, m in zip(emitted[slot], margins[slot]):
          req.output.append(int(tok))
          req.margins.append(float(m))
          if self._maybe_finish(state, owner, slot):
            break
    return requests

  def _maybe_finish(self, state, owner, slot) -> bool:
    req = owner[slot]
    if len(req.output) >= req.max_new_tokens or (req.stop_token is not None and req.output[-1] == req.stop_token):
      self.release(state, slot)
      owner[slot] = None
      return True
    return False

  # --- jitted programs ---------------------------------------------------------
  def _step_impl(self, params, cache, tokens, block_table, seq_lens):
    x = params["embed"][tokens]                                   # [B, hidden]
    positions = jnp.maximum(seq_lens - 1, 0)
    new_cache = []
    for layer, kv in zip(params["layers"], cache):
      query, latent = project(self.cfg, layer, x, positions)      # [B, H, 576], [B, 576]
      kv = append_kv(kv, latent[:, None], block_table, seq_lens)  # free slots (seq_lens 0) write nothing
      out = paged_decode(query, kv, block_table, seq_lens, plan=self.plan)
      x = x + attend_out(layer, out)
      x = x + mlp(layer, x)
      new_cache.append(kv)
    return new_cache, _greedy(logits(params, x))

  def _verify_impl(self, params, cache, tokens, positions, cu, block_table, seq_lens):
    """A ragged step: row t of ``tokens`` belongs to the request whose range
    in ``cu`` holds it; rows past cu[B] are padding (written nowhere)."""
    x = params["embed"][tokens]                                   # [T, hidden]
    new_cache = []
    for layer, kv in zip(params["layers"], cache):
      query, latent = project(self.cfg, layer, x, positions)      # [T, H, 576], [T, 576]
      kv = append_kv(kv, latent, block_table, seq_lens, cu_seqlens_q=cu)
      out = paged_decode(query, kv, block_table, seq_lens, plan=self.verify_plan, cu_seqlens_q=cu)
      x = x + attend_out(layer, out)
      x = x + mlp(layer, x)
      new_cache.append(kv)
    return new_cache, _greedy(logits(params, x))

  def _prefill_impl(self, params, cache, tokens, start, valid, block_table):
    """One chunk of C tokens at positions start .. start + C - 1, ``valid`` of them real."""
    c = tokens.shape[0]
    positions = start + jnp.arange(c, dtype=jnp.int32)
    x = params["embed"][tokens]
    pos_all = jnp.arange(self.max_pages * self.page_size)
    cu = jnp.stack([jnp.int32(0), valid])                         # rows past `valid` write nothing
    new_cache = []
    for layer, kv in zip(params["layers"], cache):
      query, latent = project(self.cfg, layer, x, positions)      # [C, H, 576], [C, 576]
      kv = append_kv(kv, latent, block_table, (start + valid)[None], cu_seqlens_q=cu)
      keys = kv[jnp.clip(block_table[0], 0)].reshape(-1, kv.shape[-1]).astype(jnp.float32)
      keys = jnp.where((pos_all < start + valid)[:, None], keys, 0.0)  # unwritten slots: whatever a page held
      scores = jnp.einsum("chd,nd->chn", query.astype(jnp.float32), keys) * self.cfg.sm_scale
      visible = (pos_all[None, :] <= positions[:, None]) & (pos_all[None, :] < start + valid)
      probs = jax.nn.softmax(jnp.where(visible[:, None, :], scores, -jnp.inf), axis=-1)
      out = jnp.einsum("chn,nd->chd", probs, keys[:, :KV_LORA_RANK]).astype(x.dtype)
      x = x + attend_out(layer, out)
      x = x + mlp(layer, x)
      new_cache.append(kv)
    return new_cache, _greedy(logits(params, x[valid - 1]))


def demo(num_requests: int = 24, *, backend: str = "auto", seed: int = 0, cfg: ModelConfig | None = None,
         page_size: int = 64, max_slots: int = 8, draft_tokens: int = 0) -> dict:
  """Serves random requests of mixed lengths; returns throughput figures."""
  cfg = cfg or ModelConfig()
  rng = np.random.default_rng(seed)
  params = init_params(cfg, seed)
  max_pages = 8
  engine = Engine(cfg, params, num_pages=max_slots * max_pages + 8, page_size=page_size, max_slots=max_slots,
                  max_pages_per_seq=max_pages, backend=backend, draft_tokens=draft_tokens)
  reqs = [Request(prompt=rng.integers(0, cfg.vocab_size, int(rng.integers(4, 200))).tolist(),
                  max_new_tokens=int(rng.integers(4, 48))) for _ in range(num_requests)]
  t0 = time.perf_counter()
  engine.serve(reqs)
  wall = time.perf_counter() - t0
  generated = sum(len(r.output) for r in reqs)
  t = engine.timings
  steps = t["step_s"][1:] or t["step_s"]       # the first step compiles
  step_s, attn_s = engine.attention_share(seq_len=max_pages * page_size // 2)
  return dict(requests=num_requests, generated_tokens=generated, wall_s=wall, decode_steps=t["steps"],
              step_ms=1e3 * float(np.median(steps)), prefill_s=t["prefill_s"],
              probe_seq_len=max_pages * page_size // 2, probe_step_ms=1e3 * step_s, probe_attention_ms=1e3 * attn_s,
              tokens_per_s=generated / wall, free_pages_after=engine.allocator.free,
              drafted=t["drafted"], accepted=t["accepted"],
              pages=engine.allocator.num_pages, outputs=[r.output for r in reqs],
              margins=[r.margins for r in reqs])
