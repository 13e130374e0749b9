// Paged attention's work plan and tile kernels, shared by attention_plan.cpp and
// paged_attention.cpp (semantics and design: the head of paged_attention.cpp).
#pragma once

#include "cpu_ops.h"

namespace conveyor {

constexpr int64_t kQBlock = 16;       // query tokens per work item
constexpr int64_t kMinSplitKeys = 128;  // a KV split covers at least this many keys
constexpr int64_t kItemsPerThread = 4;  // split KV until the step has this many items per thread

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
                             const Geometry& g, int64_t num_threads, int64_t* num_partials);

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

}  // namespace conveyor
