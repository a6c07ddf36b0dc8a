// CPU kernels for the decode path, where eager PyTorch spends most of its time moving memory.
//
// - gemv_bf16: y = x @ W^T for a few rows of x (decode batches). oneDNN's bfloat16 GEMM reaches
//   about half of this machine's memory bandwidth at M = 1; a plain row-parallel dot-product loop
//   streams W once at close to the full bandwidth.
// - paged_decode_attention: attention for one new token per sequence, reading K/V straight from
//   the paged pool through the block table (bfloat16 or int8 with per-block scales), so no gathered
//   copy of the context is made per layer.
//
// - rms_norm / add_rms_norm / silu_and_mul / rotary_qk: the elementwise parts of a layer, one
//   call each instead of 5-8 small ATen ops (each ~2 us of dispatch at decode sizes), with the
//   same bfloat16 rounding points as the eager code in backend/model/llama.py.
//
// Three builds of this file, chosen by backend/platform/cpu_features.py and compiled by backend/model/cpu_kernels.py:
// - avx512_bf16 (-march=native on CPUs with AVX-512 BF16): vdpbf16ps GEMV, AVX-512 attention;
// - avx2 (-march=haswell: AVX2 + FMA + F16C): bf16 weights and KV widened to fp32 by a 16-bit shift,
//   fp32 FMA compute, a vectorised exp for softmax and SiLU;
// - portable (-march=x86-64): plain C++ loops (fixed-width accumulator arrays GCC vectorises).
// Threads come from ATen's pool (at::parallel_for), so torch.set_num_threads governs them and no
// second OpenMP runtime is used.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define CTXGATE_HAVE_AVX512_BF16 1
#endif
// The AVX2 helpers also serve the AVX-512 build where it has no wider path (int8 KV, odd head dims).
#if defined(__AVX2__) && defined(__FMA__)
#define CTXGATE_HAVE_AVX2 1
#endif
#if defined(CTXGATE_HAVE_AVX512_BF16) || defined(CTXGATE_HAVE_AVX2)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 16;

inline float bf16_to_float(uint16_t bits) {
  uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

// Cache element -> float: bfloat16 bits or int8 (scaled by the caller).
inline float element_to_float(uint16_t bits) { return bf16_to_float(bits); }
inline float element_to_float(int8_t value) { return static_cast<float>(value); }

#ifdef CTXGATE_HAVE_AVX2
// 8 bfloat16 -> 8 floats: widen to 32 bits and shift into the high half.
inline __m256 load8(const uint16_t* source) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(source))), 16));
}
inline __m256 load8(const int8_t* source) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(source))));
}
inline __m256 load8(const float* source) { return _mm256_loadu_ps(source); }

inline float hsum256(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}

inline float hmax256(__m256 v) {
  __m128 peak = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  peak = _mm_max_ps(peak, _mm_movehl_ps(peak, peak));
  peak = _mm_max_ss(peak, _mm_movehdup_ps(peak));
  return _mm_cvtss_f32(peak);
}

// exp for 8 floats, the same range reduction and Cephes polynomial as the AVX-512 exp below;
// 2^n is built in the exponent bits (AVX2 has no scalef).
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447504f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 poly = _mm256_set1_ps(1.9875691500e-4f);
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.3981999507e-3f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(8.3334519073e-3f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(4.1665795894e-2f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.6666665459e-1f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(5.0000001201e-1f));
  poly = _mm256_fmadd_ps(poly, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(poly, _mm256_castsi256_ps(exponent));
}

// float -> bfloat16 bits with round-to-nearest-even, as at::BFloat16 rounds (inputs here are finite).
inline __m128i to_bf16x8(__m256 values) {
  const __m256i bits = _mm256_castps_si256(values);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  // Pack the low 16 bits of the eight 32-bit lanes (values fit in 16 bits, so no saturation).
  return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}

inline __m256 round_bf16x8(__m256 values) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16x8(values)), 16));
}

// Dot product of a cache row with a float vector, two accumulators to hide the FMA latency.
template <typename T>
inline float dot_f32(const T* row, const float* vec, int64_t length) {
  __m256 first = _mm256_setzero_ps(), second = _mm256_setzero_ps();
  int64_t index = 0;
  for (; index + 16 <= length; index += 16) {
    first = _mm256_fmadd_ps(load8(row + index), _mm256_loadu_ps(vec + index), first);
    second = _mm256_fmadd_ps(load8(row + index + 8), _mm256_loadu_ps(vec + index + 8), second);
  }
  for (; index + 8 <= length; index += 8) first = _mm256_fmadd_ps(load8(row + index), _mm256_loadu_ps(vec + index), first);
  float total = hsum256(_mm256_add_ps(first, second));
  for (; index < length; ++index) total += element_to_float(row[index]) * vec[index];
  return total;
}

