// fz's host AdamW step with the bf16 parameters written in the same pass (fz/optim/kernel.py builds
// it with the running torch's headers and checks it against torch before any use).
//
// Why: with the optimizer offloaded, the update reads the fp32 masters, gradients and moments and
// writes masters and moments (28 bytes an element); casting the masters into the bf16 parameters
// afterwards reads the masters again from memory (6 bytes more, a third pass). Here each vector's
// bf16 value is written as it is made (2 bytes, streamed past the cache), and the four input
// streams are prefetched, which one core's memory bandwidth needs.
//
// The arithmetic is torch's fused CPU AdamW (torch._fused_adamw_ on float tensors: AdamW mode, no
// amsgrad, maximize or grad scale) operation for operation, in the same at::vec operations: the
// same roundings, so the same bits. `grad_mul` (the clip's factor, a float) multiplies each gradient
// as it is read: the one fp32 rounding of `grad.mul_(factor)` before the step, without its pass. The element ranges are torch's too: at::parallel_for over
// 64-byte units, and only whole vectors here; the caller hands the last numel % vec_size elements
// of a tensor (which torch computes in scalar code) to torch itself.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kUnit = 64 / sizeof(float);   // torch's task unit: one cache line of floats
constexpr int64_t kAhead = 256;                  // prefetch distance in floats (1 KiB per stream)

inline void store_bf16(uint16_t* out, const Vec& x, bool stream) {
#if defined(CPU_CAPABILITY_AVX512)
  __m256i h = at::vec::cvtfp32_bf16(__m512(x));
  if (stream) _mm256_stream_si256(reinterpret_cast<__m256i*>(out), h);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), h);
#elif defined(CPU_CAPABILITY_AVX2)
  __m128i h = at::vec::cvtfp32_bf16(__m256(x));
  if (stream) _mm_stream_si128(reinterpret_cast<__m128i*>(out), h);
  else _mm_storeu_si128(reinterpret_cast<__m128i*>(out), h);
#else
#error "fz's host AdamW kernel is built for AVX2 or AVX512 only"
#endif
}

}  // namespace

extern "C" int fz_vec_size() { return Vec::size(); }

// One tensor: `n` (a multiple of fz_vec_size()) elements updated in place, `out` = bf16(param).
// `step` is the step count as torch reads it (a float, widened).
extern "C" void fz_adamw_bf16(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                              uint16_t* out, int64_t n, double lr, double beta1, double beta2,
                              double weight_decay, double eps, double step, double grad_mul) {
  // the scalars as torch derives them: in double, then each rounded once to float
  const double bias_correction1 = 1 - std::pow(beta1, step);
  const double bias_correction2_sqrt = std::sqrt(1 - std::pow(beta2, step));
  const double step_size = lr / bias_correction1;
  const bool decay = weight_decay != 0.f;
  const Vec keep = Vec(float(1 - lr * weight_decay));
  const Vec weight = Vec(float(1 - beta1));  // exp_avg.lerp_(grad, weight)
  const auto small = weight.abs() < Vec(0.5);
  const Vec lerp_coeff = Vec::blendv(weight - Vec(1), weight, small);
  const Vec b2 = Vec(float(beta2));
  const Vec one_minus_b2 = Vec(float(1 - beta2));
  const Vec bc2_sqrt = Vec(float(bias_correction2_sqrt));
  const Vec eps_v = Vec(float(eps));
  const Vec neg_step = Vec(float(-step_size));
  const bool scaled = grad_mul != 1.0;
  const Vec gmul = Vec(float(grad_mul));
  const bool stream = reinterpret_cast<uintptr_t>(out) % (Vec::size() * sizeof(uint16_t)) == 0;
  at::parallel_for(0, (n + kUnit - 1) / kUnit, 0, [=](int64_t begin, int64_t end) {
    begin *= kUnit;
    end = std::min(end * kUnit, n);
    float* __restrict__ p = param + begin;
    const float* __restrict__ g = grad + begin;
    float* __restrict__ m = exp_avg + begin;
    float* __restrict__ v = exp_avg_sq + begin;
    uint16_t* __restrict__ o = out + begin;
    const int64_t size = end - begin;
    for (int64_t d = 0; d < size; d += Vec::size()) {
      if (d % kUnit == 0 && d + kAhead < size) {
        _mm_prefetch(reinterpret_cast<const char*>(p + d + kAhead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(g + d + kAhead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(m + d + kAhead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(v + d + kAhead), _MM_HINT_T0);
      }
      Vec pv = Vec::loadu(p + d);
      Vec gv = Vec::loadu(g + d);
      if (scaled) gv = gv * gmul;
      if (decay) pv = pv * keep;
      Vec mv = Vec::loadu(m + d);
      mv = at::vec::fmadd(lerp_coeff, gv - mv, Vec::blendv(gv, mv, small));
      const Vec vv = Vec::loadu(v + d) * b2 + one_minus_b2 * gv * gv;
      mv.store(m + d);
      vv.store(v + d);
      const Vec denom = (vv.sqrt() / bc2_sqrt) + eps_v;
      pv = pv + neg_step * mv / denom;
      pv.store(p + d);
      store_bf16(o + d, pv, stream);
    }
    _mm_sfence();  // the streamed stores are visible before the caller reads `out`
  });
}
