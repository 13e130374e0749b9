// Conveyor's CPU kernels: paged attention read in place from the block pool, and the small fused
// ops of a Llama layer (residual-add + RMSNorm, rotary on q and k, SiLU-and-mul).
//
// Built once per machine by kernels/cpu_ext.py (torch.utils.cpp_extension, -O3 -march=native);
// each function here has a torch reference of the same name + "_ref" in kernels/ and the loader
// checks shapes before calling. Element types: float32 and bfloat16, always computed in fp32.
//
// Paged attention (one call per layer for a whole mixed step):
//   sequence b owns query rows [qsl[b], qsl[b+1]) and has seq_lens[b] keys after this step; query
//   i sits at position seq_lens[b] - q_len + i and sees keys at positions <= its own (causal).
//   Work items are (sequence, query block of kQBlock tokens, KV head, KV split). An item's rows
//   are its query tokens x the query heads of its KV head (grouped-query attention), so each K/V
//   tile is read once per group. Keys are visited one cache block at a time through the block
//   table (no gather, no padding, no mask tensor: a row's valid keys in a tile are a prefix).
//   Softmax is online in fp32. When the step has too few items to keep every thread busy (small
//   decode batches), long key ranges are split; each split writes (acc, max, sum) to scratch and
//   a second pass merges them.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kQBlock = 16;       // query tokens per work item
constexpr int64_t kMinSplitKeys = 128;  // a KV split covers at least this many keys
constexpr int64_t kItemsPerThread = 4;  // split KV until the step has this many items per thread
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

template <typename T>
inline float to_f(T v);
template <>
inline float to_f<float>(float v) { return v; }
template <>
inline float to_f<uint16_t>(uint16_t v) { return bf16_to_float(v); }

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

struct Item {
  int32_t seq;
  int32_t kv_head;
  int32_t q_begin;   // flat query rows [q_begin, q_end)
  int32_t q_end;
  int32_t pos0;      // position of query row q_begin
  int32_t key_begin;  // keys [key_begin, key_end) of this split
  int32_t key_end;
  int32_t partial;   // index of this split's scratch slot; -1 writes the output directly
};

struct Geometry {
  int64_t num_heads, num_kv_heads, head_dim, block_size, group;
  int64_t q_stride_t, q_stride_h;      // q is [T, H, D] with unit stride on D
  int64_t kv_stride_n, kv_stride_t;    // cache [N, bs, Hkv, D], contiguous
  int64_t table_stride;
  float scale;
};

// Items of the step, and the number of scratch slots (rows of kQBlock * group x D) they need.
std::vector<Item> plan_items(const int32_t* qsl, const int32_t* seq_lens, int64_t num_seqs,
                             const Geometry& g, int64_t num_threads, int64_t* num_partials) {
  int64_t base = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = qsl[b + 1] - qsl[b];
    base += (q_len + kQBlock - 1) / kQBlock * g.num_kv_heads;
  }
  const int64_t target = num_threads * kItemsPerThread;
  const int64_t want_splits = base >= target || base == 0 ? 1 : (target + base - 1) / base;
  std::vector<Item> items;
  items.reserve(static_cast<size_t>(base * want_splits));
  int32_t partials = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int32_t q_len = qsl[b + 1] - qsl[b];
    const int32_t first_pos = seq_lens[b] - q_len;
    for (int32_t q0 = 0; q0 < q_len; q0 += kQBlock) {
      const int32_t q1 = std::min<int32_t>(q_len, q0 + kQBlock);
      const int32_t num_keys = first_pos + q1;  // keys up to the block's last query
      int64_t splits = std::min<int64_t>(want_splits, num_keys / kMinSplitKeys);
      splits = std::max<int64_t>(splits, 1);
      // split boundaries on cache-block multiples, so a split reads whole blocks
      int64_t per = (num_keys + splits - 1) / splits;
      per = (per + g.block_size - 1) / g.block_size * g.block_size;
      splits = (num_keys + per - 1) / per;
      for (int32_t h = 0; h < g.num_kv_heads; ++h) {
        for (int64_t s = 0; s < splits; ++s) {
          const int32_t kb = static_cast<int32_t>(s * per);
          const int32_t ke = static_cast<int32_t>(std::min<int64_t>(num_keys, kb + per));
          const int32_t slot = splits > 1 ? partials++ : -1;
          items.push_back({static_cast<int32_t>(b), h, qsl[b] + q0, qsl[b] + q1,
                           first_pos + q0, kb, ke, slot});
        }
      }
    }
  }
  *num_partials = partials;
  return items;
}