template <typename T>
inline void axpy_f32(float* out, const T* row, float weight, int64_t length) {
  const __m256 scale = _mm256_set1_ps(weight);
  int64_t index = 0;
  for (; index + 8 <= length; index += 8) {
    _mm256_storeu_ps(out + index, _mm256_fmadd_ps(scale, load8(row + index), _mm256_loadu_ps(out + index)));
  }
  for (; index < length; ++index) out[index] += weight * element_to_float(row[index]);
}

// In-place softmax of `length` floats.
inline void softmax_f32(float* row, int64_t length) {
  __m256 peak_vec = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= length; i += 8) peak_vec = _mm256_max_ps(peak_vec, _mm256_loadu_ps(row + i));
  float peak = hmax256(peak_vec);
  for (; i < length; ++i) peak = std::max(peak, row[i]);
  const __m256 peak_b = _mm256_set1_ps(peak);
  __m256 total_vec = _mm256_setzero_ps();
  for (i = 0; i + 8 <= length; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(row + i), peak_b));
    _mm256_storeu_ps(row + i, e);
    total_vec = _mm256_add_ps(total_vec, e);
  }
  float total = hsum256(total_vec);
  for (; i < length; ++i) {
    row[i] = std::exp(row[i] - peak);
    total += row[i];
  }
  const float inverse = 1.0f / total;
  const __m256 inverse_b = _mm256_set1_ps(inverse);
  for (i = 0; i + 8 <= length; i += 8) _mm256_storeu_ps(row + i, _mm256_mul_ps(_mm256_loadu_ps(row + i), inverse_b));
  for (; i < length; ++i) row[i] *= inverse;
}

constexpr int64_t kAvx2InputTile = 4;  // input rows sharing each widened weight chunk

// out[first_input + r, output] = inputs[first_input + r] . weight[output] (fp32 inputs, bf16 weight):
// each weight chunk is widened once and used by every input row of the tile. CHUNKS 8-wide
// accumulators per row keep INPUTS * CHUNKS FMA chains in flight: with one row and two chains the
// loop waited on FMA latency and streamed the weights at about half the bandwidth.
template <int INPUTS, int CHUNKS>
inline void gemv_tile_avx2(const uint16_t* weight_row, int64_t output, const float* inputs, int64_t first_input,
                           int64_t inner, int64_t outputs, at::BFloat16* out) {
  constexpr int64_t kStep = 8 * CHUNKS;
  __m256 acc[INPUTS][CHUNKS];
  for (int r = 0; r < INPUTS; ++r)
    for (int c = 0; c < CHUNKS; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t index = 0;
  for (; index + kStep <= inner; index += kStep) {
    __m256 weights[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) weights[c] = load8(weight_row + index + 8 * c);
    for (int r = 0; r < INPUTS; ++r) {
      const float* x = inputs + (first_input + r) * inner + index;
      for (int c = 0; c < CHUNKS; ++c) acc[r][c] = _mm256_fmadd_ps(weights[c], _mm256_loadu_ps(x + 8 * c), acc[r][c]);
    }
  }
  for (; index + 8 <= inner; index += 8) {
    const __m256 weights = load8(weight_row + index);
    for (int r = 0; r < INPUTS; ++r) {
      acc[r][0] = _mm256_fmadd_ps(weights, _mm256_loadu_ps(inputs + (first_input + r) * inner + index), acc[r][0]);
    }
  }
  for (int r = 0; r < INPUTS; ++r) {
    const float* x = inputs + (first_input + r) * inner;
    __m256 sum = acc[r][0];
    for (int c = 1; c < CHUNKS; ++c) sum = _mm256_add_ps(sum, acc[r][c]);
    float total = hsum256(sum);
    for (int64_t tail = index; tail < inner; ++tail) total += bf16_to_float(weight_row[tail]) * x[tail];
    out[(first_input + r) * outputs + output] = at::BFloat16(total);
  }
}

inline void gemv_row_avx2(const uint16_t* weight_row, int64_t output, const float* inputs, int64_t num_inputs,
                          int64_t inner, int64_t outputs, at::BFloat16* out) {
  int64_t first_input = 0;
  for (; first_input + kAvx2InputTile <= num_inputs; first_input += kAvx2InputTile)
    gemv_tile_avx2<kAvx2InputTile, 2>(weight_row, output, inputs, first_input, inner, outputs, out);
  switch (num_inputs - first_input) {
    case 3: gemv_tile_avx2<3, 2>(weight_row, output, inputs, first_input, inner, outputs, out); break;
    case 2: gemv_tile_avx2<2, 4>(weight_row, output, inputs, first_input, inner, outputs, out); break;
    case 1: gemv_tile_avx2<1, 4>(weight_row, output, inputs, first_input, inner, outputs, out); break;
    default: break;
  }
}
#else
// Dot product of a cache row with a float vector; lanes keep the loop vectorisable without
// -ffast-math (each lane accumulates independently).
template <typename T>
inline float dot_f32(const T* row, const float* vec, int64_t length) {
  float lanes[kLanes] = {0};
  int64_t index = 0;
  for (; index + kLanes <= length; index += kLanes) {
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      lanes[lane] += element_to_float(row[index + lane]) * vec[index + lane];
    }
  }
  float total = 0.0f;
  for (int64_t lane = 0; lane < kLanes; ++lane) total += lanes[lane];
  for (; index < length; ++index) total += element_to_float(row[index]) * vec[index];
  return total;
}

