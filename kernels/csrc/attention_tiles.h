// Paged attention's work plan and tile kernels, shared by attention_plan.cpp and
// paged_attention.cpp (semantics and design: the head of paged_attention.cpp).
//
// The tile kernels are plain loops over compile-time sizes, register-blocked so that -O3
// -march=native vectorises them with whatever the CPU has (8-wide AVX2 on an AMD EPYC, 16-wide
// AVX-512 on an Intel Xeon); nothing assumes one instruction set.
#pragma once

#include "cpu_ops.h"

namespace conveyor {

constexpr int64_t kQBlock = 16;         // query tokens per work item
constexpr int64_t kMinSplitKeys = 128;  // a KV split covers at least this many keys
constexpr int64_t kItemsPerThread = 4;  // split KV until the step has this many items per thread
constexpr int kKeyTile = 64;            // keys per tile (gathered across cache blocks)
constexpr int kVec = 16;                // keys (QK) or head dims (PV) per register block
constexpr int kRowBlock = 4;            // query rows per register block

struct Item {
  int32_t seq;
  int32_t kv_head;
  int32_t q_begin;    // flat query rows [q_begin, q_end)
  int32_t q_end;
  int32_t pos0;       // position of query row q_begin
  int32_t key_begin;  // keys [key_begin, key_end) of this split
  int32_t key_end;
  int32_t partial;    // index of this split's scratch slot; -1 writes the output directly
};

struct Geometry {
  int64_t num_heads, num_kv_heads, head_dim, block_size, group;
  int64_t q_stride_t, q_stride_h;    // q is [T, H, D] with unit stride on D
  int64_t kv_stride_n, kv_stride_t;  // cache [N, bs, Hkv, row], contiguous
  int64_t kv_stride_h;               // row: D elements, or D codes + a 4-byte scale
  int64_t table_stride;
  float scale;
};

// Items of the step, and the number of scratch slots (rows of kQBlock * group x D) they need.
std::vector<Item> plan_items(const int32_t* qsl, const int32_t* seq_lens, int64_t num_seqs,
                             const Geometry& g, int64_t num_threads, int64_t* num_partials);

// The order in which threads take items: most expensive first (causal prefill blocks differ
// up to q_len-fold in cost), so a dynamic queue ends with cheap items and threads finish together.
std::vector<int32_t> costliest_first(const std::vector<Item>& items, int64_t group);

// Per-thread buffers of attend_item, sized once for the largest item (kQBlock * group rows).
struct Scratch {
  std::vector<float> qf;     // [rows, D] queries in fp32, pre-scaled
  std::vector<float> s;      // [rows, kKeyTile] scores, then probabilities
  std::vector<float> alpha;  // [rows] rescale of the running accumulators for this tile
  Scratch(int64_t rows, int64_t head_dim)
      : qf(static_cast<size_t>(rows * head_dim)),
        s(static_cast<size_t>(rows * kKeyTile)),
        alpha(static_cast<size_t>(rows)) {}
};

// s[r][c*kVec + j] = q_r . k_j for R rows and `chunks` chunks of kVec keys; kt is the key tile
// transposed, [D][kKeyTile]. The R x kVec accumulators stay in registers.
template <int D, int R>
inline void qk_rows(const float* q, const float* kt, float* s, int chunks) {
  for (int c = 0; c < chunks; ++c) {
    float acc[R][kVec] = {};
    for (int d = 0; d < D; ++d) {
      const float* k = kt + d * kKeyTile + c * kVec;
      for (int r = 0; r < R; ++r) {
        const float qd = q[r * D + d];
#pragma omp simd
        for (int j = 0; j < kVec; ++j) acc[r][j] += qd * k[j];
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < kVec; ++j) s[r * kKeyTile + c * kVec + j] = acc[r][j];
    }
  }
}

// acc[r] = acc[r] * alpha[r] + sum_j p[r][j] v_j for R rows over `keys` keys of the tile
// (vt [kKeyTile][D]); kVec head dims of R rows at a time stay in registers.
template <int D, int R>
inline void pv_rows(float* acc, const float* p, const float* vt, const float* alpha, int keys) {
  for (int d0 = 0; d0 < D; d0 += kVec) {
    float a[R][kVec];
    for (int r = 0; r < R; ++r) {
#pragma omp simd
      for (int i = 0; i < kVec; ++i) a[r][i] = acc[r * D + d0 + i] * alpha[r];
    }
    for (int j = 0; j < keys; ++j) {
      const float* v = vt + j * D + d0;
      for (int r = 0; r < R; ++r) {
        const float pj = p[r * kKeyTile + j];
#pragma omp simd
        for (int i = 0; i < kVec; ++i) a[r][i] += pj * v[i];
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < kVec; ++i) acc[r * D + d0 + i] = a[r][i];
    }
  }
}

// Both products over `rows` rows: blocks of kRowBlock, then the remainder.
template <int D>
void qk_all(const float* q, const float* kt, float* s, int64_t rows, int chunks) {
  int64_t r = 0;
  for (; r + kRowBlock <= rows; r += kRowBlock) {
    qk_rows<D, kRowBlock>(q + r * D, kt, s + r * kKeyTile, chunks);
  }
  for (; r < rows; ++r) qk_rows<D, 1>(q + r * D, kt, s + r * kKeyTile, chunks);
}

template <int D>
void pv_all(float* acc, const float* p, const float* vt, const float* alpha, int64_t rows,
            int keys) {
  int64_t r = 0;
  for (; r + kRowBlock <= rows; r += kRowBlock) {
    pv_rows<D, kRowBlock>(acc + r * D, p + r * kKeyTile, vt, alpha + r, keys);
  }
  for (; r < rows; ++r) pv_rows<D, 1>(acc + r * D, p + r * kKeyTile, vt, alpha + r, keys);
}

// Keys [key0, key0 + keys) of one KV head, read through the block table and converted to fp32
// from the cache's storage type KV (float, bf16 or fp16: a compact cache halves these bytes;
// int8 or fp8 codes times the scale stored after each row's codes: a quarter):
// kt [D][kKeyTile] transposed (for QK), vt [kKeyTile][D] (for PV); key columns of kt past
// `keys` up to the next multiple of kVec are zero, so QK reads only finite numbers.
template <typename KV, int D>
void load_tile(const KV* k_cache, const KV* v_cache, const int32_t* block_table, const Geometry& g,
               int64_t kv_head, int64_t key0, int keys, float* kt, float* vt) {
  for (int j = 0; j < keys; ++j) {
    const int64_t pos = key0 + j;
    const int64_t at = block_table[pos / g.block_size] * g.kv_stride_n +
                       (pos % g.block_size) * g.kv_stride_t + kv_head * g.kv_stride_h;
    const KV* kr = k_cache + at;
    const KV* vr = v_cache + at;
    const float ks = row_scale(kr, D), vs = row_scale(vr, D);
    for (int d = 0; d < D; ++d) kt[d * kKeyTile + j] = to_f(kr[d]) * ks;
#pragma omp simd
    for (int d = 0; d < D; ++d) vt[j * D + d] = to_f(vr[d]) * vs;
  }
  const int padded = (keys + kVec - 1) / kVec * kVec;
  for (int d = 0; d < D; ++d) {
    for (int j = keys; j < padded; ++j) kt[d * kKeyTile + j] = 0.0f;
  }
}

// Online-softmax update of rows [first_row, rows) for one tile of `keys` keys: scores in s
// become probabilities (zero past each row's causal limit), alpha[r] the rescale of the row's
// accumulator, row_max/row_sum updated. Row r (query position pos0 + r / G) sees the tile's
// first min(keys, pos0 + r / G - key0 + 1) keys; rows from first_row on see at least one.
inline void softmax_tile(float* s, float* alpha, float* row_max, float* row_sum,
                         int64_t first_row, int64_t rows, int64_t group, int64_t pos0,
                         int64_t key0, int keys) {
  const int padded = (keys + kVec - 1) / kVec * kVec;
  for (int64_t r = first_row; r < rows; ++r) {
    const int valid = static_cast<int>(std::min<int64_t>(keys, pos0 + r / group - key0 + 1));
    float* sr = s + r * kKeyTile;
    float m = row_max[r];
#pragma omp simd reduction(max : m)
    for (int j = 0; j < valid; ++j) m = std::max(m, sr[j]);
    alpha[r] = row_max[r] == kNegInf ? 0.0f : exp_clamped(row_max[r] - m);
    f32x8 sum8 = {};
    for (int j = 0; j < padded; j += 8) {  // padded is a multiple of kVec (16)
      f32x8 x;
      std::memcpy(&x, sr + j, sizeof(x));
      const i32x8 lane = i32x8{0, 1, 2, 3, 4, 5, 6, 7} + j;
      const f32x8 zero = {};
      const f32x8 p = lane < valid ? exp_clamped8(x - m) : zero;
      std::memcpy(sr + j, &p, sizeof(p));
      sum8 += p;
    }
    float sum = 0.0f;
    for (int i = 0; i < 8; ++i) sum += sum8[i];
    row_max[r] = m;
    row_sum[r] = row_sum[r] * alpha[r] + sum;
  }
}

// One work item: online softmax over its key range for rows (query token, head of the group),
// kKeyTile keys at a time. acc [rows, D], row_max [rows], row_sum [rows] are the item's fp32
// state; the tile buffers are on the stack, the rest in the thread's scratch.
template <typename T, typename KV, int D>
void attend_item(const Item& it, const T* q, const KV* k_cache, const KV* v_cache,
                 const int32_t* block_table, const Geometry& g, Scratch& sc, float* acc,
                 float* row_max, float* row_sum) {
  const int64_t G = g.group;
  const int64_t num_tokens = it.q_end - it.q_begin, rows = num_tokens * G;
  float* qf = sc.qf.data();
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t j = 0; j < G; ++j) {
      const T* src = q + (it.q_begin + t) * g.q_stride_t + (it.kv_head * G + j) * g.q_stride_h;
      float* dst = qf + (t * G + j) * D;
      for (int d = 0; d < D; ++d) dst[d] = to_f(src[d]) * g.scale;
    }
  }
  std::fill(row_max, row_max + rows, kNegInf);
  std::fill(row_sum, row_sum + rows, 0.0f);
  std::fill(acc, acc + rows * D, 0.0f);
  alignas(64) float kt[D * kKeyTile];  // K tile transposed: [D, kKeyTile]
  alignas(64) float vt[kKeyTile * D];  // V tile: [kKeyTile, D]
  for (int64_t key0 = it.key_begin; key0 < it.key_end; key0 += kKeyTile) {
    const int keys = static_cast<int>(std::min<int64_t>(kKeyTile, it.key_end - key0));
    load_tile<KV, D>(k_cache, v_cache, block_table, g, it.kv_head, key0, keys, kt, vt);
    // rows whose position is below key0 see nothing here; they come first (positions ascend)
    const int64_t first_row = std::max<int64_t>(0, (key0 - it.pos0) * G);
    const int64_t live = rows - first_row;  // >= 1: key0 < the item's last position + 1
    qk_all<D>(qf + first_row * D, kt, sc.s.data() + first_row * kKeyTile, live,
              (keys + kVec - 1) / kVec);
    softmax_tile(sc.s.data(), sc.alpha.data(), row_max, row_sum, first_row, rows, G, it.pos0,
                 key0, keys);
    pv_all<D>(acc + first_row * D, sc.s.data() + first_row * kKeyTile, vt,
              sc.alpha.data() + first_row, live, keys);
  }
}

}  // namespace conveyor