constexpr int kTile = 16;  // keys per tile: two AVX2 / one AVX-512 vector of fp32 scores

// scores s[r][j] = q_r . k_j for R rows and one tile; kt is the tile transposed [D][kTile].
// Sizes are compile-time so the accumulators stay in registers.
template <int D, int R>
inline void qk_rows(const float* q, const float* kt, float* s) {
  float acc[R][kTile] = {};
  for (int d = 0; d < D; ++d) {
    for (int r = 0; r < R; ++r) {
      const float qd = q[r * D + d];
#pragma omp simd
      for (int j = 0; j < kTile; ++j) acc[r][j] += qd * kt[d * kTile + j];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < kTile; ++j) s[r * kTile + j] = acc[r][j];
  }
}

template <int D>
void qk_all(const float* q, const float* kt, float* s, int64_t rows) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) qk_rows<D, 4>(q + r * D, kt, s + r * kTile);
  switch (rows - r) {
    case 3: qk_rows<D, 3>(q + r * D, kt, s + r * kTile); break;
    case 2: qk_rows<D, 2>(q + r * D, kt, s + r * kTile); break;
    case 1: qk_rows<D, 1>(q + r * D, kt, s + r * kTile); break;
    default: break;
  }
}

// acc_row = acc_row * alpha + sum_j p_j v_j over one tile (p is zero past the valid keys).
template <int D>
inline void pv_row(float* acc_row, const float* p, const float* vt, float alpha) {
  float a[D];
#pragma omp simd
  for (int d = 0; d < D; ++d) a[d] = acc_row[d] * alpha;
  for (int j = 0; j < kTile; ++j) {
    const float pj = p[j];
#pragma omp simd
    for (int d = 0; d < D; ++d) a[d] += pj * vt[j * D + d];
  }
#pragma omp simd
  for (int d = 0; d < D; ++d) acc_row[d] = a[d];
}

// One work item: online softmax over its key range for rows (query token, head of the group),
// one tile of <= kTile keys (never crossing a cache block) at a time. acc [rows, D], row_max
// [rows], row_sum [rows] are the item's fp32 state.
template <typename T, int D>
void attend_item(const Item& it, const T* q, const T* k_cache, const T* v_cache,
                 const int32_t* block_table, const Geometry& g, float* acc, float* row_max,
                 float* row_sum) {
  const int64_t G = g.group, bs = g.block_size;
  const int64_t num_tokens = it.q_end - it.q_begin, rows = num_tokens * G;
  std::vector<float> qf(static_cast<size_t>(rows * D));  // rows x D, pre-scaled
  std::vector<float> s(static_cast<size_t>(rows * kTile));
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t j = 0; j < G; ++j) {
      const T* src = q + (it.q_begin + t) * g.q_stride_t + (it.kv_head * G + j) * g.q_stride_h;
      float* dst = qf.data() + (t * G + j) * D;
      for (int d = 0; d < D; ++d) dst[d] = to_f(src[d]) * g.scale;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    row_max[r] = kNegInf;
    row_sum[r] = 0.0f;
  }
  std::fill(acc, acc + rows * D, 0.0f);
  alignas(64) float kt[D * kTile];  // K tile transposed: [D, kTile]
  alignas(64) float vt[kTile * D];  // V tile: [kTile, D]
  alignas(64) float p[kTile];
  for (int64_t key0 = it.key_begin; key0 < it.key_end;) {
    const int64_t off = key0 % bs;
    const int64_t tile = std::min<int64_t>({kTile, bs - off, it.key_end - key0});
    const int64_t blk = block_table[key0 / bs];
    const T* kb = k_cache + blk * g.kv_stride_n + off * g.kv_stride_t + it.kv_head * D;
    const T* vb = v_cache + blk * g.kv_stride_n + off * g.kv_stride_t + it.kv_head * D;
    for (int64_t j = 0; j < kTile; ++j) {
      if (j < tile) {
        const T* kr = kb + j * g.kv_stride_t;
        const T* vr = vb + j * g.kv_stride_t;
        for (int d = 0; d < D; ++d) kt[d * kTile + j] = to_f(kr[d]);
        for (int d = 0; d < D; ++d) vt[j * D + d] = to_f(vr[d]);
      } else {
        for (int d = 0; d < D; ++d) kt[d * kTile + j] = 0.0f;
        for (int d = 0; d < D; ++d) vt[j * D + d] = 0.0f;
      }
    }
    // rows whose position is below key0 see nothing here; they come first (positions ascend)
    const int64_t first_row = std::max<int64_t>(0, (key0 - it.pos0) * G);
    if (first_row < rows) {
      qk_all<D>(qf.data() + first_row * D, kt, s.data() + first_row * kTile, rows - first_row);
    }
    for (int64_t r = first_row; r < rows; ++r) {
      // keys at positions <= the row's own are a prefix of the tile
      const int64_t valid = std::min<int64_t>(tile, it.pos0 + r / G - key0 + 1);
      const float* sr = s.data() + r * kTile;
      float m = row_max[r];
      for (int64_t j = 0; j < valid; ++j) m = std::max(m, sr[j]);
      const float alpha = row_max[r] == kNegInf ? 0.0f : exp_clamped(row_max[r] - m);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < kTile; ++j) {
        p[j] = j < valid ? exp_clamped(sr[j] - m) : 0.0f;
        sum += p[j];
      }
      row_max[r] = m;
      row_sum[r] = row_sum[r] * alpha + sum;
      pv_row<D>(acc + r * D, p, vt, alpha);
    }
    key0 += tile;
  }
}

