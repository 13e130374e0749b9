// A whole Llama decoder layer as one call, for a layer whose four linear layers are packed GGUF
// blocks (qlinear) on one rank: the kernels the model otherwise calls one by one from Python
// (rms_norm, qlinear, rotary_write_kv, paged_attention, silu_and_mul), in the same order on the
// same tensors, so the output is bit-equal to that sequence (the reference: LlamaModel's Python
// layer over CpuOps, services/worker/model.py). What it saves is the Python between the calls:
// a one-row decode step of the default model makes 30 layer calls instead of ~360.

#include "cpu_ops.h"

namespace conveyor {

PackedLinear::PackedLinear(at::Tensor qs_, at::Tensor d_, c10::optional<at::Tensor> m_,
                           int64_t n_, int64_t format_)
    : qs(std::move(qs_)), d(std::move(d_)), m(std::move(m_)), n(n_), format(format_) {}

LayerWeights::LayerWeights(at::Tensor input_norm_, at::Tensor post_norm_, PackedLinear qkv_,
                           PackedLinear o_proj_, PackedLinear gate_up_, PackedLinear down_)
    : input_norm(std::move(input_norm_)), post_norm(std::move(post_norm_)), qkv(std::move(qkv_)),
      o_proj(std::move(o_proj_)), gate_up(std::move(gate_up_)), down(std::move(down_)) {}

// x [T, Hd], residual [T, Hd] (None before the first layer) -> (the layer's output [T, Hd], the
// residual stream after its attention half [T, Hd]), as the model's Python layer returns them;
// K and V of the step written into the caches on the way.
std::vector<at::Tensor> decoder_layer(const LayerWeights& w, const at::Tensor& x,
                                      const c10::optional<at::Tensor>& residual, double eps,
                                      const at::Tensor& positions,
                                      const at::Tensor& cos_sin_cache, at::Tensor k_cache,
                                      at::Tensor v_cache, const at::Tensor& query_start_loc,
                                      const at::Tensor& seq_lens, const at::Tensor& block_tables,
                                      const at::Tensor& slot_mapping, double scale) {
  const int64_t tokens = x.size(0);
  std::vector<at::Tensor> h = rms_norm(x, w.input_norm, eps, residual);
  at::Tensor qkv = qlinear(h[0], w.qkv.qs, w.qkv.d, w.qkv.m, w.qkv.n, w.qkv.format);
  at::Tensor q = rotary_write_kv(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping);
  at::Tensor attn =
      paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale);
  const PackedLinear& o = w.o_proj;
  at::Tensor out = qlinear(attn.reshape({tokens, -1}), o.qs, o.d, o.m, o.n, o.format);
  std::vector<at::Tensor> h2 = rms_norm(out, w.post_norm, eps, h[1]);
  const PackedLinear& gu = w.gate_up;
  at::Tensor act = silu_and_mul(qlinear(h2[0], gu.qs, gu.d, gu.m, gu.n, gu.format));
  at::Tensor y = qlinear(act, w.down.qs, w.down.d, w.down.m, w.down.n, w.down.format);
  return {y, h2[1]};
}

}  // namespace conveyor
