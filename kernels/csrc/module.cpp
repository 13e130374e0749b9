// The Python module of Conveyor's CPU kernels: binds the entry points declared in cpu_ops.h
// (the only file here that includes torch/extension.h, which is slow to compile).

#include <torch/extension.h>

#include "cpu_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &conveyor::paged_attention,
        "paged attention over the block pool, in place");
  m.def("rms_norm", &conveyor::rms_norm, "(residual-add +) RMSNorm");
  m.def("rotary", &conveyor::rotary, "rotary embedding of q and k, in place");
  m.def("silu_and_mul", &conveyor::silu_and_mul, "SiLU(gate) * up");
  m.def("write_kv", &conveyor::write_kv, "K and V rows into their slots of the paged cache");
  m.def("rotary_write_kv", &conveyor::rotary_write_kv,
        "rotary on a fused qkv in place, then its K and V into the cache; returns q");
  m.def("qlinear", &conveyor::qlinear, "x @ dequant(W)^T for packed GGUF block weights");
  pybind11::class_<conveyor::PackedLinear>(m, "PackedLinear")
      .def(pybind11::init<at::Tensor, at::Tensor, c10::optional<at::Tensor>, int64_t, int64_t>());
  pybind11::class_<conveyor::LayerWeights>(m, "LayerWeights")
      .def(pybind11::init<at::Tensor, at::Tensor, conveyor::PackedLinear, conveyor::PackedLinear,
                          conveyor::PackedLinear, conveyor::PackedLinear>());
  m.def("decoder_layer", &conveyor::decoder_layer,
        "a decoder layer of packed block weights: (output, residual)");
  m.def("qlinear_tile", &conveyor::qlinear_tile, "output columns per packed tile");
}