template <typename T>
void write_rows(const Item& it, const float* acc, const float* row_sum, const Geometry& g,
                T* out) {
  const int64_t D = g.head_dim, G = g.group;
  const int64_t rows = (it.q_end - it.q_begin) * G;
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + ((it.q_begin + r / G) * g.num_heads + it.kv_head * G + r % G) * D;
    const float inv = row_sum[r] > 0.0f ? 1.0f / row_sum[r] : 0.0f;
    for (int64_t d = 0; d < D; ++d) dst[d] = from_f<T>(acc[r * D + d] * inv);
  }
}

template <typename T, int D>
void paged_attention_impl(const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& qsl_t,
                          const at::Tensor& seq_lens_t, const at::Tensor& tables_t,
                          const Geometry& g, at::Tensor& out) {
  const int32_t* qsl = qsl_t.data_ptr<int32_t>();
  const int32_t* seq_lens = seq_lens_t.data_ptr<int32_t>();
  const int32_t* tables = tables_t.data_ptr<int32_t>();
  const int64_t num_seqs = seq_lens_t.size(0);
  int64_t num_partials = 0;
  const std::vector<Item> items =
      plan_items(qsl, seq_lens, num_seqs, g, at::get_num_threads(), &num_partials);
  const int64_t slot_rows = kQBlock * g.group;
  std::vector<float> p_acc(static_cast<size_t>(num_partials * slot_rows * g.head_dim));
  std::vector<float> p_max(static_cast<size_t>(num_partials * slot_rows));
  std::vector<float> p_sum(static_cast<size_t>(num_partials * slot_rows));
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k_cache.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v_cache.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(slot_rows * g.head_dim));
    std::vector<float> mx(static_cast<size_t>(slot_rows)), sm(static_cast<size_t>(slot_rows));
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[static_cast<size_t>(i)];
      const int32_t* table = tables + it.seq * g.table_stride;
      if (it.partial < 0) {
        attend_item<T, D>(it, qp, kp, vp, table, g, acc.data(), mx.data(), sm.data());
        write_rows<T>(it, acc.data(), sm.data(), g, op);
      } else {
        const int64_t base = it.partial * slot_rows;
        attend_item<T, D>(it, qp, kp, vp, table, g, p_acc.data() + base * g.head_dim,
                       p_max.data() + base, p_sum.data() + base);
      }
    }
  });
  if (num_partials == 0) return;
  // merge: the splits of one (sequence, query block, KV head) are consecutive items
  std::vector<int64_t> firsts;
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].partial >= 0 && (i == 0 || items[i - 1].partial < 0 ||
                                  items[i - 1].kv_head != items[i].kv_head ||
                                  items[i - 1].q_begin != items[i].q_begin)) {
      firsts.push_back(static_cast<int64_t>(i));
    }
  }
  at::parallel_for(0, static_cast<int64_t>(firsts.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(slot_rows * D)), sm(static_cast<size_t>(slot_rows));
    for (int64_t f = begin; f < end; ++f) {
      const size_t first = static_cast<size_t>(firsts[static_cast<size_t>(f)]);
      size_t last = first + 1;
      while (last < items.size() && items[last].partial >= 0 &&
             items[last].kv_head == items[first].kv_head &&
             items[last].q_begin == items[first].q_begin) {
        ++last;
      }
      const Item& it = items[first];
      const int64_t rows = (it.q_end - it.q_begin) * g.group;
      for (int64_t r = 0; r < rows; ++r) {
        float m = kNegInf;
        for (size_t i = first; i < last; ++i) {
          m = std::max(m, p_max[static_cast<size_t>(items[i].partial * slot_rows + r)]);
        }
        float total = 0.0f;
        float* ar = acc.data() + r * D;
        std::fill(ar, ar + D, 0.0f);
        for (size_t i = first; i < last; ++i) {
          const int64_t slot = items[i].partial * slot_rows + r;
          const float mi = p_max[static_cast<size_t>(slot)];
          if (mi == kNegInf) continue;
          const float w = exp_clamped(mi - m);
          total += w * p_sum[static_cast<size_t>(slot)];
          const float* src = p_acc.data() + slot * D;
          for (int64_t d = 0; d < D; ++d) ar[d] += w * src[d];
        }
        sm[static_cast<size_t>(r)] = total;
      }
      write_rows<T>(it, acc.data(), sm.data(), g, op);
    }
  });
}