template <typename T>
inline void axpy_f32(float* out, const T* row, float weight, int64_t length) {
  for (int64_t index = 0; index < length; ++index) out[index] += weight * element_to_float(row[index]);
}

inline void softmax_f32(float* row, int64_t length) {
  const float peak = *std::max_element(row, row + length);
  float total = 0.0f;
  for (int64_t position = 0; position < length; ++position) {
    row[position] = std::exp(row[position] - peak);
    total += row[position];
  }
  const float inverse = 1.0f / total;
  for (int64_t position = 0; position < length; ++position) row[position] *= inverse;
}
#endif

#ifdef CTXGATE_HAVE_AVX512_BF16
constexpr int64_t kInputTile = 4;  // input rows sharing each weight load

inline __m512bh load_bf16x32(const uint16_t* source, bool tail, __mmask32 tail_mask) {
  return tail ? (__m512bh)_mm512_maskz_loadu_epi16(tail_mask, source) : (__m512bh)_mm512_loadu_si512(source);
}

// out[first_input + r, output] = inputs[first_input + r] . weight[output] for r < INPUTS.
// One weight row at a time: a single sequential stream per thread measured ~2x the bandwidth of
// interleaving 2-8 rows (the hardware prefetcher follows one stream best). Each 32-value weight
// chunk is loaded once and fed to one vdpbf16ps per input row (fp32 sums); the compile-time
// INPUTS keeps the accumulators in registers.
template <int INPUTS>
inline void gemv_tile(const uint16_t* weight_row, int64_t output, const uint16_t* inputs, int64_t first_input,
                      int64_t inner, int64_t outputs, at::BFloat16* out) {
  const int64_t full = inner / 32 * 32;
  const __mmask32 tail_mask = static_cast<__mmask32>((1ULL << (inner - full)) - 1);
  __m512 acc[INPUTS];
  for (int r = 0; r < INPUTS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t index = 0; index < inner; index += 32) {
    const bool tail = index >= full;
    const __m512bh weights = load_bf16x32(weight_row + index, tail, tail_mask);
    for (int r = 0; r < INPUTS; ++r) {
      const __m512bh values = load_bf16x32(inputs + (first_input + r) * inner + index, tail, tail_mask);
      acc[r] = _mm512_dpbf16_ps(acc[r], weights, values);
    }
  }
  for (int r = 0; r < INPUTS; ++r) out[(first_input + r) * outputs + output] = at::BFloat16(_mm512_reduce_add_ps(acc[r]));
}

inline void gemv_row(const uint16_t* weight_row, int64_t output, const uint16_t* inputs, int64_t num_inputs,
                     int64_t inner, int64_t outputs, at::BFloat16* out) {
  int64_t first_input = 0;
  for (; first_input + kInputTile <= num_inputs; first_input += kInputTile)
    gemv_tile<kInputTile>(weight_row, output, inputs, first_input, inner, outputs, out);
  switch (num_inputs - first_input) {
    case 3: gemv_tile<3>(weight_row, output, inputs, first_input, inner, outputs, out); break;
    case 2: gemv_tile<2>(weight_row, output, inputs, first_input, inner, outputs, out); break;
    case 1: gemv_tile<1>(weight_row, output, inputs, first_input, inner, outputs, out); break;
    default: break;
  }
}
#endif

