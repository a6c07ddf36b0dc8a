// CPU kernels for the decode path, where eager PyTorch spends most of its time moving memory.
//
// - gemv_bf16: y = x @ W^T for a few rows of x (decode batches). oneDNN's bfloat16 GEMM reaches
//   about half of this machine's memory bandwidth at M = 1; a plain row-parallel dot-product loop
//   streams W once at close to the full bandwidth.
// - paged_decode_attention: attention for one new token per sequence, reading K/V straight from
//   the paged pool through the block table (bfloat16 or int8 with per-block scales), so no gathered
//   copy of the context is made per layer.
//
// Plain C++ that GCC vectorises (fixed-width accumulator arrays); threads come from ATen's pool
// (at::parallel_for), so torch.set_num_threads governs them and no second OpenMP runtime is used.

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
#include <immintrin.h>
#define CTXGATE_HAVE_AVX512_BF16 1
#endif

namespace {

constexpr int64_t kLanes = 16;

inline float bf16_to_float(uint16_t bits) {
  uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

// Dot product of a bfloat16 row with a float vector; lanes keep the loop vectorisable without
// -ffast-math (each lane accumulates independently).
inline float dot_bf16_f32(const uint16_t* row, const float* vec, int64_t length) {
  float lanes[kLanes] = {0};
  int64_t index = 0;
  for (; index + kLanes <= length; index += kLanes) {
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      lanes[lane] += bf16_to_float(row[index + lane]) * vec[index + lane];
    }
  }
  float total = 0.0f;
  for (int64_t lane = 0; lane < kLanes; ++lane) total += lanes[lane];
  for (; index < length; ++index) total += bf16_to_float(row[index]) * vec[index];
  return total;
}

inline float dot_i8_f32(const int8_t* row, const float* vec, int64_t length) {
  float lanes[kLanes] = {0};
  int64_t index = 0;
  for (; index + kLanes <= length; index += kLanes) {
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      lanes[lane] += static_cast<float>(row[index + lane]) * vec[index + lane];
    }
  }
  float total = 0.0f;
  for (int64_t lane = 0; lane < kLanes; ++lane) total += lanes[lane];
  for (; index < length; ++index) total += static_cast<float>(row[index]) * vec[index];
  return total;
}

inline void axpy_bf16(float* out, const uint16_t* row, float weight, int64_t length) {
  for (int64_t index = 0; index < length; ++index) out[index] += weight * bf16_to_float(row[index]);
}

inline void axpy_i8(float* out, const int8_t* row, float weight, int64_t length) {
  for (int64_t index = 0; index < length; ++index) out[index] += weight * static_cast<float>(row[index]);
}

#ifdef CTXGATE_HAVE_AVX512_BF16
// One weight row at a time: a single sequential stream per thread measured ~2x the bandwidth of
// interleaving 2-8 rows (the hardware prefetcher follows one stream best).
constexpr int64_t kRowTile = 1;
constexpr int64_t kInputTile = 4;  // input rows sharing each weight load

inline __m512bh load_bf16x32(const uint16_t* source, bool tail, __mmask32 tail_mask) {
  return tail ? (__m512bh)_mm512_maskz_loadu_epi16(tail_mask, source) : (__m512bh)_mm512_loadu_si512(source);
}

// out[first_input + r, first_output + j] = inputs[first_input + r] . weight[first_output + j].
// Each 32-value weight chunk is loaded once and fed to one vdpbf16ps per input row (fp32 sums).
// Compile-time tile sizes keep all ROWS x INPUTS accumulators in registers.
template <int ROWS, int INPUTS>
inline void gemv_tile(const uint16_t* weight, int64_t first_output, const uint16_t* inputs, int64_t first_input,
                      int64_t inner, int64_t outputs, at::BFloat16* out) {
  const int64_t full = inner / 32 * 32;
  const __mmask32 tail_mask = static_cast<__mmask32>((1ULL << (inner - full)) - 1);
  __m512 acc[ROWS][INPUTS];
  for (int j = 0; j < ROWS; ++j)
    for (int r = 0; r < INPUTS; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t index = 0; index < inner; index += 32) {
    const bool tail = index >= full;
    __m512bh weights[ROWS];
    for (int j = 0; j < ROWS; ++j) weights[j] = load_bf16x32(weight + (first_output + j) * inner + index, tail, tail_mask);
    for (int r = 0; r < INPUTS; ++r) {
      const __m512bh values = load_bf16x32(inputs + (first_input + r) * inner + index, tail, tail_mask);
      for (int j = 0; j < ROWS; ++j) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], weights[j], values);
    }
  }
  for (int r = 0; r < INPUTS; ++r)
    for (int j = 0; j < ROWS; ++j)
      out[(first_input + r) * outputs + first_output + j] = at::BFloat16(_mm512_reduce_add_ps(acc[j][r]));
}