void check_same_kind(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK_VALUE(t.scalar_type() == ref.scalar_type(), name, " must have q's dtype");
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, const at::Tensor& block_tables,
                           double scale) {
  TORCH_CHECK_VALUE(q.dim() == 3 && q.stride(2) == 1, "q must be [T, H, D] with unit stride on D");
  check_same_kind(k_cache, q, "k_cache");
  check_same_kind(v_cache, q, "v_cache");
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK_VALUE(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kInt,
              "query_start_loc, seq_lens and block_tables must be int32");
  TORCH_CHECK_VALUE(query_start_loc.is_contiguous() && seq_lens.is_contiguous() &&
                  block_tables.stride(1) == 1,
              "metadata must be contiguous");
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
                    "k_cache and v_cache must be [N, bs, Hkv, D] of one shape");
  TORCH_CHECK_VALUE(k_cache.size(3) == q.size(2), "k_cache's head_dim must equal q's");
  TORCH_CHECK_VALUE(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of Hkv");
  TORCH_CHECK_VALUE(seq_lens.dim() == 1 && query_start_loc.dim() == 1 &&
                        query_start_loc.size(0) == seq_lens.size(0) + 1,
                    "query_start_loc must be [B+1] for seq_lens [B]");
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.size(0) == seq_lens.size(0),
                    "block_tables must be [B, max_blocks]");
  Geometry g{};
  g.num_heads = q.size(1);
  g.head_dim = q.size(2);
  g.block_size = k_cache.size(1);
  g.num_kv_heads = k_cache.size(2);
  g.group = g.num_heads / g.num_kv_heads;
  g.q_stride_t = q.stride(0);
  g.q_stride_h = q.stride(1);
  g.kv_stride_n = k_cache.stride(0);
  g.kv_stride_t = k_cache.stride(1);
  g.table_stride = block_tables.stride(0);
  g.scale = static_cast<float>(scale);
  at::Tensor out = at::empty({q.size(0), g.num_heads, g.head_dim}, q.options());
  const bool is_bf16 = q.scalar_type() == at::kBFloat16;
  TORCH_CHECK_VALUE(is_bf16 || q.scalar_type() == at::kFloat, "dtype must be float32 or bfloat16");
  switch (g.head_dim) {
#define CONVEYOR_HEAD_DIM_CASE(DIM)                                                          \
  case DIM:                                                                                 \
    if (is_bf16) {                                                                          \
      paged_attention_impl<uint16_t, DIM>(q, k_cache, v_cache, query_start_loc, seq_lens,  \
                                          block_tables, g, out);                            \
    } else {                                                                                \
      paged_attention_impl<float, DIM>(q, k_cache, v_cache, query_start_loc, seq_lens,     \
                                       block_tables, g, out);                               \
    }                                                                                       \
    break;
    CONVEYOR_HEAD_DIM_CASE(16)
    CONVEYOR_HEAD_DIM_CASE(32)
    CONVEYOR_HEAD_DIM_CASE(64)
    CONVEYOR_HEAD_DIM_CASE(80)
    CONVEYOR_HEAD_DIM_CASE(96)
    CONVEYOR_HEAD_DIM_CASE(128)
#undef CONVEYOR_HEAD_DIM_CASE
    default:
      TORCH_CHECK_VALUE(false, "head_dim ", g.head_dim, " unsupported (16, 32, 64, 80, 96, 128)");
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Small fused ops of a layer. Rows are independent: parallel over rows, fp32 inside.

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

template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t inter, int64_t x_stride) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * x_stride;
      const T* up = gate + inter;
      T* o = out + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float gv = to_f(gate[i]);
        // silu in fp32, rounded to the model dtype before the product (as the torch path)
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over the block pool, in place");
  m.def("rms_norm", &rms_norm, "(residual-add +) RMSNorm");
  m.def("rotary", &rotary, "rotary embedding of q and k, in place");
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up");
}
