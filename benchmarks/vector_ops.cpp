// What one AVX2 instruction of the packed kernels costs on this CPU: nanoseconds per
// instruction in a stream of 8 independent chains (throughput, not latency), and as a
// multiple of a 256-bit FMA's (a VM's clock varies from run to run; the ratios do not).
// The int4 kernel on int16 activations (mstar/cpu/csrc/i16_gemv.h) issues, per 64 weights,
// 4 vpmaddwd, 3 shifts, 3 ands, 3 adds, a conversion, a multiply and an FMA: where the
// 256-bit ones take two FMAs' time (Zen 1), those bound a core's speed, not the memory.
//
//     g++ -O2 -mavx2 -mfma benchmarks/vector_ops.cpp -o /tmp/vector_ops && /tmp/vector_ops
#include <immintrin.h>

#include <chrono>
#include <cstdio>

namespace {

constexpr long ROUNDS = 50'000'000;

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// ns per op(a, b) over 8 independent chains, kept in registers by the empty asm
template <typename T, typename F>
double per_op(F op, T b, T init) {
  T a0 = init, a1 = init, a2 = init, a3 = init, a4 = init, a5 = init, a6 = init, a7 = init;
  const auto start = std::chrono::steady_clock::now();
  for (long n = 0; n < ROUNDS; ++n) {
    a0 = op(a0, b), a1 = op(a1, b), a2 = op(a2, b), a3 = op(a3, b);
    a4 = op(a4, b), a5 = op(a5, b), a6 = op(a6, b), a7 = op(a7, b);
    asm volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7));
  }
  return seconds_since(start) / ROUNDS / 8 * 1e9;
}

}  // namespace

int main() {
  const __m256i i16 = _mm256_set1_epi16(3), i8 = _mm256_set1_epi8(3);
  const __m256 f = _mm256_set1_ps(0.5f);
  const double fma = per_op([](__m256 a, __m256 b) { return _mm256_fmadd_ps(a, b, b); }, f, f);
  const struct {
    const char* name;
    double ns;
  } ops[] = {
      {"vpmaddwd ymm", per_op([](__m256i a, __m256i b) { return _mm256_madd_epi16(a, b); }, i16, i16)},
      {"vpmaddwd xmm", per_op([](__m128i a, __m128i b) { return _mm_madd_epi16(a, b); },
                              _mm_set1_epi16(3), _mm_set1_epi16(1))},
      {"vpmaddubsw ymm", per_op([](__m256i a, __m256i b) { return _mm256_maddubs_epi16(b, a); }, i8, i8)},
      {"vfmadd ymm", fma},
      {"vpand ymm", per_op([](__m256i a, __m256i b) { return _mm256_and_si256(a, b); }, i16, i16)},
      {"vpaddd ymm", per_op([](__m256i a, __m256i b) { return _mm256_add_epi32(a, b); }, i16, i16)},
      {"vpsrlw ymm (+ vpaddw)",
       per_op([](__m256i a, __m256i b) { return _mm256_srli_epi16(_mm256_add_epi16(a, b), 1); }, i16, i16)},
      {"vphaddd ymm", per_op([](__m256i a, __m256i b) { return _mm256_hadd_epi32(a, b); }, i16, i16)},
      {"vcvtdq2ps ymm",
       per_op([](__m256 a, __m256) { return _mm256_cvtepi32_ps(_mm256_castps_si256(a)); }, f, f)},
  };
  for (const auto& op : ops) std::printf("%-24s %.3f ns  %.2fx vfmadd ymm\n", op.name, op.ns, op.ns / fma);
}
