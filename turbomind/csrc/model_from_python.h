// Builds a LlamaModel from Python (model_from_python.cc); the bindings' LlamaModel(...) constructor.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>

#include "models/llama.h"

namespace turbomind {

namespace py = pybind11;

// cfg: the config dict of turbomind/model.py; tensors: its views by name. Raises (lmd::fail) naming a
// missing or misshapen tensor or a bad config value.
std::shared_ptr<LlamaModel> model_from_python(const py::dict & cfg, const py::dict & tensors,
                                              const std::string & dtype, int64_t num_blocks, int64_t block_size,
                                              int quant_policy, py::list & owners);

}  // namespace turbomind
