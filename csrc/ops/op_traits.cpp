#include "ops/op_traits.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <string_view>

#include "ops/routing.h"

namespace sac {
namespace {

// Ops that carry no activation and may run a different number of times in the forward and the
// recompute (Python's metadata fast paths skip the dispatcher); torch's SAC ignores the same ops.
constexpr std::array<std::string_view, 15> kNeverCountedOps = {
    "aten::detach",
    "prim::device",
    "prim::layout",
    "aten::is_contiguous",
    "aten::is_strides_like_format",
    "aten::is_non_overlapping_and_dense",
    "aten::size",
    "aten::sym_size",
    "aten::stride",
    "aten::sym_stride",
    "aten::storage_offset",
    "aten::sym_storage_offset",
    "aten::numel",
    "aten::sym_numel",
    "aten::dim",
};

// profiler::_record_function_* run only where a profiler is active; sac:: are our own ops.
constexpr std::array<std::string_view, 2> kNeverCountedNamespaces = {"profiler", "sac"};

constexpr std::array<std::string_view, 3> kCollectiveNamespaces = {"c10d", "_c10d_functional",
                                                                   "_c10d_functional_autograd"};

// Allocations whose contents are garbage until written (OpTraits::is_uninitialised_allocation).
constexpr std::array<std::string_view, 5> kUninitialisedAllocations = {
    "aten::empty", "aten::empty_like", "aten::new_empty", "aten::empty_strided", "aten::new_empty_strided"};

const UnannotatedWrite* findUnannotatedWrite(std::string_view base_name) {
  for (const UnannotatedWrite& entry : unannotatedWrites()) {
    if (entry.op == base_name) return &entry;
  }
  return nullptr;
}

template <size_t N>
bool contains(const std::array<std::string_view, N>& values, std::string_view value) {
  for (std::string_view v : values) {
    if (v == value) return true;
  }
  return false;
}

}  // namespace

// NOTE: [Writes no schema declares] (op_traits.h)
const std::vector<UnannotatedWrite>& unannotatedWrites() {
  static const std::vector<UnannotatedWrite> table = {
      {"c10d::allreduce_", {"tensors"}},
      {"c10d::allreduce_coalesced_", {"tensors"}},
      {"c10d::broadcast_", {"tensors"}},
      {"c10d::reduce_", {"tensors"}},
      {"c10d::recv_", {"tensors"}},
      {"c10d::recv_any_source_", {"tensors"}},
      {"c10d::allgather_", {"output_tensors"}},
      {"c10d::allgather_coalesced_", {"output_lists"}},
      {"c10d::allgather_into_tensor_coalesced_", {"outputs"}},
      {"c10d::_allgather_base_", {"output_tensor"}},
      {"c10d::gather_", {"output_tensors"}},
      {"c10d::gather_into_tensor_", {"output_tensor"}},
      {"c10d::scatter_", {"output_tensors"}},
      {"c10d::reduce_scatter_", {"output_tensors"}},
      {"c10d::reduce_scatter_tensor_coalesced_", {"outputs"}},
      {"c10d::_reduce_scatter_base_", {"output_tensor"}},
      {"c10d::alltoall_", {"output_tensors"}},
      {"c10d::alltoall_base_", {"output"}},
      {"inductor::accumulate_grad_", {"variable"}},
      {"inductor::resize_storage_bytes_", {"variable"}},
      // Batch norm in training updates its running statistics in place, unmarked in these schemas
      // (_native_batch_norm_legit and _batch_norm_with_update mark them).
      {"aten::native_batch_norm", {"running_mean", "running_var"}},
      {"aten::cudnn_batch_norm", {"running_mean", "running_var"}},
      {"aten::miopen_batch_norm", {"running_mean", "running_var"}},
      // Read only: a send, barriers whose tensor only names the device, a NaN check.
      {"c10d::send", {}},
      {"c10d::barrier", {}},
      {"c10d::monitored_barrier_", {}},
      {"c10d::check_for_nan", {}},
  };
  return table;
}

bool namedAsWritingWithoutMarks(const c10::OperatorHandle& op) {
  const c10::FunctionSchema& schema = op.schema();
  for (const c10::Argument& arg : schema.arguments()) {
    if (arg.alias_info() != nullptr && arg.alias_info()->isWrite()) return false;
  }
  const std::string& name = schema.name();
  const bool trailing_underscore = name.size() > 1 && name.back() == '_' && name[name.size() - 2] != '_';
  return name.rfind("c10d::", 0) == 0 || trailing_underscore;
}

std::string qualifiedOpName(const std::string& name, const std::string& overload) {
  return overload.empty() ? name : name + "." + overload;
}

OpTraits classifyOp(const c10::OperatorHandle& op) {
  const c10::FunctionSchema& schema = op.schema();
  OpTraits traits;
  traits.base_name = schema.name();
  traits.qualified_name = qualifiedOpName(schema.name(), schema.overload_name());
  traits.ns = traits.base_name.substr(0, traits.base_name.find("::"));
  traits.is_collective = contains(kCollectiveNamespaces, traits.ns);
  traits.is_random = op.hasTag(at::Tag::nondeterministic_seeded);
  traits.reads_values_on_host = op.hasTag(at::Tag::data_dependent_output) || op.hasTag(at::Tag::dynamic_output_shape);
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const c10::Argument& arg = schema.arguments()[i];
    if (traits.is_random && arg.name() == "dropout_p" && arg.type()->kind() == c10::TypeKind::FloatType) {
      traits.dropout_p_argument = static_cast<int>(i);
    }
  }
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const c10::Argument& arg = schema.arguments()[i];
    const c10::AliasInfo* alias = arg.alias_info();
    if (alias == nullptr || !alias->isWrite()) continue;
    traits.written_arguments.push_back(static_cast<uint32_t>(i));
    traits.written_argument_names.push_back(arg.name());
    if (arg.is_out()) {
      traits.writes_out_arguments = true;
    } else {
      traits.mutates_inputs = true;
    }
  }
  if (traits.written_arguments.empty()) {
    if (const UnannotatedWrite* unmarked = findUnannotatedWrite(traits.base_name)) {
      for (size_t i = 0; i < schema.arguments().size(); ++i) {
        for (std::string_view written : unmarked->written) {
          if (schema.arguments()[i].name() != written) continue;
          traits.written_arguments.push_back(static_cast<uint32_t>(i));
          traits.written_argument_names.push_back(schema.arguments()[i].name());
        }
      }
      traits.mutates_inputs = !traits.written_arguments.empty();
    }
  }
  if (!traits.mutates_inputs && !traits.writes_out_arguments) {
    for (const c10::Argument& ret : schema.returns()) {
      if (ret.alias_info() != nullptr) traits.is_view = true;
    }
  }
  traits.never_counts = contains(kNeverCountedOps, traits.base_name) || contains(kNeverCountedNamespaces, traits.ns);
  traits.is_uninitialised_allocation = contains(kUninitialisedAllocations, traits.base_name);
  traits.is_copy_cast = traits.base_name == "aten::_to_copy";
  traits.is_routing = isRoutingOp(traits.base_name);
  traits.is_lift_fresh = traits.base_name == "aten::lift_fresh";
  traits.only_wraps = traits.base_name == "_c10d_functional::_wrap_tensor_autograd";
  return traits;
}

