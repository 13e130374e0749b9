// The small fused ops of a Llama layer: residual-add + RMSNorm, rotary on q and k in place,
// SiLU-and-mul. Rows are independent: parallel over rows, fp32 inside. Torch references:
// kernels.rms_norm.rms_norm_ref, kernels.rotary.rotary_ref, kernels.silu_and_mul.silu_and_mul_ref.

#include "cpu_ops.h"

namespace conveyor {

template <typename T>
void rms_norm_rows(const T* x, const T* residual, const T* weight, T* out, T* res_out,
                   int64_t rows, int64_t hidden, int64_t x_stride, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(hidden));
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      float ss = 0.0f;
      for (int64_t i = 0; i < hidden; ++i) {
        float v = to_f(xr[i]);
        if (residual != nullptr) {
          // the residual stream is kept in the model dtype, as the torch path does
          v = to_f(from_f<T>(v + to_f(residual[r * hidden + i])));
        }
        buf[static_cast<size_t>(i)] = v;
        ss += v * v;
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(hidden) + eps);
      for (int64_t i = 0; i < hidden; ++i) {
        const float v = buf[static_cast<size_t>(i)];
        if (res_out != nullptr) res_out[r * hidden + i] = from_f<T>(v);
        out[r * hidden + i] = from_f<T>(to_f(weight[i]) * to_f(from_f<T>(v * inv)));
      }
    }
  });
}

// (out [T, Hd], residual_out [T, Hd]): residual_out = x + residual (x itself when residual is
// None, returned as is), out = weight * rmsnorm(residual_out).
std::vector<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                 const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1, "x must be [T, Hd] with unit stride");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == hidden && weight.is_contiguous() &&
                        weight.scalar_type() == x.scalar_type(),
                    "weight must be contiguous [Hd] of x's dtype");
  if (residual.has_value()) {
    TORCH_CHECK_VALUE(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                          residual->scalar_type() == x.scalar_type(),
                      "residual must be contiguous, of x's shape and dtype");
  }
  at::Tensor out = at::empty({rows, hidden}, x.options());
  at::Tensor res_out = residual.has_value() ? at::empty({rows, hidden}, x.options()) : x;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK_VALUE(bf16 || x.scalar_type() == at::kFloat, "dtype must be float32 or bfloat16");
  if (bf16) {
    using T = uint16_t;
    rms_norm_rows<T>(reinterpret_cast<const T*>(x.data_ptr()),
                     residual.has_value() ? reinterpret_cast<const T*>(residual->data_ptr())
                                          : nullptr,
                     reinterpret_cast<const T*>(weight.data_ptr()),
                     reinterpret_cast<T*>(out.data_ptr()),
                     residual.has_value() ? reinterpret_cast<T*>(res_out.data_ptr()) : nullptr,
                     rows, hidden, x.stride(0), static_cast<float>(eps));
  } else {
    rms_norm_rows<float>(x.data_ptr<float>(),
                         residual.has_value() ? residual->data_ptr<float>() : nullptr,
                         weight.data_ptr<float>(), out.data_ptr<float>(),
                         residual.has_value() ? res_out.data_ptr<float>() : nullptr, rows, hidden,
                         x.stride(0), static_cast<float>(eps));
  }
  return {out, res_out};
}

template <typename T>
void rotate_heads(T* x, int64_t heads, int64_t stride_h, int64_t half, const float* cos,
                  const float* sin) {
  for (int64_t h = 0; h < heads; ++h) {
    T* xh = x + h * stride_h;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = to_f(xh[i]), x2 = to_f(xh[i + half]);
      xh[i] = from_f<T>(x1 * cos[i] - x2 * sin[i]);
      xh[i + half] = from_f<T>(x2 * cos[i] + x1 * sin[i]);
    }
  }
}

// In place on q [T, H, D] and k [T, Hkv, D] (views with unit stride on D): rotate-half rotary
// with cos/sin read straight from the table row of each token's position.
void rotary(at::Tensor q, at::Tensor k, const at::Tensor& positions,
            const at::Tensor& cos_sin_cache) {
  TORCH_CHECK_VALUE(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 &&
                        q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                        q.scalar_type() == k.scalar_type(),
                    "q [T, H, D] and k [T, Hkv, D] of one dtype, unit stride on D");
  TORCH_CHECK_VALUE(positions.dim() == 1 && positions.size(0) == q.size(0) &&
                        positions.scalar_type() == at::kLong && positions.is_contiguous(),
                    "positions must be contiguous int64 [T]");
  TORCH_CHECK_VALUE(cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) == q.size(2) &&
                        cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous(),
                    "cos_sin_cache must be contiguous float32 [max_pos, D]");
  TORCH_CHECK_VALUE(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
                    "dtype must be float32 or bfloat16");
  const int64_t tokens = q.size(0), half = q.size(2) / 2, table_w = cos_sin_cache.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* table = cos_sin_cache.data_ptr<float>();
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = table + pos[t] * table_w;
      const float* sin = cos + half;
      if (bf16) {
        auto* qp = reinterpret_cast<uint16_t*>(q.data_ptr()) + t * q.stride(0);
        auto* kp = reinterpret_cast<uint16_t*>(k.data_ptr()) + t * k.stride(0);
        rotate_heads(qp, q.size(1), q.stride(1), half, cos, sin);
        rotate_heads(kp, k.size(1), k.stride(1), half, cos, sin);
      } else {
        rotate_heads(q.data_ptr<float>() + t * q.stride(0), q.size(1), q.stride(1), half, cos,
                     sin);
        rotate_heads(k.data_ptr<float>() + t * k.stride(0), k.size(1), k.stride(1), half, cos,
                     sin);
      }
    }
  });
}

// silu(gate) * up on eight lanes: silu in fp32, rounded to the model dtype before the product
// (as the torch path); exp on f32x8 (the scalar loop's exp_clamped does not vectorise).
template <typename T>
inline void silu_mul8(const T* gate, const T* up, T* o) {
  f32x8 g, u;
  for (int j = 0; j < 8; ++j) {
    g[j] = to_f(gate[j]);
    u[j] = to_f(up[j]);
  }
  f32x8 act = g / (1.0f + exp_clamped8(-g));
  for (int j = 0; j < 8; ++j) o[j] = from_f<T>(to_f(from_f<T>(act[j])) * u[j]);
}

template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t inter, int64_t x_stride) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * x_stride;
      const T* up = gate + inter;
      T* o = out + r * inter;
      int64_t i = 0;
      for (; i + 8 <= inter; i += 8) silu_mul8(gate + i, up + i, o + i);
      for (; i < inter; ++i) {  // the tail when inter is not a multiple of 8
        const float gv = to_f(gate[i]);
        const float act = to_f(from_f<T>(gv / (1.0f + exp_clamped(-gv))));
        o[i] = from_f<T>(act * to_f(up[i]));
      }
    }
  });
}

// x [T, 2I] = [gate | up] -> silu(gate) * up [T, I]
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
                    "x must be [T, 2I] with unit stride");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    silu_mul_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()),
                  reinterpret_cast<uint16_t*>(out.data_ptr()), rows, inter, x.stride(0));
  } else {
    TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat, "dtype must be float32 or bfloat16");
    silu_mul_rows(x.data_ptr<float>(), out.data_ptr<float>(), rows, inter, x.stride(0));
  }
  return out;
}

}  // namespace conveyor