#ifdef CTXGATE_HAVE_AVX512_BF16
// exp for 16 floats: range reduction to n*ln2 + r, Cephes' degree-6 polynomial, scale by 2^n.
// Relative error ~2e-7 on the softmax range, far below bfloat16 rounding.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-87.3365447504f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 poly = _mm512_set1_ps(1.9875691500e-4f);
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.3981999507e-3f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(8.3334519073e-3f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(4.1665795894e-2f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.6666665459e-1f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(5.0000001201e-1f));
  poly = _mm512_fmadd_ps(poly, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(poly, n);
}

inline __m512 load_bf16x16(const uint16_t* source) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)source)), 16));
}

inline __m512 load_bf16x16_masked(const uint16_t* source, __mmask16 mask) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, source)), 16));
}

// In-place softmax of `length` floats.
inline void softmax_avx512(float* row, int64_t length) {
  __m512 peak_vec = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 16 <= length; i += 16) peak_vec = _mm512_max_ps(peak_vec, _mm512_loadu_ps(row + i));
  float peak = _mm512_reduce_max_ps(peak_vec);
  for (; i < length; ++i) peak = std::max(peak, row[i]);
  const __m512 peak_b = _mm512_set1_ps(peak);
  __m512 total_vec = _mm512_setzero_ps();
  for (i = 0; i + 16 <= length; i += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(row + i), peak_b));
    _mm512_storeu_ps(row + i, e);
    total_vec = _mm512_add_ps(total_vec, e);
  }
  if (i < length) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (length - i)) - 1);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, row + i), peak_b));
    _mm512_mask_storeu_ps(row + i, mask, e);
    total_vec = _mm512_add_ps(total_vec, _mm512_maskz_mov_ps(mask, e));
  }
  const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total_vec));
  for (i = 0; i + 16 <= length; i += 16) _mm512_storeu_ps(row + i, _mm512_mul_ps(_mm512_loadu_ps(row + i), inverse));
  for (; i < length; ++i) row[i] *= _mm512_cvtss_f32(inverse);
}

// One (sequence, kv head) of paged decode attention over a bfloat16 cache, head_dim = 16 * CHUNKS.
// K and V rows are read in place through the block table; query heads of the group reuse them
// from L1/L2. Writes float32 outputs for the group's query heads.
template <int CHUNKS>
void decode_task_bf16(const uint16_t* q_group, int64_t group, const uint16_t* keys, const uint16_t* values,
                      const int64_t* table, int64_t length, int64_t block_size, float scale, float* scores,
                      float* out_group) {
  constexpr int64_t kHeadDim = CHUNKS * 16;
  for (int64_t g = 0; g < group; ++g) {
    const uint16_t* q_row = q_group + g * kHeadDim;
    __m512 q_vec[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) q_vec[c] = load_bf16x16(q_row + c * 16);
    float* score_row = scores + g * length;
    for (int64_t position = 0; position < length; ++position) {
      const uint16_t* k_row = keys + (table[position / block_size] * block_size + position % block_size) * kHeadDim;
      __m512 acc = _mm512_mul_ps(q_vec[0], load_bf16x16(k_row));
      for (int c = 1; c < CHUNKS; ++c) acc = _mm512_fmadd_ps(q_vec[c], load_bf16x16(k_row + c * 16), acc);
      score_row[position] = _mm512_reduce_add_ps(acc) * scale;
    }
    softmax_avx512(score_row, length);
    __m512 out_vec[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) out_vec[c] = _mm512_setzero_ps();
    for (int64_t position = 0; position < length; ++position) {
      const uint16_t* v_row = values + (table[position / block_size] * block_size + position % block_size) * kHeadDim;
      const __m512 weight = _mm512_set1_ps(score_row[position]);
      for (int c = 0; c < CHUNKS; ++c) out_vec[c] = _mm512_fmadd_ps(weight, load_bf16x16(v_row + c * 16), out_vec[c]);
    }
    for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(out_group + g * kHeadDim + c * 16, out_vec[c]);
  }
}
#endif

