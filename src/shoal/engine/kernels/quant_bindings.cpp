// Python bindings of the packed-weight kernels (quant.h), added to the extension module by
// decode.cpp's PYBIND11_MODULE.

#include <torch/extension.h>

#include "quant.h"
#include "quant_experts.h"
#include "quant_head_copy.h"
#include "quant_head_split.h"

namespace shoal_quant {

void bind(pybind11::module& m) {
  m.def("quant_pack", &pack, "file bytes of an [n, k] weight -> the strip layout");
  m.def("quant_dequantize", &dequantize, "packed [n, k] -> float32 [n, k]");
  m.def("quant_dequantize_rows", &dequantize_rows, "rows of a packed weight as float32");
  m.def("quant_packed_bytes", &packed_bytes);
  m.def("quant_fast_kernels", &fast_kernels);
  m.def("quant_avx2_available", &avx2_available, "whether the AVX2 path is built");
  m.def("quant_default_backend", &default_backend, "amx, avx512, avx2 or portable");
  m.def("quant_copy_estimate_available", &copy_estimate_available,
        "whether the head's 3- and 4-bit copies have an int8 estimate (VNNI or AVX2)");
  m.def("quant_int8_estimate_copy", &int8_estimate_copy, "a matmul with the head's 3- or "
        "4-bit copy, estimated with int8 x", pybind11::arg("packed"), pybind11::arg("n"),
        pybind11::arg("k"), pybind11::arg("bits"), pybind11::arg("x"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("quant_split_estimate_available", &split_estimate_available,
        "whether a split Q8_0 head table has an int8 estimate (VNNI or AVX2)");
  m.def("quant_int8_estimate_split", &int8_estimate_split, "a matmul with a split Q8_0 "
        "table's high nibbles, estimated with int8 x", pybind11::arg("split"),
        pybind11::arg("n"), pybind11::arg("k"), pybind11::arg("x"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("quant_head_split_from_file", &head_split_from_file, "the file bytes of a Q8_0 [n, k] "
        "weight -> its split table", pybind11::arg("data"), pybind11::arg("n"),
        pybind11::arg("k"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("quant_head_split_rows", &head_split_rows, "rows of a split table as float32",
        pybind11::arg("split"), pybind11::arg("n"), pybind11::arg("k"), pybind11::arg("rows"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("quant_head_split_columns", &head_split_columns, "x times chosen rows of a split "
        "table, exactly", pybind11::arg("split"), pybind11::arg("n"), pybind11::arg("k"),
        pybind11::arg("x"), pybind11::arg("columns"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("quant_head_copy_pack", &head_copy_pack, "float32 [n, k] -> the head's estimate copy",
        pybind11::arg("values"), pybind11::arg("bits"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("quant_head_copy_values", &head_copy_values, "a head copy's weights as float32 [n, k]",
        pybind11::arg("packed"), pybind11::arg("n"), pybind11::arg("k"), pybind11::arg("bits"));
  pybind11::class_<QuantLinear, std::shared_ptr<QuantLinear>>(m, "QuantLinear")
      .def(pybind11::init<const std::vector<int64_t>&, const std::vector<at::Tensor>&,
                          const std::vector<int64_t>&, int64_t, const std::optional<at::Tensor>&,
                          int64_t>(),
           pybind11::arg("types"), pybind11::arg("packed"), pybind11::arg("rows"),
           pybind11::arg("k"), pybind11::arg("bias") = pybind11::none(),
           pybind11::arg("backend") = 0)
      .def("forward", &QuantLinear::forward, pybind11::arg("x"), pybind11::arg("float_out") = false,
           pybind11::arg("prompt") = false, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward_columns", &QuantLinear::forward_columns, pybind11::arg("x"),
           pybind11::arg("columns"), pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_property_readonly("in_features", &QuantLinear::in_features)
      .def_property_readonly("out_features", &QuantLinear::out_features)
      .def("nbytes", &QuantLinear::nbytes)
      .def_property_readonly("backend", &QuantLinear::backend);
  pybind11::class_<GroupedExperts, std::shared_ptr<GroupedExperts>>(m, "GroupedExperts")
      .def(pybind11::init<std::vector<std::shared_ptr<QuantLinear>>,
                          std::vector<std::shared_ptr<QuantLinear>>, bool,
                          std::optional<double>, std::optional<double>>(),
           pybind11::arg("gate_up"), pybind11::arg("down"), pybind11::arg("gelu"),
           pybind11::arg("swiglu_alpha") = pybind11::none(),
           pybind11::arg("swiglu_limit") = pybind11::none())
      .def("forward", &GroupedExperts::forward, pybind11::arg("x"), pybind11::arg("weights"),
           pybind11::arg("chosen"), pybind11::arg("prompt_from"),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_property_readonly("experts", &GroupedExperts::experts);
  pybind11::class_<RoutedFeedForward, std::shared_ptr<RoutedFeedForward>>(m, "RoutedFeedForward")
      .def(pybind11::init<at::Tensor, int64_t, bool, std::shared_ptr<GroupedExperts>,
                          std::shared_ptr<QuantLinear>, std::shared_ptr<QuantLinear>,
                          std::optional<at::Tensor>, bool>(),
           pybind11::arg("router"), pybind11::arg("top_k"), pybind11::arg("normalize"),
           pybind11::arg("experts"), pybind11::arg("shared_gate_up") = pybind11::none(),
           pybind11::arg("shared_down") = pybind11::none(),
           pybind11::arg("shared_gate") = pybind11::none(), pybind11::arg("shared_gelu") = false)
      .def("forward", &RoutedFeedForward::forward, pybind11::arg("x"),
           pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace shoal_quant
