// Paged attention on the CPU, reading K/V in place from the block pool. Torch reference:
// kernels.paged_attention.paged_attention_ref; launcher and shape checks: kernels/cpu_ext.py
// and paged_attention() below.
//
// Paged attention (one call per layer for a whole mixed step):
//   sequence b owns query rows [qsl[b], qsl[b+1]) and has seq_lens[b] keys after this step; query
//   i sits at position seq_lens[b] - q_len + i and sees keys at positions <= its own (causal).
//   Work items are (sequence, query block of kQBlock tokens, KV head, KV split). An item's rows
//   are its query tokens x the query heads of its KV head (grouped-query attention), so each K/V
//   tile is read once per query block and group. Keys are visited kKeyTile at a time, gathered
//   through the block table into an fp32 tile (K transposed) once per item: no gathered copy of
//   the context, no padding, no mask tensor (a row's valid keys in a tile are a prefix). QK and
//   PV are register-blocked (kRowBlock rows x kVec keys or head dims), softmax is online in fp32.
//   Threads take items costliest first from a shared counter. When the step has too few items to
//   keep every thread busy (small decode batches), long key ranges are split; each split writes
//   (acc, max, sum) to scratch and a second pass merges them.

#include <atomic>

#include "attention_tiles.h"

namespace conveyor {

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

template <typename T, typename KV, int D>
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
  const KV* kp = reinterpret_cast<const KV*>(k_cache.data_ptr());
  const KV* vp = reinterpret_cast<const KV*>(v_cache.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  // Threads take items from a shared counter, costliest first (a static split of a causal
  // prefill would give one thread the short early query blocks and the other the long late ones).
  const std::vector<int32_t> order = costliest_first(items, g.group);
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch sc(slot_rows, D);
    std::vector<float> acc(static_cast<size_t>(slot_rows * D));
    std::vector<float> mx(static_cast<size_t>(slot_rows)), sm(static_cast<size_t>(slot_rows));
    for (int64_t n = next.fetch_add(1); n < num_items; n = next.fetch_add(1)) {
      const Item& it = items[static_cast<size_t>(order[static_cast<size_t>(n)])];
      const int32_t* table = tables + it.seq * g.table_stride;
      if (it.partial < 0) {
        attend_item<T, KV, D>(it, qp, kp, vp, table, g, sc, acc.data(), mx.data(), sm.data());
        write_rows<T>(it, acc.data(), sm.data(), g, op);
      } else {
        const int64_t base = it.partial * slot_rows;
        attend_item<T, KV, D>(it, qp, kp, vp, table, g, sc, p_acc.data() + base * D,
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

namespace {

void check_cache(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be on the CPU");
  const auto s = t.scalar_type();
  TORCH_CHECK_VALUE(s == at::kFloat || s == at::kBFloat16 || s == at::kHalf || s == at::kChar ||
                        s == at::kByte,
                    name, " must be float32, bfloat16, float16, int8 or uint8 (fp8 e4m3 codes)");
}

template <int D, typename T>
void dispatch_cache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& qsl, const at::Tensor& seq_lens, const at::Tensor& tables,
                    const Geometry& g, at::Tensor& out) {
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      paged_attention_impl<T, float, D>(q, k_cache, v_cache, qsl, seq_lens, tables, g, out);
      break;
    case at::kBFloat16:
      paged_attention_impl<T, uint16_t, D>(q, k_cache, v_cache, qsl, seq_lens, tables, g, out);
      break;
    case at::kHalf:
      paged_attention_impl<T, Half, D>(q, k_cache, v_cache, qsl, seq_lens, tables, g, out);
      break;
    case at::kChar:
      paged_attention_impl<T, Int8Code, D>(q, k_cache, v_cache, qsl, seq_lens, tables, g, out);
      break;
    default:  // uint8: fp8 e4m3 codes (check_cache allows nothing else)
      paged_attention_impl<T, Fp8Code, D>(q, k_cache, v_cache, qsl, seq_lens, tables, g, out);
  }
}

// One head size: q's dtype (float / bf16) x the cache's storage.
template <int D>
void dispatch_dtypes(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& qsl, const at::Tensor& seq_lens, const at::Tensor& tables,
                     const Geometry& g, at::Tensor& out) {
  if (q.scalar_type() == at::kBFloat16) {
    dispatch_cache<D, uint16_t>(q, k_cache, v_cache, qsl, seq_lens, tables, g, out);
  } else {
    dispatch_cache<D, float>(q, k_cache, v_cache, qsl, seq_lens, tables, g, out);
  }
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, const at::Tensor& block_tables,
                           double scale) {
  TORCH_CHECK_VALUE(q.dim() == 3 && q.stride(2) == 1, "q must be [T, H, D] with unit stride on D");
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK_VALUE(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache differ");
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK_VALUE(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kInt,
              "query_start_loc, seq_lens and block_tables must be int32");
  TORCH_CHECK_VALUE(query_start_loc.is_contiguous() && seq_lens.is_contiguous() &&
                  block_tables.stride(1) == 1,
              "metadata must be contiguous");
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
                    "k_cache and v_cache must be [N, bs, Hkv, D] of one shape");
  const bool scaled = k_cache.scalar_type() == at::kChar || k_cache.scalar_type() == at::kByte;
  TORCH_CHECK_VALUE(k_cache.size(3) == q.size(2) + (scaled ? kRowScaleBytes : 0),
                    "k_cache's rows must be q's head_dim (+ 4 scale bytes for 8-bit codes)");
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
  g.kv_stride_h = k_cache.stride(2);
  g.table_stride = block_tables.stride(0);
  g.scale = static_cast<float>(scale);
  at::Tensor out = at::empty({q.size(0), g.num_heads, g.head_dim}, q.options());
  const bool is_bf16 = q.scalar_type() == at::kBFloat16;
  TORCH_CHECK_VALUE(is_bf16 || q.scalar_type() == at::kFloat, "dtype must be float32 or bfloat16");
  switch (g.head_dim) {
#define CONVEYOR_HEAD_DIM_CASE(DIM)                                                  \
  case DIM:                                                                         \
    dispatch_dtypes<DIM>(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, g, out); \
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

}  // namespace conveyor
