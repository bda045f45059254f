// CUDA_OK(expr): the native tools' check of a CUDA runtime call. On an
// error it prints the call's place and the error, then exits with status 2
// (the tools' "CUDA error" status).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CUDA_OK(expr)                                                                               \
  do {                                                                                              \
    cudaError_t e_ = (expr);                                                                        \
    if (e_ != cudaSuccess) {                                                                        \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, __LINE__, \
                   cudaGetErrorString(e_));                                                         \
      std::exit(2);                                                                                 \
    }                                                                                               \
  } while (0)