at::Tensor gemv_bf16(const at::Tensor& input, const at::Tensor& weight) {
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "gemv_bf16 takes bfloat16 input and weight");
  TORCH_CHECK(input.dim() == 2 && weight.dim() == 2 && input.size(1) == weight.size(1),
              "gemv_bf16: input [M, K] and weight [N, K]");
  const at::Tensor x = input.contiguous();
  const at::Tensor w = weight.contiguous();
  const int64_t rows = x.size(0);
  const int64_t inner = x.size(1);
  const int64_t outputs = w.size(0);
  at::Tensor out = at::empty({rows, outputs}, x.options());
  const uint16_t* w_data = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  at::BFloat16* out_data = out.data_ptr<at::BFloat16>();
  // Each weight row is read once from memory and reused for every input row from L1.
  const int64_t grain = 64;  // weight rows per task
#ifdef CTXGATE_HAVE_AVX512_BF16
  const uint16_t* x_bf16 = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  at::parallel_for(0, outputs, grain, [&](int64_t begin, int64_t end) {
    for (int64_t output = begin; output < end; ++output) {
      gemv_row(w_data + output * inner, output, x_bf16, rows, inner, outputs, out_data);
    }
  });
  return out;
#endif
  const at::Tensor x_float = x.to(at::kFloat);
  const float* x_data = x_float.data_ptr<float>();
#ifdef CTXGATE_HAVE_AVX2
  at::parallel_for(0, outputs, grain, [&](int64_t begin, int64_t end) {
    for (int64_t output = begin; output < end; ++output) {
      gemv_row_avx2(w_data + output * inner, output, x_data, rows, inner, outputs, out_data);
    }
  });
  return out;
#endif
  at::parallel_for(0, outputs, grain, [&](int64_t begin, int64_t end) {
    for (int64_t output = begin; output < end; ++output) {
      const uint16_t* row = w_data + output * inner;
      for (int64_t r = 0; r < rows; ++r) {
        out_data[r * outputs + output] = at::BFloat16(dot_f32(row, x_data + r * inner, inner));
      }
    }
  });
  return out;
}

// Runs fn(seq, kv_head, length, scores) for every (sequence, kv head) pair on ATen's threads,
// with a zeroed [group * length] float scratch buffer per call.
template <typename Fn>
void for_each_sequence_head(int64_t batch, int64_t num_kv_heads, int64_t group, const int64_t* lengths, Fn&& fn) {
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads;
      scores.assign(static_cast<size_t>(group * lengths[seq]), 0.0f);
      fn(seq, task % num_kv_heads, lengths[seq], scores);
    }
  });
}

// q: [B, H, D] (any float dtype); key/value cache: [KVH, num_slots, D] bfloat16 or int8;
// scales (int8 only): [KVH, num_blocks] float32; block_tables: [B, max_blocks] int64;
// context_lens: [B] int64. Returns [B, H, D] in q's dtype.
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& key_scales,
                                  const at::Tensor& value_scales, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, int64_t block_size, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 3, "query [B, H, D], cache [KVH, slots, D]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "KV cache must be contiguous");
  const bool quantized = key_cache.scalar_type() == at::kChar;
  TORCH_CHECK(quantized || key_cache.scalar_type() == at::kBFloat16,
              "paged_decode_attention supports bfloat16 or int8 KV caches");
  const at::Tensor q = query.to(at::kFloat).contiguous();
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lengths = context_lens.to(at::kLong).contiguous();
  const int64_t batch = q.size(0);
  const int64_t num_heads = q.size(1);
  const int64_t head_dim = q.size(2);
  const int64_t num_kv_heads = key_cache.size(0);
  const int64_t num_slots = key_cache.size(1);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = tables.size(1);
  const int64_t num_blocks = num_slots / block_size;
  TORCH_CHECK(key_cache.size(2) == head_dim && num_heads % num_kv_heads == 0, "head shapes disagree");

  at::Tensor out = at::empty({batch, num_heads, head_dim}, q.options());
  const float* q_data = q.data_ptr<float>();
  const int64_t* table_data = tables.data_ptr<int64_t>();
  const int64_t* length_data = lengths.data_ptr<int64_t>();
  float* out_data = out.data_ptr<float>();
  const float* key_scale_data = quantized ? key_scales.data_ptr<float>() : nullptr;
  const float* value_scale_data = quantized ? value_scales.data_ptr<float>() : nullptr;
  const float softmax_scale = static_cast<float>(scale);
  const int8_t* key_i8 = quantized ? key_cache.data_ptr<int8_t>() : nullptr;
  const int8_t* value_i8 = quantized ? value_cache.data_ptr<int8_t>() : nullptr;
  const uint16_t* key_bf16 =
      quantized ? nullptr : reinterpret_cast<const uint16_t*>(key_cache.data_ptr<at::BFloat16>());
  const uint16_t* value_bf16 =
      quantized ? nullptr : reinterpret_cast<const uint16_t*>(value_cache.data_ptr<at::BFloat16>());
  // Validate on the calling thread: the workers below index the pool without checks.
  for (int64_t seq = 0; seq < batch; ++seq) {
    const int64_t length = length_data[seq];
    TORCH_CHECK(length > 0 && length <= max_blocks * block_size, "context length out of range");
    for (int64_t index = 0; index < (length + block_size - 1) / block_size; ++index) {
      const int64_t block = table_data[seq * max_blocks + index];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id out of range");
    }
  }

