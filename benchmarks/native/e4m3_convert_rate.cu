// Rate of e4m3 -> fp16 conversion on one GPU: values per clock per SM with
// cvt.rn.f16x2.e4m3x2 (what the swap-AB kernel's V^T operand uses), with a
// bit-manipulation equivalent (the value times 2^-8, seven integer
// instructions per four values), and with half of each. Eight independent
// chains per thread, one CTA per SM; the clock is the device's reported
// maximum, so the figures are per clock only if the GPU runs at it.
//
//   nvcc -arch=sm_90a -O3 -o e4m3_convert_rate benchmarks/native/e4m3_convert_rate.cu && ./e4m3_convert_rate
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
__device__ __forceinline__ void cvt4(uint32_t w, uint32_t& lo, uint32_t& hi) {
  asm volatile("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}"
      : "=r"(lo), "=r"(hi) : "r"(w));
}
__device__ __forceinline__ void bits4(uint32_t w, uint32_t& lo, uint32_t& hi) {
  // value * 2^-8: odd bytes (1,3) and even bytes (0,2)
  uint32_t u = (w >> 1) & 0x3F803F80u;
  hi = (w & 0x80008000u) | u;
  uint32_t v = (w << 7) & 0x3F803F80u;
  lo = ((w << 8) & 0x80008000u) | v;
}
template <int kMode>
__global__ void k(uint32_t* out, int iters, uint32_t seed) {
  uint32_t w[8];
  for (int i = 0; i < 8; ++i) w[i] = seed * (threadIdx.x + 1 + i * 77);
  uint32_t acc = 0;
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      uint32_t lo, hi;
      if (kMode == 0 || (kMode == 2 && (i & 1))) cvt4(w[i], lo, hi); else bits4(w[i], lo, hi);
      w[i] = lo ^ hi;
    }
  }
  for (int i = 0; i < 8; ++i) acc += w[i];
  if (acc == 0x12345678u) out[0] = acc;
}
int main() {
  uint32_t* out; cudaMalloc(&out, 4);
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  int clk; cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  const char* names[3] = {"cvt.rn.f16x2.e4m3x2", "bit ops (7 ALU per 4 values)", "half cvt half bits"};
  for (int threads : {256, 512, 1024}) for (int mode = 0; mode < 3; ++mode) {
    const int iters = 4096;
    auto run = [&]() {
      if (mode == 0) k<0><<<sms, threads>>>(out, iters, 3);
      if (mode == 1) k<1><<<sms, threads>>>(out, iters, 3);
      if (mode == 2) k<2><<<sms, threads>>>(out, iters, 3);
    };
    run(); cudaDeviceSynchronize();
    cudaEventRecord(a); for (int r = 0; r < 5; ++r) run(); cudaEventRecord(b); cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b); ms /= 5;
    double vals = double(sms) * threads * iters * 8 * 4;
    double per_clk_sm = vals / (ms * 1e-3) / sms / (clk * 1e3);  // at the reported max clock
    printf("%-30s threads %4d: %.3f ms, %.1f values/clk/SM (at %d MHz), %.1f Gvalues/s/SM\n", names[mode], threads, ms,
           per_clk_sm, clk / 1000, vals / (ms * 1e-3) / sms / 1e9);
  }
  return 0;
}
