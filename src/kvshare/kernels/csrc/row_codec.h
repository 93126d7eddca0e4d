// Decoding one stored cache row (cache/formats.py `RowFormat.unpack` for the quantised schemes) to its
// fp32 values: torch-free and header-only, so rows.cpp (`unpack_rows`) and attn.cpp (keys read in place)
// decode with the same code. Every value is exact in fp32 (an e4m3 or e2m1 code times its block scale),
// so any reader that rounds it to the row's reading dtype gets the torch decoder's bits. The functions
// are internal to each including unit (an unnamed namespace, as lanes8.h): attn.cpp compiles them for
// AVX2, and the linker must not hand that copy to a unit compiled for the baseline ISA.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <array>

namespace kvshare_kernels {

// RowFormat schemes served natively (formats.py names them; kernels/rows.py maps names to these ids).
// ROW_PLAIN: values of the reader's dtype, stored as they are (only attn.cpp reads those).
enum RowScheme : int { ROW_PLAIN = -1, ROW_FP4_E4M3 = 0, ROW_FP4_UE8M0 = 1, ROW_FP8_V41 = 2, ROW_FP8_V4 = 3 };

// A row's layout: [data][scales][pad]. fp4: `dim` e2m1 codes, two a byte (even element in the low
// nibble), then one scale byte per `block` (e4m3 for ROW_FP4_E4M3, ue8m0 otherwise). fp8_v41: e4m3
// codes, then ue8m0 scales per block. fp8_v4: the first dim - rope_dim values as e4m3, the last
// rope_dim as bf16, then the ue8m0 scales of the e4m3 blocks.
struct RowCodec {
  int scheme;
  int64_t block, dim, rope_dim;
};

namespace {

inline int64_t codec_quant_dims(const RowCodec& c) { return c.scheme == ROW_FP8_V4 ? c.dim - c.rope_dim : c.dim; }

inline bool codec_is_fp4(const RowCodec& c) { return c.scheme == ROW_FP4_E4M3 || c.scheme == ROW_FP4_UE8M0; }

// Bytes before the scales (codes, and fp8_v4's bf16 dims).
inline int64_t codec_data_bytes(const RowCodec& c) {
  const int64_t n = codec_quant_dims(c);
  return codec_is_fp4(c) ? n / 2 : n + 2 * c.rope_dim;
}

// The fewest bytes a stored row of this layout has (data and scales; pad not counted).
inline int64_t codec_row_bytes(const RowCodec& c) { return codec_data_bytes(c) + codec_quant_dims(c) / c.block; }

// Whether the layout is one of the schemes above with blocks that tile the quantised dims.
inline bool codec_valid(const RowCodec& c) {
  const int64_t n = codec_quant_dims(c);
  return c.scheme >= ROW_FP4_E4M3 && c.scheme <= ROW_FP8_V4 && c.block > 0 && c.rope_dim >= 0 && n > 0 &&
         n % c.block == 0 && (!codec_is_fp4(c) || c.block % 2 == 0) && (c.scheme == ROW_FP8_V4 || c.rope_dim == 0);
}

// e4m3 (the "fn" variant: no infinities, S.1111.111 is NaN) -> fp32, exactly.
inline float e4m3_to_f32(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  float v;
  if (e == 15 && m == 7) {
    v = NAN;
  } else if (e == 0) {
    v = static_cast<float>(m) * 0x1p-9f;
  } else {
    const uint32_t bits = static_cast<uint32_t>(e + 120) << 23 | static_cast<uint32_t>(m) << 20;
    memcpy(&v, &bits, 4);
  }
  return (b & 0x80) ? -v : v;
}

// Every e4m3 code's value, indexed by the code byte (built once: a decoded value is one load).
inline const float* e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = e4m3_to_f32(static_cast<uint8_t>(b));
    return t;
  }();
  return table.data();
}

// ue8m0 byte e -> 2^(e - 127) (e = 0: the subnormal 2^-127), from the exponent bits.
inline float ue8m0_to_f32(uint8_t e) {
  const uint32_t bits = e ? static_cast<uint32_t>(e) << 23 : 0x00400000u;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// e2m1 codes (sign bit 3) -> their grid values.
alignas(64) inline constexpr float E2M1_VALUES[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// The row's `dim` values (codec_valid(c), row holds codec_row_bytes(c) bytes).
inline void decode_row(const uint8_t* row, const RowCodec& c, float* v) {
  const int64_t n = codec_quant_dims(c), data = codec_data_bytes(c);
  const float* e4m3 = e4m3_table();
  for (int64_t b = 0; b < n; b += c.block) {
    const uint8_t sb = row[data + b / c.block];
    const float s = c.scheme == ROW_FP4_E4M3 ? e4m3[sb] : ue8m0_to_f32(sb);
    if (codec_is_fp4(c)) {
      for (int64_t i = 0; i < c.block; i += 2) {
        const uint8_t byte = row[(b + i) / 2];
        v[b + i] = E2M1_VALUES[byte & 0xF] * s;
        v[b + i + 1] = E2M1_VALUES[byte >> 4] * s;
      }
    } else {
      for (int64_t i = 0; i < c.block; ++i) v[b + i] = e4m3[row[b + i]] * s;
    }
  }
  for (int64_t i = 0; i < c.rope_dim; ++i) {
    uint16_t h;
    memcpy(&h, row + n + 2 * i, 2);
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    memcpy(v + n + i, &bits, 4);
  }
}

}  // namespace
}  // namespace kvshare_kernels
