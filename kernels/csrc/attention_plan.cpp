// Paged attention's work plan: which (sequence, query block, KV head, KV split) items a step
// has, and which of them write partial results to be merged (see paged_attention.cpp).

#include <algorithm>

#include "attention_tiles.h"

namespace conveyor {

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

std::vector<int32_t> costliest_first(const std::vector<Item>& items, int64_t group) {
  // cost ~ rows x keys of the QK and PV products, plus loading each key once
  std::vector<int64_t> cost(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    cost[i] = ((it.q_end - it.q_begin) * group + 4) * (it.key_end - it.key_begin);
  }
  std::vector<int32_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return cost[a] > cost[b]; });
  return order;
}

}  // namespace conveyor
