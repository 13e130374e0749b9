// The KV write on the CPU: each token's key and value rows into their slot of the paged cache
// (block slot / bs, offset slot % bs), K and V in one call; and the same write fused with rotary
// on the fused qkv projection of a layer, so a layer makes one call for both. Torch references:
// kernels.write_kv.write_kv_ref (+ kernels.rotary.rotary_ref); launchers: kernels/cpu_ext.py.
// Float caches only (float32, bfloat16, float16 storage; rounding to nearest even as torch's
// .to()); 8-bit caches keep the torch write (their scale per row: kernels/kv_quant.py).

#include <c10/util/Half.h>

#include "cpu_ops.h"

namespace conveyor {

namespace {

template <typename C>
inline C store_f(float v);
template <>
inline float store_f<float>(float v) { return v; }
template <>
inline uint16_t store_f<uint16_t>(float v) { return float_to_bf16(v); }
template <>
inline Half store_f<Half>(float v) { return Half{c10::Half(v).x}; }

// One token: `heads` rows of head_dim from src (row stride src_h) into dst (contiguous heads).
template <typename T, typename C>
inline void copy_heads(const T* src, int64_t src_h, C* dst, int64_t heads, int64_t head_dim) {
  if constexpr (std::is_same_v<T, C>) {
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(dst + h * head_dim, src + h * src_h, sizeof(T) * head_dim);
    }
  } else {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t d = 0; d < head_dim; ++d) {
        dst[h * head_dim + d] = store_f<C>(to_f(src[h * src_h + d]));
      }
    }
  }
}

struct KVRows {  // where one step's keys and values come from (element strides)
  const void* key;
  const void* value;
  int64_t stride_kt, stride_kh, stride_vt, stride_vh;
};

template <typename T, typename C>
void write_rows(const KVRows& src, at::Tensor& k_cache, at::Tensor& v_cache, const int64_t* slots,
                int64_t tokens) {
  const int64_t heads = k_cache.size(2), head_dim = k_cache.size(3);
  const int64_t slot_elems = heads * head_dim;  // a slot's rows are contiguous in the cache
  C* kc = reinterpret_cast<C*>(k_cache.data_ptr());
  C* vc = reinterpret_cast<C*>(v_cache.data_ptr());
  const T* key = static_cast<const T*>(src.key);
  const T* value = static_cast<const T*>(src.value);
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      copy_heads(key + t * src.stride_kt, src.stride_kh, kc + slots[t] * slot_elems, heads,
                 head_dim);
      copy_heads(value + t * src.stride_vt, src.stride_vh, vc + slots[t] * slot_elems, heads,
                 head_dim);
    }
  });
}

template <typename T>
void write_any(const KVRows& src, at::Tensor& k_cache, at::Tensor& v_cache, const int64_t* slots,
               int64_t tokens) {
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      return write_rows<T, float>(src, k_cache, v_cache, slots, tokens);
    case at::kBFloat16:
      return write_rows<T, uint16_t>(src, k_cache, v_cache, slots, tokens);
    default:  // kHalf (checked by check_caches)
      return write_rows<T, Half>(src, k_cache, v_cache, slots, tokens);
  }
}

void check_caches(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t heads,
                  int64_t head_dim) {
  const auto s = k_cache.scalar_type();
  TORCH_CHECK_VALUE(s == at::kFloat || s == at::kBFloat16 || s == at::kHalf,
                    "the C++ KV write takes float32, bfloat16 or float16 caches");
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                        v_cache.scalar_type() == s && k_cache.is_contiguous() &&
                        v_cache.is_contiguous(),
                    "k_cache and v_cache must be contiguous [N, bs, Hkv, D] of one dtype");
  TORCH_CHECK_VALUE(k_cache.size(2) == heads && k_cache.size(3) == head_dim,
                    "the cache's [Hkv, D] must match the keys' (", heads, ", ", head_dim, ")");
}

// Every slot inside the cache, checked before anything is written (the reference raises too).
const int64_t* checked_slots(const at::Tensor& slot_mapping, int64_t tokens,
                             const at::Tensor& k_cache) {
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens &&
                        slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
                    "slot_mapping must be contiguous int64 [T]");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK_VALUE(slots[t] >= 0 && slots[t] < num_slots, "slot_mapping holds a slot outside [0, ",
                      num_slots, ")");
  }
  return slots;
}

bool is_bf16(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                    "keys and values must be float32 or bfloat16");
  return x.scalar_type() == at::kBFloat16;
}

}  // namespace

// key, value [T, Hkv, D] (unit stride on D) -> their slots of k_cache, v_cache [N, bs, Hkv, D].
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache,
              at::Tensor v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK_VALUE(key.dim() == 3 && key.sizes() == value.sizes() && key.stride(2) == 1 &&
                        value.stride(2) == 1 && key.scalar_type() == value.scalar_type(),
                    "key and value must be [T, Hkv, D] of one dtype with unit stride on D");
  check_caches(k_cache, v_cache, key.size(1), key.size(2));
  const int64_t tokens = key.size(0);
  const int64_t* slots = checked_slots(slot_mapping, tokens, k_cache);
  const KVRows src{key.data_ptr(), value.data_ptr(), key.stride(0), key.stride(1), value.stride(0),
                   value.stride(1)};
  if (is_bf16(key)) {
    write_any<uint16_t>(src, k_cache, v_cache, slots, tokens);
  } else {
    write_any<float>(src, k_cache, v_cache, slots, tokens);
  }
}

// qkv [T, (H + 2 Hkv) D] (a layer's fused projection, unit stride on its rows): rotary on its q
// and k heads in place (as rotary()), then its k and v rows written into their slots (as
// write_kv()). Hkv and D come from the cache, H from the width. Returns q, a view [T, H, D].
at::Tensor rotary_write_kv(at::Tensor qkv, const at::Tensor& positions,
                           const at::Tensor& cos_sin_cache, at::Tensor k_cache,
                           at::Tensor v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK_VALUE(qkv.dim() == 2 && qkv.stride(1) == 1 && k_cache.dim() == 4,
                    "qkv must be [T, (H + 2 Hkv) D] with unit stride, the caches 4-D");
  const int64_t tokens = qkv.size(0), kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
  const int64_t width = qkv.size(1), kv_width = kv_heads * head_dim;
  TORCH_CHECK_VALUE(width % head_dim == 0 && width > 2 * kv_width,
                    "qkv's width must be (H + 2 Hkv) * D for the cache's Hkv and D");
  const int64_t q_width = width - 2 * kv_width;
  at::Tensor q = qkv.narrow(1, 0, q_width).view({tokens, q_width / head_dim, head_dim});
  at::Tensor k = qkv.narrow(1, q_width, kv_width).view({tokens, kv_heads, head_dim});
  at::Tensor v = qkv.narrow(1, q_width + kv_width, kv_width).view({tokens, kv_heads, head_dim});
  check_caches(k_cache, v_cache, kv_heads, head_dim);
  checked_slots(slot_mapping, tokens, k_cache);  // before rotating: a bad slot changes nothing
  rotary(q, k, positions, cos_sin_cache);
  write_kv(k, v, k_cache, v_cache, slot_mapping);
  return q;
}

}  // namespace conveyor
