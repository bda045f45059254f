"""mla_jax.serving: the engine against itself across backends, its attention
against the unabsorbed layer in float64, and its page bookkeeping."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax import serving

NEAR_TIE = 0.03   # logit margin below which rounding may pick either token (median margin ~0.2)
SMALL = serving.ModelConfig(vocab_size=256, hidden=128, num_layers=2, num_heads=8, mlp_hidden=256,
                            original_max_position=64)   # a short original context: the ramp falls mid-spectrum


def _requests(n, seed=3):
  rng = np.random.default_rng(seed)
  return [serving.Request(prompt=rng.integers(0, SMALL.vocab_size, int(rng.integers(1, 90))).tolist(),
                          max_new_tokens=int(rng.integers(1, 30))) for _ in range(n)]


def _run(backend, seed=3, n=10, max_slots=4, page_size=16, num_pages=None, engine_cls=serving.Engine):
  params = serving.init_params(SMALL, seed)
  engine = engine_cls(SMALL, params, num_pages=num_pages or max_slots * 8 + 4, page_size=page_size,
                      max_slots=max_slots, max_pages_per_seq=8, prefill_chunk=32, backend=backend)
  reqs = _requests(n, seed)
  engine.serve(reqs)
  return engine, reqs


@pytest.fixture(scope="module")
def cpu_run():
  """Ten requests through four slots with the C++ kernel (shared: it takes seconds)."""
  return _run("cpu")


def test_backends_generate_the_same_tokens(cpu_run):
  # Greedy decode with the C++ kernel and with the pure-JAX backend: the same
  # tokens, except that a stream may part at a near tie (a logit margin
  # below NEAR_TIE in either run), where bf16 rounding decides; most streams
  # must match to the end.
  _, b = _run("xla")
  _assert_same_streams(cpu_run[1], b)


def _assert_same_streams(a, b):
  same = 0
  for ra, rb in zip(a, b):
    assert len(ra.output) == len(rb.output) == ra.max_new_tokens
    if ra.output == rb.output:
      same += 1
      continue
    j = next(k for k in range(len(ra.output)) if ra.output[k] != rb.output[k])
    assert min(ra.margins[j], rb.margins[j]) < NEAR_TIE, (j, ra.margins[j], rb.margins[j])
  assert same >= 0.8 * len(a)


def test_pages_are_recycled(cpu_run):
  engine, reqs = cpu_run
  assert engine.allocator.free == engine.allocator.num_pages     # everything returned
  assert all(len(r.output) == r.max_new_tokens for r in reqs)
  # More tokens were served than the pool holds: pages were reused.
  tokens = sum(len(r.prompt) + len(r.output) for r in reqs)
  assert tokens > engine.allocator.num_pages * engine.page_size


def test_small_pool_admits_requests_as_pages_free():
  # A pool that holds one long request at a time: requests wait for pages
  # instead of failing, and get the tokens they get with a roomy pool (up to
  # near ties: in other batches the kernel may split the KV differently).
  _, roomy = _run("cpu", n=6)
  engine, tight = _run("cpu", n=6, num_pages=8)
  assert engine.allocator.free == 8
  _assert_same_streams(roomy, tight)
  with pytest.raises(ValueError, match="requests\\[0\\]: prompt of 120 tokens"):
    engine.serve([serving.Request(prompt=[1] * 120, max_new_tokens=20)])


def test_stop_token_ends_a_request(cpu_run):
  prompt = cpu_run[1][0].prompt
  params = serving.init_params(SMALL, 3)
  make = lambda: serving.Engine(SMALL, params, num_pages=36, page_size=16, max_slots=4, max_pages_per_seq=8,
                                prefill_chunk=32, backend="cpu")
  free = serving.Request(prompt=prompt, max_new_tokens=8)
  make().serve([free])
  stop = free.output[2]
  req = serving.Request(prompt=prompt, max_new_tokens=8, stop_token=stop)
  engine = make()
  engine.serve([req])
  assert req.output == free.output[:free.output.index(stop) + 1]
  assert engine.allocator.free == 36


def _np_rope(cfg, x, pos):
  cos, sin = (np.asarray(t, np.float64) for t in serving.rope_tables(cfg, np.asarray(pos)))
  while cos.ndim < x.ndim:
    cos, sin = cos[..., None, :], sin[..., None, :]
  h = x.shape[-1] // 2
  return np.concatenate([x[..., :h] * cos - x[..., h:] * sin, x[..., h:] * cos + x[..., :h] * sin], -1)


def _np_rms(x, w, eps=1e-6):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def test_decode_attention_matches_the_unabsorbed_layer_in_float64():
  with jax.default_device(jax.devices("cpu")[0]):  # backend "cpu" runs on the CPU device, also on a GPU host
    _decode_attention_matches_the_unabsorbed_layer()


def _decode_attention_matches_the_unabsorbed_layer():
  # Layer 0 of a decode step, absorbed (project + paged_decode + attend_out,
  # as the engine runs it), against multi-head attention with the keys and
  # values up-projected from the latents, in float64 from the same bf16
  # weights and inputs.
  cfg = SMALL
  rng = np.random.default_rng(5)
  params = serving.init_params(cfg, 5)
  layer = params["layers"][0]
  page_size, batch = 16, 3
  lens = np.asarray([70, 1, 33], np.int32)                     # positions past original_max_position too
  pages = rng.permutation(20)
  bt = np.full((batch, 6), -1, np.int32)
  k = 0
  for b, n in enumerate(lens):
    m = -(-n // page_size)
    bt[b, :m] = pages[k:k + m]
    k += m
  x_all = jnp.asarray(rng.standard_normal((batch, int(lens.max()), cfg.hidden)), jnp.bfloat16)
  cache = jnp.zeros((20, page_size, 576), jnp.bfloat16)
  for t in range(int(lens.max())):          # the latents of every position, as prefill and steps write them
    live = t < lens
    _, latent = serving.project(cfg, layer, x_all[:, t], np.full(batch, t))
    cache = serving.append_kv(cache, latent[:, None], bt, np.where(live, t + 1, 0).astype(np.int32))
  x = x_all[np.arange(batch), lens - 1]
  query, _ = serving.project(cfg, layer, x, lens - 1)
  plan = serving.DecodePlan(num_heads=cfg.num_heads, page_size=page_size, sm_scale=cfg.sm_scale, backend="cpu")
  got = np.asarray(serving.attend_out(layer, serving.paged_decode(query, cache, bt, lens, plan=plan)), np.float64)

  f = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  w_q, w_dkv, w_uk, w_uv, w_o = (f(layer[n]) for n in ("w_q", "w_dkv", "w_uk", "w_uv", "w_o"))
  dn = cfg.qk_nope_head_dim
  for b in range(batch):
    n = int(lens[b])
    xs = f(x_all[b, :n])                                       # [n, hidden]
    xn = _np_rms(xs, f(layer["attn_norm"]))
    lat = xn @ w_dkv
    ckv = _np_rms(lat[:, :512], f(layer["kv_norm"]))
    kpe = _np_rope(cfg, lat[:, 512:], np.arange(n))            # [n, 64]
    k_nope = np.einsum("nc,hdc->nhd", ckv, w_uk)               # [n, H, 128]
    v = np.einsum("nc,hcv->nhv", ckv, w_uv)                    # [n, H, 128]
    q = xn[-1] @ w_q.reshape(cfg.hidden, -1)
    q = q.reshape(cfg.num_heads, dn + 64)
    q_nope, q_pe = q[:, :dn], _np_rope(cfg, q[None, :, dn:], np.asarray([n - 1]))[0]
    s = (np.einsum("hd,nhd->hn", q_nope, k_nope) + np.einsum("hr,nr->hn", q_pe, kpe)) * cfg.sm_scale
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("hn,nhv,hvd->d", p, v, w_o)
    rel = np.linalg.norm(got[b] - want) / np.linalg.norm(want)
    assert rel < 3e-2, (b, rel)


def test_sm_scale_includes_yarn_factor():
  cfg = serving.ModelConfig(rope_factor=40.0, mscale_all_dim=1.0)
  m = 0.1 * math.log(40.0) + 1.0
  assert math.isclose(cfg.sm_scale, m * m / math.sqrt(192.0))
  assert math.isclose(serving.ModelConfig(rope_factor=1.0).sm_scale, 1 / math.sqrt(192.0))


def test_prefill_rejects_bad_prompts():
  engine = serving.Engine(SMALL, serving.init_params(SMALL), num_pages=8, page_size=16, max_slots=2,
                          max_pages_per_seq=2, backend="xla")
  state = engine.init_decode_state()
  with pytest.raises(ValueError, match="prompt: length 0"):
    engine.prefill(state, [])
  with pytest.raises(ValueError, match="prompt: length 33"):
    engine.prefill(state, [1] * 33)


def test_yarn_frequencies():
  # At position 1 the rope angle of pair i is its frequency: the fast pairs
  # (more than beta_fast turns over the original context) keep theta^(-2i/64),
  # the slow ones (fewer than beta_slow turns) are divided by the factor, the
  # ones between are blended; cos at position 0 is YaRN's attention factor.
  cfg = serving.ModelConfig(rope_factor=8.0, original_max_position=4096, mscale=1.0, mscale_all_dim=0.5)
  cos, sin = (np.asarray(t, np.float64) for t in serving.rope_tables(cfg, np.asarray([0, 1])))
  att = (0.1 * math.log(8.0) + 1.0) / (0.05 * math.log(8.0) + 1.0)
  np.testing.assert_allclose(cos[0], att, rtol=1e-6)
  freq = np.arctan2(sin[1], cos[1])
  base = cfg.rope_theta ** (-np.arange(32) * 2.0 / 64)
  turns = cfg.original_max_position * base / (2 * math.pi)
  fast, slow = turns > cfg.beta_fast, turns < cfg.beta_slow
  assert fast.any() and slow.any() and (~fast & ~slow).any()
  np.testing.assert_allclose(freq[fast][:-1], base[fast][:-1], rtol=1e-5)   # the edge pairs may blend
  np.testing.assert_allclose(freq[slow][1:], base[slow][1:] / 8.0, rtol=1e-5)
  mid = ~fast & ~slow
  assert np.all((freq[mid] <= base[mid] * (1 + 1e-6)) & (freq[mid] >= base[mid] / 8.0 * (1 - 1e-6)))


class _PoisonedEngine(serving.Engine):
  def init_decode_state(self):
    state = super().init_decode_state()
    state.cache = [jnp.full_like(c, jnp.nan) for c in state.cache]
    return state


def test_unwritten_cache_slots_may_hold_nan():
  # Pages come from the pool with whatever they held; the engine never lets an
  # unwritten slot reach a result: the same tokens and margins, all finite.
  _, clean = _run("cpu", n=4)
  _, poisoned = _run("cpu", n=4, engine_cls=_PoisonedEngine)
  assert [r.output for r in poisoned] == [r.output for r in clean]
  assert [r.margins for r in poisoned] == [r.margins for r in clean]
  assert np.isfinite(np.concatenate([r.margins for r in poisoned])).all()


def test_prefill_chunks_agree_with_token_by_token_decode():
  # The first token after a prompt, from chunked prefill at several chunk
  # sizes, and from feeding the prompt through decode steps one token at a
  # time (teacher forcing: the decode kernel's causal path): chunk offsets
  # and the prefill mask must not matter.
  params = serving.init_params(SMALL, 7)
  prompt = np.random.default_rng(7).integers(0, SMALL.vocab_size, 45).tolist()
  make = lambda chunk: serving.Engine(SMALL, params, num_pages=12, page_size=16, max_slots=1, max_pages_per_seq=4,
                                      prefill_chunk=chunk, backend="cpu")
  firsts = []
  for chunk in (1, 7, 16, 64):
    engine = make(chunk)
    prefix = engine.prefill(engine.init_decode_state(), prompt)
    firsts.append((prefix.first_token, prefix.margin))
  engine = make(16)
  state = engine.init_decode_state()
  state = engine.insert(engine.prefill(state, prompt[:1]), state, 0)
  for tok in prompt[1:]:
    state.tokens[0] = tok
    state, nxt, margin = engine.generate(state)
  firsts.append((int(nxt[0]), float(margin[0])))
  assert len({t for t, _ in firsts}) == 1, firsts
  margins = [m for _, m in firsts]
  assert max(margins) - min(margins) < 0.02, firsts


# --- speculative (MTP-style) steps: ragged verification --------------------------
def _run_speculative(drafter, backend="cpu", seed=3, n=10, draft_tokens=3):
  params = serving.init_params(SMALL, seed)
  engine = serving.Engine(SMALL, params, num_pages=4 * 8 + 4, page_size=16, max_slots=4, max_pages_per_seq=8,
                          prefill_chunk=32, backend=backend, draft_tokens=draft_tokens)
  reqs = _requests(n, seed)
  engine.serve(reqs, drafter=drafter)
  return engine, reqs


def test_speculative_steps_generate_the_plain_tokens(cpu_run):
  """Drafts from the plain run's own continuation, wrong from a random point
  on in half the steps: every request accepts a different number of tokens
  per step (a ragged query), and greedy verification must give the plain
  run's tokens (up to near ties)."""
  plain = cpu_run[1]
  rng = np.random.default_rng(0)

  def drafter(tokens, k):
    req = next(r for r in plain if tokens[:len(r.prompt)] == r.prompt)
    done = len(tokens) - len(req.prompt)
    draft = list(req.output[done:done + k])
    if draft and rng.random() < 0.5:
      j = int(rng.integers(len(draft)))
      draft[j] = (draft[j] + 1) % SMALL.vocab_size
    return draft[:int(rng.integers(0, k + 1))]        # a random number of drafts, 0 included

  engine, reqs = _run_speculative(drafter)
  _assert_same_streams(plain, reqs)
  t = engine.timings
  assert 0 < t["accepted"] < t["drafted"]
  assert any(len(set(lens)) > 1 for lens in t["query_lens"])   # ragged within one step
  assert t["steps"] < cpu_run[0].timings["steps"]               # accepted drafts saved steps
  assert engine.allocator.free == engine.allocator.num_pages