#ifdef CTXGATE_HAVE_AVX512_BF16
  if (!quantized && query.scalar_type() == at::kBFloat16 && (head_dim == 64 || head_dim == 128)) {
    const at::Tensor q_bf16 = query.contiguous();
    const uint16_t* q_bits = reinterpret_cast<const uint16_t*>(q_bf16.data_ptr<at::BFloat16>());
    for_each_sequence_head(batch, num_kv_heads, group, length_data,
                           [&](int64_t seq, int64_t kv_head, int64_t length, std::vector<float>& scores) {
        const int64_t cache_offset = kv_head * num_slots * head_dim;
        const uint16_t* q_group = q_bits + (seq * num_heads + kv_head * group) * head_dim;
        float* out_group = out_data + (seq * num_heads + kv_head * group) * head_dim;
        const int64_t* table = table_data + seq * max_blocks;
        if (head_dim == 64) {
          decode_task_bf16<4>(q_group, group, key_bf16 + cache_offset, value_bf16 + cache_offset, table, length,
                              block_size, softmax_scale, scores.data(), out_group);
        } else {
          decode_task_bf16<8>(q_group, group, key_bf16 + cache_offset, value_bf16 + cache_offset, table, length,
                              block_size, softmax_scale, scores.data(), out_group);
        }
    });
    return out.to(query.scalar_type());
  }
#endif
  for_each_sequence_head(batch, num_kv_heads, group, length_data,
                         [&](int64_t seq, int64_t kv_head, int64_t length, std::vector<float>& scores) {
      const int64_t cache_offset = kv_head * num_slots * head_dim;
      // Pass 1: scores of every query head of the group against every context token.
      for (int64_t position = 0; position < length; ++position) {
        const int64_t block = table_data[seq * max_blocks + position / block_size];
        const int64_t slot = block * block_size + position % block_size;
        for (int64_t g = 0; g < group; ++g) {
          const float* q_row = q_data + (seq * num_heads + kv_head * group + g) * head_dim;
          float dot;
          if (quantized) {
            const int8_t* k_row = key_i8 + cache_offset + slot * head_dim;
            dot = dot_f32(k_row, q_row, head_dim) * key_scale_data[kv_head * num_blocks + block];
          } else {
            const uint16_t* k_row = key_bf16 + cache_offset + slot * head_dim;
            dot = dot_f32(k_row, q_row, head_dim);
          }
          scores[g * length + position] = dot * softmax_scale;
        }
      }
      for (int64_t g = 0; g < group; ++g) softmax_f32(scores.data() + g * length, length);
      // Pass 2: weighted sum of the values.
      float* out_rows = out_data + (seq * num_heads + kv_head * group) * head_dim;
      std::fill(out_rows, out_rows + group * head_dim, 0.0f);
      for (int64_t position = 0; position < length; ++position) {
        const int64_t block = table_data[seq * max_blocks + position / block_size];
        const int64_t slot = block * block_size + position % block_size;
        for (int64_t g = 0; g < group; ++g) {
          const float weight = scores[g * length + position];
          if (quantized) {
            const int8_t* v_row = value_i8 + cache_offset + slot * head_dim;
            axpy_f32(out_rows + g * head_dim, v_row, weight * value_scale_data[kv_head * num_blocks + block],
                    head_dim);
          } else {
            const uint16_t* v_row = value_bf16 + cache_offset + slot * head_dim;
            axpy_f32(out_rows + g * head_dim, v_row, weight, head_dim);
          }
        }
      }
  });
  return out.to(query.scalar_type());
}

