// Host-side switches read from the environment on every call (A/B
// benchmarks and tests of every kernel path; see README "Which CUDA kernel
// runs").
#pragma once

#include <cstdlib>
#include <cstring>

namespace mla_jax {

// True when the variable is set to exactly `value`.
inline bool env_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, value) == 0;
}

// True when the variable is set to something other than "" or "0...".
inline bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

}  // namespace mla_jax