def test_ngram_drafter_run_matches_the_plain_run(cpu_run):
  engine, reqs = _run_speculative(None)
  _assert_same_streams(cpu_run[1], reqs)
  assert engine.timings["drafted"] > 0
  assert engine.allocator.free == engine.allocator.num_pages


def test_serve_trims_a_drafter_that_proposes_too_many(cpu_run):
  engine, reqs = _run_speculative(lambda tokens, k: [tokens[-1]] * 3)   # always 3, whatever k allows
  _assert_same_streams(cpu_run[1], reqs)
  assert engine.allocator.free == engine.allocator.num_pages


def test_ngram_drafter():
  assert serving.ngram_drafter([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]     # the suffix 1 2 3 recurs
  assert serving.ngram_drafter([5, 6, 7, 5, 6], 4) == [7, 5, 6]        # as many as follow
  assert serving.ngram_drafter([1, 2, 3], 3) == []                     # nothing recurs
  assert serving.ngram_drafter([4, 4], 0) == []


def test_verify_checks_its_arguments():
  params = serving.init_params(SMALL, 0)
  plain = serving.Engine(SMALL, params, num_pages=8, page_size=16, max_slots=2, max_pages_per_seq=4,
                         backend="cpu")
  with pytest.raises(RuntimeError, match="draft_tokens=0"):
    plain.verify(plain.init_decode_state(), [[], []])
  with pytest.raises(ValueError, match="draft_tokens: expected 0"):
    serving.Engine(SMALL, params, num_pages=8, backend="cpu", draft_tokens=8)
  spec = serving.Engine(SMALL, params, num_pages=8, page_size=16, max_slots=2, max_pages_per_seq=4,
                        backend="cpu", draft_tokens=2)
  state = spec.init_decode_state()
  state = spec.insert(spec.prefill(state, [1, 2, 3]), state, 0)
  with pytest.raises(ValueError, match=r"drafts\[0\]: 3 tokens"):
    spec.verify(state, [[1, 2, 3], []])
