// A GGUF tensor's rows of blocks dequantized to float32 where looked up (a token embedding
// kept in the file's blocks: embedding.py), each value as gguf-py's numpy dequantization
// computes it, bit for bit: every product below is exact in float32 (a float16 times at most
// 8 bits, times at most 6), so only the one addition of a minimum rounds, as numpy's does.
// Types: F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (their gguf-py names); a
// row's layout is the file's, blocks of 32 weights (the K-quants: super-blocks of 256).
#pragma once

#include "common.h"

namespace {

enum class Gguf { F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K };

struct GgufType {
  const char* name;
  Gguf type;
  int64_t weights, bytes;  // a block's
};

constexpr GgufType GGUF_ROW_TYPES[] = {
    {"F16", Gguf::F16, 1, 2},       {"BF16", Gguf::BF16, 1, 2},     {"Q4_0", Gguf::Q4_0, 32, 18},
    {"Q4_1", Gguf::Q4_1, 32, 20},   {"Q5_0", Gguf::Q5_0, 32, 22},   {"Q5_1", Gguf::Q5_1, 32, 24},
    {"Q8_0", Gguf::Q8_0, 32, 34},   {"Q4_K", Gguf::Q4_K, 256, 144}, {"Q5_K", Gguf::Q5_K, 256, 176},
    {"Q6_K", Gguf::Q6_K, 256, 210},
};

// The type named `name` (gguf-py's name), or null where `gguf_rows` takes no such type.
const GgufType* gguf_row_type(const std::string& name) {
  for (const auto& t : GGUF_ROW_TYPES)
    if (name == t.name) return &t;
  return nullptr;
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Q4_K's (Q5_K's) six-bit sc and m of sub-block j from its 12 bytes at s (gguf-py's get_scale_min).
inline void k_scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 0x3F;
    m = s[j + 4] & 0x3F;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
    m = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
}

// A block b of 32 weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: d, Q4_1/Q5_1 m, Q5's 4 bytes of fifth
// bits, then the values) into out[0..32).
inline void small_block(Gguf type, const uint8_t* b, float* out) {
  const float d = half_at(b);
  if (type == Gguf::Q8_0) {
    for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(static_cast<int8_t>(b[2 + i]));
    return;
  }
  const bool has_min = type == Gguf::Q4_1 || type == Gguf::Q5_1;
  const bool five = type == Gguf::Q5_0 || type == Gguf::Q5_1;
  const float m = has_min ? half_at(b + 2) : 0.0f;
  const uint8_t* at = b + (has_min ? 4 : 2);
  uint32_t high = 0;
  if (five) {
    std::memcpy(&high, at, 4);
    at += 4;
  }
  for (int i = 0; i < 32; ++i) {
    int q = (at[i % 16] >> (i / 16 * 4)) & 0x0F;
    if (five) q |= ((high >> i) & 1) << 4;
    if (has_min) out[i] = d * static_cast<float>(q) + m;
    else out[i] = d * static_cast<float>(q - (five ? 16 : 8));
  }
}

// A super-block b of 256 weights (Q4_K, Q5_K, Q6_K) into out[0..256).
inline void super_block(Gguf type, const uint8_t* b, float* out) {
  if (type == Gguf::Q6_K) {  // 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d
    const float d = half_at(b + 208);
    for (int i = 0; i < 256; ++i) {
      const int h = i / 128, c = i % 128;  // c: 0..127 within the half
      const int low = (b[64 * h + c % 64] >> (c / 64 * 4)) & 0x0F;
      const int top = (b[128 + 32 * h + c % 32] >> (c / 32 * 2)) & 0x03;
      const float scale = d * static_cast<float>(static_cast<int8_t>(b[192 + i / 16]));
      out[i] = scale * static_cast<float>((low | top << 4) - 32);
    }
    return;
  }
  const bool five = type == Gguf::Q5_K;  // 32 bytes of fifth bits after the 12 of sc and m
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* nibbles = b + (five ? 48 : 16);
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    k_scale_min(b + 4, j, sc, m);
    const float scale = d * static_cast<float>(sc), min = dmin * static_cast<float>(m);
    for (int k = 0; k < 32; ++k) {
      int q = (nibbles[32 * (j / 2) + k] >> (j % 2 * 4)) & 0x0F;
      if (five) q |= ((b[16 + k] >> j) & 1) << 4;
      out[32 * j + k] = scale * static_cast<float>(q) - min;
    }
  }
}

// Whether `gguf_rows` dequantizes rows of the GGUF type `type_name`.
bool gguf_rows_take(const std::string& type_name) { return gguf_row_type(type_name) != nullptr; }

// The float32 rows `ids` (int64, any shape) of `blocks` (uint8 [rows, bytes a row]) of the GGUF
// type `type_name`: [*ids.shape, width]; IndexError for an id outside 0..rows-1.
at::Tensor gguf_rows(const at::Tensor& blocks, const at::Tensor& ids_in, const std::string& type_name) {
  const GgufType* kind = gguf_row_type(type_name);
  TORCH_CHECK(kind != nullptr,
              "expected a GGUF type of F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, got ", type_name);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "expected contiguous uint8 blocks [rows, bytes a row], got ", blocks.scalar_type(), " ",
              blocks.sizes());
  const int64_t bytes = blocks.size(1), count = bytes / kind->bytes, rows = blocks.size(0);
  TORCH_CHECK(bytes % kind->bytes == 0, "expected ", type_name, " rows of whole ", kind->bytes,
              "-byte blocks, got ", bytes, " bytes");
  TORCH_CHECK_TYPE(at::isIntegralType(ids_in.scalar_type(), /*includeBool=*/false),
                   "expected integer token ids, got ", ids_in.scalar_type());
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t n = 0; n < ids.numel(); ++n) {
    TORCH_CHECK_INDEX(id[n] >= 0, "expected token ids from 0, got ", id[n]);
    TORCH_CHECK_INDEX(id[n] < rows, "expected token ids below ", rows, ", got ", id[n]);
  }
  const int64_t width = count * kind->weights;
  auto sizes = ids.sizes().vec();
  sizes.push_back(width);
  at::Tensor out = at::empty(sizes, blocks.options().dtype(at::kFloat));
  const uint8_t* data = blocks.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  const Gguf type = kind->type;
  at::parallel_for(0, ids.numel(), 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = data + id[n] * bytes;
      float* o = y + n * width;
      for (int64_t k = 0; k < count; ++k) {
        const uint8_t* b = row + k * kind->bytes;
        if (type == Gguf::F16) o[k] = half_at(b);
        else if (type == Gguf::BF16) o[k] = at::BFloat16(static_cast<uint16_t>(b[0] | b[1] << 8), at::BFloat16::from_bits());
        else if (kind->weights == 32) small_block(type, b, o + 32 * k);
        else super_block(type, b, o + 256 * k);
      }
    }
  });
  return out;
}

}  // namespace