template <int ROWS>
inline void gemv_rows(const uint16_t* weight, int64_t first_output, const uint16_t* inputs, int64_t num_inputs,
                      int64_t inner, int64_t outputs, at::BFloat16* out) {
  int64_t first_input = 0;
  for (; first_input + kInputTile <= num_inputs; first_input += kInputTile)
    gemv_tile<ROWS, kInputTile>(weight, first_output, inputs, first_input, inner, outputs, out);
  switch (num_inputs - first_input) {
    case 3: gemv_tile<ROWS, 3>(weight, first_output, inputs, first_input, inner, outputs, out); break;
    case 2: gemv_tile<ROWS, 2>(weight, first_output, inputs, first_input, inner, outputs, out); break;
    case 1: gemv_tile<ROWS, 1>(weight, first_output, inputs, first_input, inner, outputs, out); break;
    default: break;
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
  const int64_t num_tiles = (outputs + kRowTile - 1) / kRowTile;
  at::parallel_for(0, num_tiles, std::max<int64_t>(1, grain / kRowTile), [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t first_output = tile * kRowTile;
      gemv_rows<kRowTile>(w_data, first_output, x_bf16, rows, inner, outputs, out_data);
    }
  });
  return out;
#endif
  const at::Tensor x_float = x.to(at::kFloat);
  const float* x_data = x_float.data_ptr<float>();
  at::parallel_for(0, outputs, grain, [&](int64_t begin, int64_t end) {
    for (int64_t output = begin; output < end; ++output) {
      const uint16_t* row = w_data + output * inner;
      for (int64_t r = 0; r < rows; ++r) {
        out_data[r * outputs + output] = at::BFloat16(dot_bf16_f32(row, x_data + r * inner, inner));
      }
    }
  });
  return out;
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

  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads;
      const int64_t kv_head = task % num_kv_heads;
      const int64_t length = length_data[seq];
      scores.assign(static_cast<size_t>(group * length), 0.0f);
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
            dot = dot_i8_f32(k_row, q_row, head_dim) * key_scale_data[kv_head * num_blocks + block];
          } else {
            const uint16_t* k_row = key_bf16 + cache_offset + slot * head_dim;
            dot = dot_bf16_f32(k_row, q_row, head_dim);
          }
          scores[g * length + position] = dot * softmax_scale;
        }
      }
      // Softmax per query head.
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * length;
        const float peak = *std::max_element(row, row + length);
        float total = 0.0f;
        for (int64_t position = 0; position < length; ++position) {
          row[position] = std::exp(row[position] - peak);
          total += row[position];
        }
        const float inverse = 1.0f / total;
        for (int64_t position = 0; position < length; ++position) row[position] *= inverse;
      }
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
            axpy_i8(out_rows + g * head_dim, v_row, weight * value_scale_data[kv_head * num_blocks + block],
                    head_dim);
          } else {
            const uint16_t* v_row = value_bf16 + cache_offset + slot * head_dim;
            axpy_bf16(out_rows + g * head_dim, v_row, weight, head_dim);
          }
        }
      }
    }
  });
  return out.to(query.scalar_type());
}

}  // namespace

TORCH_LIBRARY(ctxgate_cpu, m) {
  m.def("gemv_bf16(Tensor input, Tensor weight) -> Tensor");
  m.def(
      "paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor key_scales, "
      "Tensor value_scales, Tensor block_tables, Tensor context_lens, int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(ctxgate_cpu, CPU, m) {
  m.impl("gemv_bf16", &gemv_bf16);
  m.impl("paged_decode_attention", &paged_decode_attention);
}