inline float round_bf16(float value) { return static_cast<float>(at::BFloat16(value)); }

inline void check_bf16_rows(const at::Tensor& tensor, const char* name) {
  TORCH_CHECK(tensor.scalar_type() == at::kBFloat16 && tensor.dim() == 2 && tensor.stride(1) == 1,
              name, " must be a bfloat16 [rows, features] tensor with contiguous rows");
}

// Rows per parallel task for the elementwise kernels: decode-sized inputs run inline.
constexpr int64_t kElementwiseGrain = 16;

// x * rsqrt(mean(x^2) + eps) in float32, rounded to bfloat16, times the weight (rounded again).
inline void rms_norm_row(const at::BFloat16* x, const at::BFloat16* weight, at::BFloat16* out, int64_t hidden,
                         float eps) {
  float sum_squares = 0.0f;
  for (int64_t i = 0; i < hidden; ++i) {
    const float value = static_cast<float>(x[i]);
    sum_squares += value * value;
  }
  const float inverse = 1.0f / std::sqrt(sum_squares / static_cast<float>(hidden) + eps);
  for (int64_t i = 0; i < hidden; ++i) {
    out[i] = at::BFloat16(static_cast<float>(weight[i]) * round_bf16(static_cast<float>(x[i]) * inverse));
  }
}

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  check_bf16_rows(input, "input");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.numel() == input.size(1),
              "weight must be a contiguous bfloat16 [features] tensor");
  const int64_t rows = input.size(0), hidden = input.size(1), stride = input.stride(0);
  at::Tensor out = at::empty({rows, hidden}, input.options());
  const at::BFloat16* x = input.data_ptr<at::BFloat16>();
  const at::BFloat16* w = weight.data_ptr<at::BFloat16>();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, rows, kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(x + r * stride, w, o + r * hidden, hidden, static_cast<float>(eps));
  });
  return out;
}

// residual_out = residual + delta (bfloat16), normed = rms_norm(residual_out): the residual add and
// the next norm of a layer in one pass. Returns [normed, residual_out].
std::vector<at::Tensor> add_rms_norm(const at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight,
                                     double eps) {
  check_bf16_rows(residual, "residual");
  check_bf16_rows(delta, "delta");
  TORCH_CHECK(residual.sizes() == delta.sizes(), "residual and delta shapes differ");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.numel() == residual.size(1),
              "weight must be a contiguous bfloat16 [features] tensor");
  const int64_t rows = residual.size(0), hidden = residual.size(1);
  at::Tensor summed = at::empty({rows, hidden}, residual.options());
  at::Tensor normed = at::empty({rows, hidden}, residual.options());
  const at::BFloat16* a = residual.data_ptr<at::BFloat16>();
  const at::BFloat16* b = delta.data_ptr<at::BFloat16>();
  const at::BFloat16* w = weight.data_ptr<at::BFloat16>();
  at::BFloat16* s = summed.data_ptr<at::BFloat16>();
  at::BFloat16* n = normed.data_ptr<at::BFloat16>();
  const int64_t a_stride = residual.stride(0), b_stride = delta.stride(0);
  at::parallel_for(0, rows, kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < hidden; ++i) {
        s[r * hidden + i] = at::BFloat16(static_cast<float>(a[r * a_stride + i]) + static_cast<float>(b[r * b_stride + i]));
      }
      rms_norm_row(s + r * hidden, w, n + r * hidden, hidden, static_cast<float>(eps));
    }
  });
  return {normed, summed};
}

// gate_up: [rows, 2 * inner] -> silu(gate) * up, rounding where eager bfloat16 ops round.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_bf16_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = at::empty({rows, inner}, gate_up.options());
  const at::BFloat16* g = gate_up.data_ptr<at::BFloat16>();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, rows, kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const at::BFloat16* gate = g + r * stride;
      const at::BFloat16* up = gate + inner;
      int64_t i = 0;
