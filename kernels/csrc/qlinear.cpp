// Weight-only quantized linear layers: y[M, N] = x[M, K] @ dequant(W)[N, K]^T, with W in one of
// GGUF's 32-weight block formats, dequantized in registers and multiplied in fp32. Torch
// reference: kernels.quant.quant_linear_ref; packing and launcher: kernels/quant.py.
//
// Every format is read as w = q * d + m per block of 32 weights along K: Q4_1 (q in 0..15, its
// own d and m), Q4_0 (q in 0..15, m = -8 d, made in registers), Q8_0 (q in -128..127, m = 0); one
// loop serves all three (Traits, Group). d and m stay the file's fp16 numbers, so the kernel
// reads the file's bytes per weight (0.5625 / 0.625 / 1.0625), and widens them exactly.
//
// Packed layout (kernels/quant.py `pack`): columns (output features) in tiles of kTile = 2
// vectors; per tile and k the tile's kTile codes are contiguous (4-bit: byte j holds column j in
// its low nibble and column j + kTile/2 in its high one; 8-bit: one byte per column); d (and
// Q4_1's m) per tile, group and column as fp16. So a k step loads one short run of bytes, and a
// group of 32 k steps two vectors of scales, whatever the instruction set.
//
// Two schedules, the same arithmetic: up to one register block of rows dequantize each k step in
// registers and use it for all rows (decode, with or without drafts); more rows dequantize the tile once into a thread-local fp32 panel
// [K, kTile] and run a register-blocked GEMM over it. Either way each weight is w = q d + m with
// one rounding (q d is exact), the very fp32 number the dequantized reference holds, so the
// outputs differ from it only by summation order. Threads split the column tiles. The vectors
// are GCC generic vectors: 16 lanes where the compiler targets AVX-512 (__AVX512F__), else 8
// (AVX2, or two SSE registers); FMA where __FMA__ or AVX-512 say so, fp16 widening where
// __F16C__ does.

#include "cpu_ops.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace conveyor {
namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kPanelRows = 8;  // rows per register block: 16 accumulators of 32 registers
#else
constexpr int kLanes = 8;
constexpr int kPanelRows = 6;  // 12 accumulators of 16 registers
#endif
constexpr int kTile = 2 * kLanes;  // columns per tile
constexpr int kGroup = 32;         // weights per quantization block along K
// Up to this many rows (one register block): dequantize in registers at each k step. A panel
// pays only when several row blocks reuse it; below that, writing and reading it back costs more
// than the rows' few FMAs per weight (a 5-row step, one decode with 4 drafts, took 1.72x a
// 1-row step over the panel).
constexpr int kDirectRows = kPanelRows;

typedef float fvec __attribute__((vector_size(kLanes * 4)));
typedef int32_t ivec __attribute__((vector_size(kLanes * 4)));