std::vector<std::string> neverCountedOpNames() { return {kNeverCountedOps.begin(), kNeverCountedOps.end()}; }

// NOTE: [A call's facts are decided here] (op_traits.h)
bool drawsRandomNumbers(const OpTraits& traits, std::optional<double> dropout_p) {
  if (!traits.is_random) return false;
  if (!randomOnlyPerCall(traits)) return true;
  return !dropout_p.has_value() || *dropout_p != 0.0;
}

bool drawsRandomNumbers(const OpTraits& traits, const c10::IValue* arguments) {
  if (!randomOnlyPerCall(traits)) return drawsRandomNumbers(traits, std::nullopt);
  const c10::IValue& dropout_p = arguments[traits.dropout_p_argument];
  return drawsRandomNumbers(traits, dropout_p.isDouble() ? std::optional<double>(dropout_p.toDouble()) : std::nullopt);
}

bool castsAParameter(const OpTraits& traits, bool source_requires_grad, bool source_is_leaf) {
  return traits.is_copy_cast && source_requires_grad && source_is_leaf;
}

bool castsAParameter(const OpTraits& traits, const c10::IValue* arguments) {
  if (!traits.is_copy_cast || !arguments[0].isTensor()) return castsAParameter(traits, false, false);
  const at::Tensor& source = arguments[0].toTensor();
  return castsAParameter(traits, source.defined() && source.requires_grad(), source.defined() && source.is_leaf());
}

}  // namespace sac
