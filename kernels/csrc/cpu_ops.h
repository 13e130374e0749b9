// Shared by Conveyor's CPU kernels (kernels/csrc/*.cpp, built together into one extension by
// kernels/cpu_ext.py with torch.utils.cpp_extension, -O3 -march=native, one build per machine):
// element conversions, a vectorisable exp, and the entry points the module binds.
//
// Element types: float32 and bfloat16 (raw uint16_t here), always computed in fp32. Nothing here
// assumes an instruction set: loops are written for the compiler to vectorise with what
// -march=native offers (AVX2 on an AMD EPYC, AVX-512/AMX on an Intel Xeon).
#pragma once

// the narrow ATen headers (not ATen/ATen.h): each source compiles in ~2/3 of the time
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace conveyor {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even (inputs are finite)
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// IEEE half (a KV cache stored as float16): its own type, so that to_f can tell it from bf16.
struct Half {
  uint16_t bits;
};

inline float half_to_float(uint16_t h) {  // exact (every half is a float)
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// A KV cache row stored as 8-bit codes with its fp32 scale right after them (kernels/kv_quant.py:
// a row of head_dim codes then 4 bytes of scale, per token and KV head): int8 codes (value =
// code * scale) or fp8 e4m3 codes (value = e4m3(code) * scale).
struct Int8Code {
  int8_t v;
};
struct Fp8Code {
  uint8_t v;
};

inline float fp8_e4m3_to_float(uint8_t b) {  // OCP e4m3fn: bias 7, no infinities, 0x7f/0xff nan
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exp = (b >> 3) & 0xfu, mant = b & 0x7u;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(mant), -9);  // subnormal: mant * 2^-6 / 8
  } else if (exp == 0xf && mant == 0x7) {
    f = std::numeric_limits<float>::quiet_NaN();
  } else {
    const uint32_t bits = ((exp + 120u) << 23) | (mant << 20);
    std::memcpy(&f, &bits, sizeof(f));
  }
  uint32_t out;
  std::memcpy(&out, &f, sizeof(out));
  out |= sign;
  std::memcpy(&f, &out, sizeof(f));
  return f;
}

struct Fp8Table {  // all 256 e4m3 codes as floats, built once
  float v[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) v[i] = fp8_e4m3_to_float(static_cast<uint8_t>(i));
  }
};
inline const Fp8Table& fp8_table() {
  static const Fp8Table table;
  return table;
}

template <typename T>
inline float to_f(T v);
template <>
inline float to_f<float>(float v) { return v; }
template <>
inline float to_f<uint16_t>(uint16_t v) { return bf16_to_float(v); }
template <>
inline float to_f<Int8Code>(Int8Code v) { return static_cast<float>(v.v); }
template <>
inline float to_f<Fp8Code>(Fp8Code v) { return fp8_table().v[v.v]; }

// Whether a KV storage type carries a per-row scale after its codes (and how many bytes).
template <typename KV>
constexpr bool kScaledRow = std::is_same_v<KV, Int8Code> || std::is_same_v<KV, Fp8Code>;
constexpr int64_t kRowScaleBytes = 4;

template <typename KV>
inline float row_scale(const KV* row, int64_t head_dim) {
  if constexpr (kScaledRow<KV>) {
    float s;
    std::memcpy(&s, reinterpret_cast<const char*>(row + head_dim), sizeof(s));
    return s;
  } else {
    return 1.0f;
  }
}

template <>
inline float to_f<Half>(Half v) {
#if defined(__F16C__)
  return _cvtsh_ss(v.bits);  // every CPU of this project with AVX has F16C
#else
  return half_to_float(v.bits);
#endif
}

template <typename T>
inline T from_f(float v);
template <>
inline float from_f<float>(float v) { return v; }
template <>
inline uint16_t from_f<uint16_t>(float v) { return float_to_bf16(v); }

// exp(x) for x in [-87, 88] (clamped outside; Cephes single-precision polynomial, ~1 ulp;
// vectorises, unlike std::exp).
inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return e * scale;
}

// Eight floats as one GCC/Clang generic vector: the compiler lowers it to what -march=native has
// (one AVX2 register, half an AVX-512 one, two SSE ones), so no instruction set is assumed. Used
// where the auto-vectoriser gives up (exp_clamped's clamp and bit cast keep a loop scalar).
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

// exp_clamped on eight lanes (same polynomial and clamp).
inline f32x8 exp_clamped8(f32x8 x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const f32x8 t = x * 1.44269504088896341f + 0.5f;
  i32x8 i = __builtin_convertvector(t, i32x8);  // truncates toward zero, so for floor:
  i += __builtin_convertvector(i, f32x8) > t;    // -1 (true) where t was negative, inexact
  const f32x8 n = __builtin_convertvector(i, f32x8);
  const f32x8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  f32x8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const f32x8 e = p * r * r + r + 1.0f;
  const i32x8 bits = (i + 127) << 23;
  f32x8 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return e * scale;
}

// The kernels (each beside a torch reference of the same function in kernels/*.py).
// paged_attention.cpp <-> kernels.paged_attention.paged_attention_ref
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, const at::Tensor& block_tables,
                           double scale);
// layer_ops.cpp <-> kernels.rms_norm.rms_norm_ref, kernels.rotary.rotary_ref,
// kernels.silu_and_mul.silu_and_mul_ref
std::vector<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                 const c10::optional<at::Tensor>& residual);
void rotary(at::Tensor q, at::Tensor k, const at::Tensor& positions,
            const at::Tensor& cos_sin_cache);
at::Tensor silu_and_mul(const at::Tensor& x);
// kv_write.cpp <-> kernels.write_kv.write_kv_ref (+ kernels.rotary.rotary_ref)
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache,
              at::Tensor v_cache, const at::Tensor& slot_mapping);
at::Tensor rotary_write_kv(at::Tensor qkv, const at::Tensor& positions,
                           const at::Tensor& cos_sin_cache, at::Tensor k_cache,
                           at::Tensor v_cache, const at::Tensor& slot_mapping);
// qlinear.cpp <-> kernels.quant.quant_linear_ref
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                   const c10::optional<at::Tensor>& m, int64_t n, int64_t format);
int64_t qlinear_tile();

// decoder_layer.cpp <-> LlamaModel's Python layer over CpuOps (services/worker/model.py)
struct PackedLinear {  // qlinear's weight operands, held once per layer
  at::Tensor qs, d;
  c10::optional<at::Tensor> m;
  int64_t n, format;
  PackedLinear(at::Tensor qs_, at::Tensor d_, c10::optional<at::Tensor> m_, int64_t n_,
               int64_t format_);
};
struct LayerWeights {
  at::Tensor input_norm, post_norm;
  PackedLinear qkv, o_proj, gate_up, down;
  LayerWeights(at::Tensor input_norm_, at::Tensor post_norm_, PackedLinear qkv_,
               PackedLinear o_proj_, PackedLinear gate_up_, PackedLinear down_);
};
std::vector<at::Tensor> decoder_layer(const LayerWeights& w, const at::Tensor& x,
                                      const c10::optional<at::Tensor>& residual, double eps,
                                      const at::Tensor& positions,
                                      const at::Tensor& cos_sin_cache, at::Tensor k_cache,
                                      at::Tensor v_cache, const at::Tensor& query_start_loc,
                                      const at::Tensor& seq_lens, const at::Tensor& block_tables,
                                      const at::Tensor& slot_mapping, double scale);

}  // namespace conveyor