inline fvec fmadd(fvec a, fvec b, fvec c) {  // a * b + c, fused where the CPU has FMA
#if defined(__AVX512F__)
  return (fvec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (fvec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

inline fvec load(const float* p) {
  fvec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, fvec v) { std::memcpy(p, &v, sizeof(v)); }

inline fvec splat(float v) {
#if defined(__AVX512F__)
  return (fvec)_mm512_set1_ps(v);
#elif defined(__AVX__)
  return (fvec)_mm256_set1_ps(v);
#else
  fvec out;
  for (int i = 0; i < kLanes; ++i) out[i] = v;
  return out;
#endif
}

// kLanes bytes from p widened to int32 lanes, zero- or sign-extended (GCC's generic
// __builtin_convertvector does this byte by byte, so the widening is an intrinsic where one
// exists).
template <bool Signed>
inline ivec widen(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (ivec)(Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (ivec)(Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
  ivec out;
  for (int i = 0; i < kLanes; ++i) {
    out[i] = Signed ? static_cast<int32_t>(static_cast<int8_t>(p[i])) : static_cast<int32_t>(p[i]);
  }
  return out;
#endif
}

// GGUF's block formats, in kernels.quant.FORMATS order: w = q * d + m per 32 weights along K.
enum Format : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };

// Q4_0 (q in 0..15, m = -8 d, made in registers), Q4_1 (q in 0..15, m stored), Q8_0 (q in
// -128..127, m = 0): one loop reads all three through these traits.
template <int F>
struct Traits {
  static constexpr int kBits = F == kQ8_0 ? 8 : 4;
  static constexpr bool kStoredMin = F == kQ4_1;
};

// kLanes fp16 numbers from p as floats (exact: every half is a float).
inline fvec load_half(const uint16_t* p) {
#if defined(__AVX512F__)
  return (fvec)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  return (fvec)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  fvec out;
  for (int i = 0; i < kLanes; ++i) out[i] = half_to_float(p[i]);
  return out;
#endif
}

struct Tile {
  const uint8_t* qs;  // codes of the tile [K, kTile] (packed as above)
  const uint16_t* d;  // fp16 [G, kTile]
  const uint16_t* m;  // fp16 [G, kTile] (Q4_1 only)
};

// One group's scales for the tile's two vectors of columns, and its weights at any k of the
// group: w = q * d + m, one rounding, as the reference's q * d (exact) + m.
template <int F>
struct Group {
  fvec d0, d1, m0, m1;

  Group(const Tile& t, int64_t g) {
    d0 = load_half(t.d + g * kTile);
    d1 = load_half(t.d + g * kTile + kLanes);
    if constexpr (Traits<F>::kStoredMin) {
      m0 = load_half(t.m + g * kTile);
      m1 = load_half(t.m + g * kTile + kLanes);
    } else if constexpr (F == kQ4_0) {
      m0 = d0 * -8.0f;  // exact
      m1 = d1 * -8.0f;
    }
  }

  void weights(const uint8_t* qs, int64_t k, fvec& w0, fvec& w1) const {
    if constexpr (Traits<F>::kBits == 4) {
      const ivec v = widen<false>(qs + k * (kTile / 2));
      w0 = fmadd(__builtin_convertvector(v & 15, fvec), d0, m0);
      w1 = fmadd(__builtin_convertvector(v >> 4, fvec), d1, m1);
    } else {
      w0 = __builtin_convertvector(widen<true>(qs + k * kTile), fvec) * d0;
      w1 = __builtin_convertvector(widen<true>(qs + k * kTile + kLanes), fvec) * d1;
    }
  }
};

// The tile's weights at group g, k steps [32 g, 32 g + 32), into the fp32 panel [K, kTile].
template <int F>
inline void dequant_group(const Tile& t, int64_t g, float* panel) {
  const Group<F> s(t, g);
  for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
    fvec w0, w1;
    s.weights(t.qs, k, w0, w1);
    store(panel + k * kTile, w0);
    store(panel + k * kTile + kLanes, w1);
  }
}

// Rows [0, R) of x (fp32, leading dimension ldx) times the tile, dequantized in registers at
// every k step; out [R, kTile] (fp32, leading dimension kTile).
template <int F, int R>
void direct_rows(const float* x, int64_t ldx, int64_t K, const Tile& t, float* out) {
  fvec acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = fvec{};
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const Group<F> s(t, g);
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
      fvec w0, w1;
      s.weights(t.qs, k, w0, w1);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const fvec xv = splat(x[r * ldx + k]);
        acc[r][0] = fmadd(xv, w0, acc[r][0]);
        acc[r][1] = fmadd(xv, w1, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    store(out + r * kTile, acc[r][0]);
    store(out + r * kTile + kLanes, acc[r][1]);
  }
}

// Rows [0, R) of x times a dequantized panel [K, kTile]; out as direct_rows.
template <int R>
void panel_rows(const float* x, int64_t ldx, int64_t K, const float* panel, float* out) {
  fvec acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = fvec{};
  for (int64_t k = 0; k < K; ++k) {
    const fvec w0 = load(panel + k * kTile), w1 = load(panel + k * kTile + kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const fvec xv = splat(x[r * ldx + k]);
      acc[r][0] = fmadd(xv, w0, acc[r][0]);
      acc[r][1] = fmadd(xv, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    store(out + r * kTile, acc[r][0]);
    store(out + r * kTile + kLanes, acc[r][1]);
  }
}

template <int F>
void direct_any(int64_t rows, const float* x, int64_t ldx, int64_t K, const Tile& t, float* out) {
  switch (rows) {
    case 1: direct_rows<F, 1>(x, ldx, K, t, out); break;
    case 2: direct_rows<F, 2>(x, ldx, K, t, out); break;
    case 3: direct_rows<F, 3>(x, ldx, K, t, out); break;
    case 4: direct_rows<F, 4>(x, ldx, K, t, out); break;
    case 5: direct_rows<F, 5>(x, ldx, K, t, out); break;
#if defined(__AVX512F__)
    case 6: direct_rows<F, 6>(x, ldx, K, t, out); break;
    case 7: direct_rows<F, 7>(x, ldx, K, t, out); break;
#endif
    default: direct_rows<F, kDirectRows>(x, ldx, K, t, out); break;
  }
}

void panel_any(int64_t rows, const float* x, int64_t ldx, int64_t K, const float* panel,
               float* out) {
  switch (rows) {
    case 1: panel_rows<1>(x, ldx, K, panel, out); break;
    case 2: panel_rows<2>(x, ldx, K, panel, out); break;
    case 3: panel_rows<3>(x, ldx, K, panel, out); break;
    case 4: panel_rows<4>(x, ldx, K, panel, out); break;
    case 5: panel_rows<5>(x, ldx, K, panel, out); break;
#if defined(__AVX512F__)
    case 6: panel_rows<6>(x, ldx, K, panel, out); break;
    case 7: panel_rows<7>(x, ldx, K, panel, out); break;
#endif
    default: panel_rows<kPanelRows>(x, ldx, K, panel, out); break;
  }
}

// out [rows, kTile] -> y columns [n0, n0 + width) of `rows` rows (width < kTile on the last tile)
template <typename T>
void write_out(const float* out, int64_t rows, int64_t width, T* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < width; ++j) y[r * ldy + j] = from_f<T>(out[r * kTile + j]);
  }
}

template <int F, typename T>
void qlinear_impl(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* qs,
                  const uint16_t* d, const uint16_t* m, T* y) {
  const int64_t num_tiles = (N + kTile - 1) / kTile;
  const int64_t G = K / kGroup;
  const int64_t tile_bytes = K * kTile * Traits<F>::kBits / 8;
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> out(static_cast<size_t>(kPanelRows * kTile));
    std::vector<float> panel(M > kDirectRows ? static_cast<size_t>(K * kTile) : 0);
    for (int64_t i = begin; i < end; ++i) {
      const Tile t{qs + i * tile_bytes, d + i * G * kTile, m ? m + i * G * kTile : nullptr};
      const int64_t width = std::min<int64_t>(kTile, N - i * kTile);
      if (M <= kDirectRows) {
        direct_any<F>(M, x, K, K, t, out.data());
        write_out(out.data(), M, width, y + i * kTile, N);
        continue;
      }
      for (int64_t g = 0; g < G; ++g) dequant_group<F>(t, g, panel.data());
      for (int64_t r0 = 0; r0 < M; r0 += kPanelRows) {
        const int64_t rows = std::min<int64_t>(kPanelRows, M - r0);
        panel_any(rows, x + r0 * K, K, K, panel.data(), out.data());
        write_out(out.data(), rows, width, y + r0 * N + i * kTile, N);
      }
    }
  });
}

template <int F>
void qlinear_any(const at::Tensor& xf, const at::Tensor& qs, const at::Tensor& d,
                 const c10::optional<at::Tensor>& m, at::Tensor& y) {
  const float* xp = xf.data_ptr<float>();
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr());
  const auto* mp = Traits<F>::kStoredMin ? reinterpret_cast<const uint16_t*>(m->data_ptr())
                                         : nullptr;
  const int64_t M = xf.size(0), K = xf.size(1), N = y.size(1);
  if (y.scalar_type() == at::kBFloat16) {
    auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
    qlinear_impl<F>(xp, M, K, N, qs.data_ptr<uint8_t>(), dp, mp, yp);
  } else {
    qlinear_impl<F>(xp, M, K, N, qs.data_ptr<uint8_t>(), dp, mp, y.data_ptr<float>());
  }
}

