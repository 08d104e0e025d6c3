#pragma once
// What the CPU the process runs on can do, for kernels built for more than one instruction set.

namespace fsdp {

// Whether the CPU has AVX2 (false where the compiler cannot target x86-64 AVX2 per function).
inline bool cpu_has_avx2() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
#else
  return false;
#endif
}

}  // namespace fsdp
