// Host side of the phase probe (csrc/smxx/phase_probe.cuh): the dump
// functions of every translation unit built with MLA_JAX_PHASE_PROBE, so
// that a host-only program (benchmarks/native/decode_timing.cc) can print
// what the probed kernels recorded without including device code.
#pragma once

#include <utility>
#include <vector>

namespace mla_jax {
namespace phase {

// Prints the last `launches` completed launches of each probed kernel of
// one translation unit.
using DumpFn = void (*)(int launches);

inline std::vector<std::pair<const char*, DumpFn>>& registry() {
  static std::vector<std::pair<const char*, DumpFn>> fns;
  return fns;
}

inline bool register_dump(const char* unit, DumpFn fn) {
  registry().emplace_back(unit, fn);
  return true;
}

inline void dump_all(int launches) {
  for (const auto& [unit, fn] : registry()) fn(launches);
}

}  // namespace phase
}  // namespace mla_jax
