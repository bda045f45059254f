"""A DeepSeek-style MLA attention layer decoding over a paged latent cache.

Weights absorbed as in DeepSeek-V2/V3 inference: the per-head key
up-projection W_UK is folded into the query (q_nope @ W_UK gives a 512-wide
latent query), and the value up-projection W_UV is applied to the 512-wide
latent output, so attention itself only ever touches the shared latent cache
(512 "ckv" + 64 "kpe" values per token) through ``mla_jax.paged_decode``.

Runs on CPU in a few seconds:  python examples/deepseek_mla_layer.py
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

import mla_jax

D_MODEL, HEADS, Q_LORA = 512, 8, 256
KV_LORA, NOPE, ROPE, V_DIM = 512, 128, 64, 128  # DeepSeek-V3 per-head dims
PAGE = 16
DTYPE = jnp.bfloat16
PLAN = mla_jax.DecodePlan(num_heads=HEADS, page_size=PAGE, sm_scale=1 / math.sqrt(NOPE + ROPE))


def init_params(key):
  shapes = dict(w_dq=(D_MODEL, Q_LORA), w_uq=(Q_LORA, HEADS, NOPE + ROPE),
                w_dkv=(D_MODEL, KV_LORA + ROPE), w_uk=(HEADS, NOPE, KV_LORA),
                w_uv=(HEADS, KV_LORA, V_DIM), w_o=(HEADS * V_DIM, D_MODEL))
  keys = jax.random.split(key, len(shapes))
  return {name: jax.random.normal(k, s, jnp.float32) / math.sqrt(s[0] if name != "w_uk" else s[1])
          for k, (name, s) in zip(keys, shapes.items())}


def rms_norm(x):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)


def rope(x, pos):
  """Rotary embedding (rotate-half form) of x [..., T, (H,) 64] at positions pos [T]."""
  half = x.shape[-1] // 2
  angle = pos.astype(jnp.float32)[:, None] / (10000.0 ** (jnp.arange(half) / half))
  angle = angle.reshape(angle.shape[:1] + (1,) * (x.ndim - 2) + (half,))
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * jnp.cos(angle) - x2 * jnp.sin(angle),
                          x1 * jnp.sin(angle) + x2 * jnp.cos(angle)], -1)


def latent(params, x, pos):
  """Cache entry of tokens x [T, D] at pos [T]: [T, 576] = (ckv 512 | kpe 64)."""
  kv = x @ params["w_dkv"]
  return jnp.concatenate([rms_norm(kv[:, :KV_LORA]), rope(kv[:, KV_LORA:], pos)], -1)


def queries(params, x, pos):
  """q_nope [B, H, 128] and roped q_pe [B, H, 64] of the new tokens."""
  q = jnp.einsum("bl,lhd->bhd", rms_norm(x @ params["w_dq"]), params["w_uq"])
  return q[..., :NOPE], rope(q[..., NOPE:], pos)


@jax.jit
def prefill(params, cache, block_table, seq_lens, prompt):
  """Writes the latents of prompt tokens [B, T_max, D] (the first seq_lens[b] of row b)."""
  b, t = prompt.shape[:2]
  pos = jnp.arange(t)
  lat = jax.vmap(lambda x: latent(params, x, pos))(prompt).astype(cache.dtype)  # [B, T, 576]
  page = jnp.take_along_axis(block_table, jnp.broadcast_to(pos // PAGE, (b, t)), 1)
  page = jnp.where(pos[None] < seq_lens[:, None], page, cache.shape[0])  # pads: dropped
  return cache.at[page, pos % PAGE].set(lat, mode="drop")


@jax.jit
def decode_step(params, cache, block_table, seq_lens, x):
  """One token per request: append its latent, attend, project. x: [B, D]."""
  b = x.shape[0]
  pos = seq_lens                                         # 0-based position of the new token
  page = block_table[jnp.arange(b), pos // PAGE]
  cache = cache.at[page, pos % PAGE].set(latent(params, x, pos).astype(cache.dtype))
  seq_lens = seq_lens + 1                                # paged_decode counts the new token
  q_nope, q_pe = queries(params, x, pos)
  q_latent = jnp.einsum("bhn,hnc->bhc", q_nope, params["w_uk"])        # absorb W_UK
  o_latent = mla_jax.paged_decode((q_latent.astype(DTYPE), q_pe.astype(DTYPE)), cache,
                                  block_table, seq_lens, plan=PLAN)    # [B, H, 512]
  o = jnp.einsum("bhc,hcv->bhv", o_latent.astype(jnp.float32), params["w_uv"])  # absorb W_UV
  return x + o.reshape(b, -1) @ params["w_o"], cache, seq_lens


def naive_attention(params, cache, block_table, seq_lens, x, pos):
  """The same layer without absorption, in float64 NumPy: per-head K and V materialised."""
  q_nope, q_pe = (np.asarray(a, np.float64) for a in jax.jit(queries)(params, x, pos))
  w = {k: np.asarray(v, np.float64) for k, v in params.items()}
  cache, block_table = np.asarray(cache.astype(jnp.float32), np.float64), np.asarray(block_table)
  outs = []
  for i, n in enumerate(np.asarray(seq_lens)):
    p = np.arange(n)
    lat = cache[block_table[i, p // PAGE], p % PAGE]                     # [n, 576]
    k_nope = np.einsum("tc,hnc->htn", lat[:, :KV_LORA], w["w_uk"])
    v = np.einsum("tc,hcv->htv", lat[:, :KV_LORA], w["w_uv"])
    s = (np.einsum("hn,htn->ht", q_nope[i], k_nope) + q_pe[i] @ lat[:, KV_LORA:].T) * PLAN.sm_scale
    prob = np.exp(s - s.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    outs.append(np.einsum("ht,htv->hv", prob, v).reshape(-1))
  return np.asarray(x, np.float64) + np.stack(outs) @ w["w_o"]


def main(new_tokens=4):
  key_p, key_x, key_t = jax.random.split(jax.random.key(0), 3)
  params = init_params(key_p)
  prompt_lens = np.array([1, 17, 64, 150, 33], np.int32)        # requests already prefilled
  b = len(prompt_lens)
  pages_per_req = -(-(prompt_lens.max() + new_tokens) // PAGE)
  num_pages = b * pages_per_req + 2
  # A scattered page assignment, as a paged allocator would hand out.
  block_table = jnp.asarray(np.random.default_rng(0).permutation(num_pages)[:b * pages_per_req]
                            .reshape(b, pages_per_req).astype(np.int32))
  cache = jnp.zeros((num_pages, PAGE, KV_LORA + ROPE), DTYPE)
  seq_lens = jnp.asarray(prompt_lens)
  prompt = jax.random.normal(key_t, (b, int(prompt_lens.max()), D_MODEL))
  cache = prefill(params, cache, block_table, seq_lens, prompt)

  x = jax.random.normal(key_x, (b, D_MODEL))
  for step in range(new_tokens):
    x_in, pos = x, seq_lens
    x, cache, seq_lens = decode_step(params, cache, block_table, seq_lens, x)
    want = naive_attention(params, cache, block_table, seq_lens, x_in, pos)
    err = float(np.linalg.norm(np.asarray(x, np.float64) - want) / np.linalg.norm(want))
    print(f"step {step}: seq_lens {np.asarray(seq_lens).tolist()}  "
          f"rel. diff vs non-absorbed float64 layer {err:.1e}")
    assert err < 2e-2, err
    x = rms_norm(x)  # stand-in for the rest of the transformer block
  print(f"decoded {new_tokens} tokens for {b} requests with backend "
        f"'{PLAN.backend}' on {jax.devices()[0].platform}")


if __name__ == "__main__":
  main()
