// Host side of the phase probe (csrc/smxx/phase_probe.cuh): the dump
// functions of every translation unit built with MLA_JAX_PHASE_PROBE, so
// that a host-only program (benchmarks/native/decode_timing.cc) can print
// what the probed kernels recorded without including device code.
#pragma once

#include <vector>

namespace mla_jax {
namespace phase {

// One translation unit's records: how many launches of its probed kernels
// have completed, and a printer of launches [first, count) (at most the
// last `at_most` of them), which names the unit.
struct Unit {
  unsigned (*launches)();
  void (*dump)(unsigned first, int at_most);
};

inline std::vector<Unit>& registry() {
  static std::vector<Unit> units;
  return units;
}

inline bool register_unit(const Unit& unit) {
  registry().push_back(unit);
  return true;
}

// Every unit's launch count now: pass it to dump_since after the launches
// of interest, so that a unit they did not run prints nothing.
inline std::vector<unsigned> snapshot() {
  std::vector<unsigned> counts;
  for (const Unit& u : registry()) counts.push_back(u.launches());
  return counts;
}

inline void dump_since(const std::vector<unsigned>& before, int at_most) {
  for (size_t i = 0; i < registry().size() && i < before.size(); ++i) registry()[i].dump(before[i], at_most);
}

}  // namespace phase
}  // namespace mla_jax