#ifdef CTXGATE_HAVE_AVX512_BF16
      const uint16_t* gate_bits = reinterpret_cast<const uint16_t*>(gate);
      const uint16_t* up_bits = reinterpret_cast<const uint16_t*>(up);
      for (; i + 16 <= inner; i += 16) {
        const __m512 x = load_bf16x16(gate_bits + i);
        const __m512 activated = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
        // Round the activation to bfloat16 as the eager op does, then multiply and round again.
        const __m512 rounded = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(activated));
        const __m512 product = _mm512_mul_ps(rounded, load_bf16x16(up_bits + i));
        _mm256_storeu_si256((__m256i*)(o + r * inner + i), (__m256i)_mm512_cvtneps_pbh(product));
      }
#elif defined(CTXGATE_HAVE_AVX2)
      const uint16_t* gate_bits = reinterpret_cast<const uint16_t*>(gate);
      const uint16_t* up_bits = reinterpret_cast<const uint16_t*>(up);
      for (; i + 8 <= inner; i += 8) {
        const __m256 x = load8(gate_bits + i);
        const __m256 activated = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), x))));
        const __m256 product = _mm256_mul_ps(round_bf16x8(activated), load8(up_bits + i));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + r * inner + i), to_bf16x8(product));
      }
#endif
      for (; i < inner; ++i) {
        const float x = static_cast<float>(gate[i]);
        const float activated = round_bf16(x / (1.0f + std::exp(-x)));
        o[r * inner + i] = at::BFloat16(activated * static_cast<float>(up[i]));
      }
    }
  });
  return out;
}

// Rotary embedding of q and k straight from the fused qkv rows ([rows, (H + 2 KVH) * D]), with
// cos/sin as [rows, D] (the rotate-half layout). Returns [q [rows, H, D], k [rows, KVH, D]].
std::vector<at::Tensor> rotary_qk(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  check_bf16_rows(qkv, "qkv");
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16, "cos/sin must be bfloat16");
  const at::Tensor c = cos.reshape({-1, head_dim}).contiguous();
  const at::Tensor sn = sin.reshape({-1, head_dim}).contiguous();
  const int64_t rows = qkv.size(0), stride = qkv.stride(0), half = head_dim / 2;
  TORCH_CHECK(c.size(0) == rows && sn.size(0) == rows, "one cos/sin row per token");
  TORCH_CHECK(qkv.size(1) >= (num_heads + num_kv_heads) * head_dim, "qkv is too narrow");
  at::Tensor q = at::empty({rows, num_heads, head_dim}, qkv.options());
  at::Tensor k = at::empty({rows, num_kv_heads, head_dim}, qkv.options());
  const at::BFloat16* src = qkv.data_ptr<at::BFloat16>();
  const at::BFloat16* cos_data = c.data_ptr<at::BFloat16>();
  const at::BFloat16* sin_data = sn.data_ptr<at::BFloat16>();
  at::BFloat16* q_data = q.data_ptr<at::BFloat16>();
  at::BFloat16* k_data = k.data_ptr<at::BFloat16>();
  at::parallel_for(0, rows, kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const at::BFloat16* cos_row = cos_data + r * head_dim;
      const at::BFloat16* sin_row = sin_data + r * head_dim;
      for (int64_t head = 0; head < num_heads + num_kv_heads; ++head) {
        const at::BFloat16* x = src + r * stride + head * head_dim;
        at::BFloat16* out = head < num_heads ? q_data + (r * num_heads + head) * head_dim
                                             : k_data + (r * num_kv_heads + head - num_heads) * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) {
          // rotate_half: [-x2, x1]; eager rounds x*cos and rotated*sin to bf16 before adding.
          const float rotated = i < half ? -static_cast<float>(x[i + half]) : static_cast<float>(x[i - half]);
          const float left = round_bf16(static_cast<float>(x[i]) * static_cast<float>(cos_row[i]));
          const float right = round_bf16(rotated * static_cast<float>(sin_row[i]));
          out[i] = at::BFloat16(left + right);
        }
      }
    }
  });
  return {q, k};
}

}  // namespace

TORCH_LIBRARY(ctxgate_cpu, m) {
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor residual, Tensor delta, Tensor weight, float eps) -> Tensor[]");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def(
      "rotary_qk(Tensor qkv, Tensor cos, Tensor sin, int num_heads, int num_kv_heads, int head_dim) -> Tensor[]");
  m.def("gemv_bf16(Tensor input, Tensor weight) -> Tensor");
  m.def(
      "paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor key_scales, "
      "Tensor value_scales, Tensor block_tables, Tensor context_lens, int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(ctxgate_cpu, CPU, m) {
  m.impl("gemv_bf16", &gemv_bf16);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_qk", &rotary_qk);
}