void check_scales(const char* name, const at::Tensor& t, int64_t numel) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kHalf && t.is_contiguous() && t.numel() == numel,
                    name, " must be contiguous float16 of ", numel, " elements");
}

}  // namespace

int64_t qlinear_tile() { return kTile; }

// x [M, K] (float32 or bfloat16, contiguous) @ W^T -> [M, N] in x's dtype. qs: uint8 codes packed
// per tile; d, m: float16 [num_tiles, G, kTile] (m only for Q4_1); format: a Format above.
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                   const c10::optional<at::Tensor>& m, int64_t n, int64_t format) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK_VALUE(K % kGroup == 0, "K must be a multiple of 32, got ", K);
  TORCH_CHECK_VALUE(format >= kQ4_0 && format <= kQ8_0, "format must be 0 (Q4_0), 1 (Q4_1) or 2");
  const int64_t bits = format == kQ8_0 ? 8 : 4;
  const int64_t num_tiles = (n + kTile - 1) / kTile;
  const int64_t code_bytes = num_tiles * K * kTile * bits / 8;
  TORCH_CHECK_VALUE(qs.scalar_type() == at::kByte && qs.is_contiguous() &&
                        qs.numel() == code_bytes,
                    "qs must be contiguous uint8 of ", code_bytes, " bytes");
  const int64_t scale_numel = num_tiles * (K / kGroup) * kTile;
  check_scales("d", d, scale_numel);
  if (format == kQ4_1) {
    TORCH_CHECK_VALUE(m.has_value(), "Q4_1 needs m");
    check_scales("m", *m, scale_numel);
  }
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK_VALUE(bf16 || x.scalar_type() == at::kFloat, "x must be float32 or bfloat16");
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0) return y;
  at::Tensor xf = bf16 ? x.to(at::kFloat) : x;  // the products are fp32 either way
  switch (format) {
    case kQ4_0: qlinear_any<kQ4_0>(xf, qs, d, m, y); break;
    case kQ4_1: qlinear_any<kQ4_1>(xf, qs, d, m, y); break;
    default: qlinear_any<kQ8_0>(xf, qs, d, m, y); break;
  }
  return y;
}

}  // namespace conveyor
