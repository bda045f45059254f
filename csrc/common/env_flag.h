// Host-side switches read from the environment on every call (A/B
// benchmarks and tests of every kernel path; see README "Which CUDA kernel
// runs").
#pragma once

#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>

namespace mla_jax {

// True when the variable is set to something other than "" or "0...".
inline bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

// env_flag's answer when the variable is set and not empty, else `unset`.
inline bool env_flag_or(const char* name, bool unset) {
  const char* v = std::getenv(name);
  return v == nullptr || v[0] == '\0' ? unset : v[0] != '0';
}

// Empty when the variable is unset, empty, or one of `choices`; otherwise a
// message naming it, its value and the accepted values. A switch with a
// fixed set of values is checked by the FFI handlers, so a typo in an A/B
// run is an error instead of a silent run of the default path.
inline std::string env_choice_error(const char* name, std::initializer_list<const char*> choices) {
  const char* v = std::getenv(name);
  if (v == nullptr || v[0] == '\0') return {};
  std::string accepted;
  for (const char* c : choices) {
    if (std::strcmp(v, c) == 0) return {};
    accepted += accepted.empty() ? c : std::string(", ") + c;
  }
  return std::string("mla_jax: environment variable ") + name + "='" + v + "' is not one of: " + accepted;
}

}  // namespace mla_jax
