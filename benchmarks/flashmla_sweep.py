"""FlashMLA's dense bf16 decode over arbitrary shapes, timed as flashmla_peer.py times it.

Beside the native timer (benchmarks/native/decode_timing.cc, ``--rows``), which times mla_jax's
kernels the same way, this gives the peer's figure for shapes outside bench_paged_decode.py's
ROWS (e.g. a sweep over lengths, to separate a fixed cost per call from a cost per tile):

  python3 benchmarks/flashmla_sweep.py --rows "128,1,128,1024;1,1,128,4096" --out fm.json

Needs torch and flash_mla importable (benchmarks/README.md). Data: random normal bf16 query and
cache, page 64, pages a random permutation, cache copies over 120 MB (the calls rotate through
them), sm_scale 1/sqrt(192), causal for q_len > 1; FlashMLA's metadata from a warm-up call,
reused by every captured call (flashmla_peer.Peer).
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

import flashmla_peer


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--rows", required=True, help='"B,Q,H,SEQ;..." (every request SEQ tokens)')
  ap.add_argument("--reps", type=int, default=9)
  ap.add_argument("--out", help="JSON output path")
  args = ap.parse_args()
  peer, why = flashmla_peer.load()
  if peer is None:
    raise SystemExit(f"FlashMLA cannot run here: {why}")
  torch, fm = peer.torch, peer.fm
  gen = torch.Generator(device="cuda").manual_seed(0)
  results = []
  for spec in filter(None, (r.strip() for r in args.rows.split(";"))):
    b, q, h, seq = (int(x) for x in spec.split(","))
    pages = b * ((seq + 63) // 64)
    copies = max(1, math.ceil(120e6 / (pages * 64 * 576 * 2)))
    caches = [torch.randn(pages, 64, 1, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
              for _ in range(copies)]
    # Calls per graph from a rough work estimate: at least 8, at most 400.
    n_hi = max(8, min(400, int(10000 / max(1.0, seq * b * h / 2.5e6))))
    n_lo = n_hi // 2
    qs = [torch.randn(b, q, h, 576, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(n_hi)]
    table = torch.from_numpy(np.random.default_rng(0).permutation(pages).astype(np.int32).reshape(b, -1)).cuda()
    lens = torch.full((b,), seq, dtype=torch.int32, device="cuda")
    meta, _ = fm.get_mla_metadata()

    def call(i):
      return fm.flash_mla_with_kvcache(qs[i], caches[i % copies], table, lens, 512, meta, None,
                                       softmax_scale=192 ** -0.5, causal=q > 1)

    r = peer._time_calls(call, n_hi, n_lo, n_hi, args.reps, 10)
    r.pop("result")
    print(f"b{b}q{q}h{h}s{seq}: {r['us']:.1f} us (n {n_lo}/{n_hi}, {copies} cache copies)", flush=True)
    results.append(dict(b=b, q_len=q, h=h, seq=seq, us=r["us"], samples_us=r["samples_us"],
                        us_dobench=r["us_dobench"], n_lo=n_lo, n_hi=n_hi, copies=copies, method=r["method"]))
    del caches, qs
    torch.cuda.empty_cache()
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(flashmla_version=peer.version, rows=results), f, indent=1)


if __name__ == "__main__":
  main()
