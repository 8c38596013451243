// The dispatch-mode engine's C++ half (python/sac_plugin/dispatch_mode.py): a Python
// TorchDispatchMode sees every call of a checkpointed region and hands it here, where it is
// named, decided, kept and served by the very code the native fallback uses (DataFlow, Policy,
// Region). Python holds only what C++ cannot: the non-tensor values a kept call returned.
//
// NOTE: [The dispatch-mode engine's region]
// Each checkpoint call in this engine has two regions. The marker region (a keeps-nothing
// policy, entered through the scope C ABI like any region) labels the passes for audits and
// re-opens the units around the forward in the recompute; the fallback, installed or not, only
// counts under it. The mode region (ModeRegion below) holds the real policy and the kept
// outputs; it is never activated on the thread state, so the fallback never intercepts with it:
// only the mode drives it, pass by pass (mode_region_pass) and call by call (mode_call_*).
// A call belongs to the mode region only while its marker is the innermost region on the thread,
// exactly as the fallback hands a call only to the innermost region.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/function_schema.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "dispatch/data_flow.h"
#include "dispatch/fallback.h"
#include "dispatch/interception.h"
#include "dispatch/ivalue_tensors.h"
#include "dispatch/region.h"
#include "dispatch/region_scopes.h"
#include "dispatch/sac_key.h"
#include "dispatch/thread_state.h"
#include "ops/op_catalog.h"
#include "ops/op_traits.h"
#include "policy/policy.h"
#include "policy/unit_stack.h"

namespace sac {
namespace {

// What the mode does with a call, as mode_call_begin answers it.
enum ModeAction : int64_t {
  kRunOnly = 0,     // run it; nothing to record (not this region's, a view, nothing left to serve)
  kRunAndRecord = 1,  // run it, then mode_call_end records its outputs
  kRunAndKeep = 2,    // run it, then mode_call_end keeps and records its outputs
  kServed = 3,        // served: the outputs come back with the answer, already recorded
};

// How an argument or a return travels: tensors as they are, everything else stays in Python.
enum class Slot : uint8_t { kOther, kTensor, kTensorList, kOptionalTensorList };

// Optional or not: a None travels as no tensors (and, for a list, as a None in Python's key).
Slot slotOf(c10::TypePtr type) {
  if (auto optional = type->cast<c10::OptionalType>()) type = optional->getElementType();
  if (type->kind() == c10::TypeKind::TensorType) return Slot::kTensor;
  if (auto list = type->cast<c10::ListType>()) {
    const c10::TypePtr& element = list->getElementType();
    if (element->kind() == c10::TypeKind::TensorType) return Slot::kTensorList;
    if (auto optional = element->cast<c10::OptionalType>()) {
      if (optional->getElementType()->kind() == c10::TypeKind::TensorType) return Slot::kOptionalTensorList;
    }
  }
  return Slot::kOther;
}

// One op overload as the mode passes it: resolved once per process (Python caches the address).
struct ModeOp {
  explicit ModeOp(const c10::OperatorHandle& op) : handle(op) {
    for (const c10::Argument& argument : op.schema().arguments()) arguments.push_back(slotOf(argument.type()));
    for (const c10::Argument& value : op.schema().returns()) returns.push_back(slotOf(value.type()));
  }
  c10::OperatorHandle handle;
  std::vector<Slot> arguments;
  std::vector<Slot> returns;
};

std::mutex mode_ops_mutex;

const ModeOp& modeOp(const std::string& name, const std::string& overload) {
  // Leaked, like the catalog's entries: Python holds the addresses for the life of the process.
  static auto* ops = new std::unordered_map<std::string, ModeOp*>();
  std::lock_guard<std::mutex> lock(mode_ops_mutex);
  const std::string key = name + "." + overload;
  auto found = ops->find(key);
  if (found != ops->end()) return *found->second;
  auto handle = c10::Dispatcher::singleton().findOp(c10::OperatorName(name, overload));
  TORCH_CHECK_VALUE(handle.has_value(), "sac: the dispatch-mode engine was handed ", key,
                    ", which the dispatcher does not know");
  ModeOp* op = new ModeOp(*handle);
  ops->emplace(key, op);
  return *op;
}

// The values of `slots`, rebuilt from the tensors Python flattened in slot order: `tensors[i]`
// belongs to slot `positions[i]`. Slots with no tensors are None (their values stay in Python
// and reach the call's identity through its key).
std::vector<c10::IValue> rebuild(const std::vector<Slot>& slots, const std::vector<std::optional<at::Tensor>>& tensors,
                                 const std::vector<int64_t>& positions) {
  TORCH_CHECK_VALUE(tensors.size() == positions.size(), "sac: the dispatch-mode engine passed ", tensors.size(),
                    " tensors with ", positions.size(), " positions");
  std::vector<c10::IValue> values(slots.size());
  size_t next = 0;
  for (size_t slot = 0; slot < slots.size(); ++slot) {
    size_t end = next;
    while (end < positions.size() && positions[end] == static_cast<int64_t>(slot)) ++end;
    switch (slots[slot]) {
      case Slot::kTensor:
        if (end > next) values[slot] = tensors[next].has_value() ? c10::IValue(*tensors[next]) : c10::IValue(at::Tensor());
        break;
      case Slot::kTensorList: {
        c10::List<at::Tensor> list;
        for (size_t i = next; i < end; ++i) list.push_back(tensors[i].value_or(at::Tensor()));
        values[slot] = std::move(list);
        break;
      }
      case Slot::kOptionalTensorList: {
        c10::List<std::optional<at::Tensor>> list;
        for (size_t i = next; i < end; ++i) list.push_back(tensors[i]);
        values[slot] = std::move(list);
        break;
      }
      case Slot::kOther:
        break;
    }
    next = end;
  }
  TORCH_CHECK_VALUE(next == positions.size(), "sac: the dispatch-mode engine passed tensor positions out of order or "
                    "beyond the ", slots.size(), " slots of the schema");
  return values;
}

bool anyMetaTensor(const std::vector<std::optional<at::Tensor>>& tensors) {
  for (const auto& tensor : tensors) {
    if (tensor.has_value() && tensor->defined() && tensor->is_meta()) return true;
  }
  return false;
}

// Region::serve gives back each kept value as a Tensor, a Tensor[] or None; Python gets the
// tensors flat and each return's count (-1 for a return that is not a tensor or a list).
void flatten(const std::vector<c10::IValue>& values, std::vector<std::optional<at::Tensor>>* tensors,
             std::vector<int64_t>* counts) {
  for (const c10::IValue& value : values) {
    if (value.isTensor()) {
      const at::Tensor& tensor = value.toTensor();
      tensors->push_back(tensor.defined() ? std::optional<at::Tensor>(tensor) : std::nullopt);
      counts->push_back(1);
    } else if (value.isTensorList()) {
      int64_t count = 0;
      for (const c10::IValue& element : value.toListRef()) {
        tensors->push_back(element.toTensor());
        ++count;
      }
      counts->push_back(count);
    } else {
      counts->push_back(-1);
    }
  }
}

struct ModeRegion {
  ModeRegion(std::shared_ptr<const Policy> policy, c10::intrusive_ptr<Region> marker_region)
      : region(c10::make_intrusive<Region>(std::move(policy))), marker(std::move(marker_region)) {}

  c10::intrusive_ptr<Region> region;
  c10::intrusive_ptr<Region> marker;
  bool recompute = false;

  // The call between mode_call_begin and mode_call_end. The mode runs the kernel with itself
  // off, so one region's calls never nest.
  const ModeOp* pending_op = nullptr;
  uint64_t pending_call = 0;
  bool pending_keep = false;
  Decision pending_decision;  // what the rule decided for the pending call
  std::vector<WrittenStorage> pending_written;
};

ModeRegion& modeRegion(int64_t address) {
  TORCH_CHECK_VALUE(address != 0, "sac: the dispatch-mode engine needs the address mode_region_new returned, got 0");
  return *reinterpret_cast<ModeRegion*>(address);
}

// (action, the call's identity, the served tensors, each return's tensor count). The identity
// lets Python store the non-tensor values a kept call returned, and find them when it is served.
using BeginResult = std::tuple<int64_t, int64_t, std::vector<std::optional<at::Tensor>>, std::vector<int64_t>>;

// NOTE: [The dispatch-mode engine follows the fallback step by step]
// mode_call_begin and mode_call_end are InterceptedCall::run (dispatch/fallback.cpp) cut in two
// around the kernel, which Python runs: the same checks in the same order (calls that never
// count, meta tensors, tensors carrying the key, the innermost region, views the policy does not
// name, the recompute after the last kept call), the same demotion of kept outputs before a write
// (a `.data` write reaches the mode as an in-place op on the kept tensor's storage), the same
// identity, decision, keep, serve (with its version check) and record. Execution counts are the
// fallback's, under the marker region; hits are counted here, where the kernel is skipped.
BeginResult modeCallBegin(int64_t address, int64_t op_address, int64_t key,
                          const std::vector<std::optional<at::Tensor>>& tensors, const std::vector<int64_t>& positions,
                          bool draws_random) {
  ModeRegion& mode = modeRegion(address);
  const ModeOp& op = *reinterpret_cast<const ModeOp*>(op_address);
  BeginResult result{kRunOnly, 0, {}, {}};
  const OpEntry& entry = lookupOp(op.handle);
  if (entry.traits.never_counts || anyMetaTensor(tensors)) return result;
  Region* region = mode.region.get();
  if (ThreadState::current().region() != mode.marker.get() || !region->intercepts()) return result;
  const Policy& policy = region->policy();
  if (entry.traits.is_view && !policy.namesOp(entry)) return result;
  if (mode.recompute && !region->servesMore()) return result;

  const c10::FunctionSchema& schema = op.handle.schema();
  const size_t num_arguments = schema.arguments().size();
  torch::jit::Stack stack = rebuild(op.arguments, tensors, positions);
  if (carriesOurKey(stack, num_arguments)) return result;
  std::vector<WrittenStorage> written;
  if (entry.traits.mutates_inputs || entry.traits.writes_out_arguments) {
    written = writtenStorages(schema, stack.data());
    if (!mode.recompute) region->demoteKeptOutputsIn(written);  // in place and out= writes alike
  }
  // The non-tensor arguments, folded into one key by Python, name the call with its tensors.
  stack.emplace_back(key);
  const uint64_t call = region->flow().identify(entry, stack.data(), stack.size());
  stack.pop_back();

  std::get<1>(result) = static_cast<int64_t>(call);
  mode.pending_op = &op;
  mode.pending_call = call;
  mode.pending_written = std::move(written);
  mode.pending_keep = false;
  if (mode.recompute) {
    if (region->serve(entry, call, op.handle, &stack)) {
      if (pythonBelowSacKey() && c10::impl::tls_is_dispatch_key_included(kSacKey)) {
        entry.counters.reclassifyRecomputeAsHit();
      } else {
        entry.counters.recordHit();
      }
      std::vector<c10::IValue> served(stack.end() - static_cast<std::ptrdiff_t>(schema.returns().size()), stack.end());
      region->flow().recordCall(call, schema, stack, schema.returns().size(), mode.pending_written);
      mode.pending_op = nullptr;
      std::get<0>(result) = kServed;
      flatten(served, &std::get<2>(result), &std::get<3>(result));
      return result;
    }
    std::get<0>(result) = kRunAndRecord;
    return result;
  }

  CallFacts facts;
  facts.draws_random = draws_random;
  facts.casts_a_parameter = castsAParameter(entry.traits, stack.data());
  const std::vector<UnitId>& open_units = UnitStack::current().units();
  if (policy.countsCalls(entry, open_units)) facts.call_index = region->nextCallIndex(entry);
  Decision decision = policy.decide(entry, open_units, facts);
  if (decision.mutating_in_kept_unit || decision.random_call_of_kept_op) {
    warnAboutRecomputedSelection(policy, entry, decision);
  }
  mode.pending_keep = decision.held;
  mode.pending_decision = decision;
  std::get<0>(result) = decision.held ? kRunAndKeep : kRunAndRecord;
  return result;
}

// After the kernel ran: keeps (when decided) and records the call's outputs, which Python passes
// flattened by return slot, as mode_call_begin takes arguments.
void modeCallEnd(int64_t address, const std::vector<std::optional<at::Tensor>>& tensors,
                 const std::vector<int64_t>& positions) {
  ModeRegion& mode = modeRegion(address);
  TORCH_CHECK(mode.pending_op != nullptr, "sac: the dispatch-mode engine ended a call it did not begin");
  const ModeOp& op = *mode.pending_op;
  mode.pending_op = nullptr;
  const OpEntry& entry = lookupOp(op.handle);
  const c10::FunctionSchema& schema = op.handle.schema();
  torch::jit::Stack stack = rebuild(op.returns, tensors, positions);
  const size_t num_returns = stack.size();
  if (mode.pending_keep) mode.region->keep(entry, mode.pending_call, mode.pending_decision, stack, num_returns);
  mode.region->flow().recordCall(mode.pending_call, schema, stack, num_returns, mode.pending_written);
  mode.pending_written.clear();
}

// Passes, as ThreadState::enter and exit drive them for an activated region.
enum ModePass : int64_t { kBeginForward = 0, kEndForward = 1, kBeginRecompute = 2, kEndRecompute = 3 };

void modeRegionPass(int64_t address, int64_t pass) {
  ModeRegion& mode = modeRegion(address);
  mode.pending_op = nullptr;  // a kernel that raised leaves its call unfinished
  mode.pending_written.clear();
  switch (pass) {
    case kBeginForward:
      mode.recompute = false;
      mode.region->beginForward();
      return;
    case kEndForward:
      mode.region->endForward();
      return;
    case kBeginRecompute:
      mode.recompute = true;
      mode.region->beginRecompute();
      return;
    case kEndRecompute:
      mode.region->endRecompute(/*keep_entries=*/currentBackwardKeepsGraph());
      mode.recompute = false;
      return;
    default:
      TORCH_CHECK_VALUE(false, "sac: mode_region_pass takes 0 to 3 (begin forward, end forward, begin recompute, "
                        "end recompute), got ", pass);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sac, m) {
  // The address of the op's resolved form, for mode_call_begin; Python caches it per overload.
  m.def("mode_op(str name, str overload) -> int", [](const std::string& name, const std::string& overload) {
    return reinterpret_cast<int64_t>(&modeOp(name, overload));
  });
  // A mode region (NOTE: [The dispatch-mode engine's region]) with the policy at
  // `policy_address` (Policy._policy_address), bound to the marker region at `marker_address`
  // (the RegionHandle the scope C ABI created). Owned by the caller: mode_region_release frees it.
  m.def("mode_region_new(int policy_address, int marker_address) -> int",
        [](int64_t policy_address, int64_t marker_address) {
          TORCH_CHECK_VALUE(policy_address != 0 && marker_address != 0,
                            "sac: mode_region_new needs a policy address and a marker region address, got ",
                            policy_address, " and ", marker_address);
          const auto& policy = *reinterpret_cast<const std::shared_ptr<const Policy>*>(policy_address);
          auto* marker = reinterpret_cast<RegionHandle*>(marker_address);
          return reinterpret_cast<int64_t>(new ModeRegion(policy, marker->region));
        });
  m.def("mode_region_release(int address) -> ()", [](int64_t address) { delete &modeRegion(address); });
  m.def("mode_region_pass(int address, int which) -> ()", &modeRegionPass);
  m.def("mode_region_kept_calls(int address) -> int",
        [](int64_t address) { return modeRegion(address).region->keptCalls(); });
  m.def("mode_region_kept_bytes(int address) -> int",
        [](int64_t address) { return modeRegion(address).region->keptBytes(); });
  m.def("mode_call_begin(int region, int op, int key, Tensor?[] tensors, int[] positions, bool draws_random) -> "
        "(int, int, Tensor?[], int[])",
        &modeCallBegin);
  m.def("mode_call_end(int region, Tensor?[] tensors, int[] positions) -> ()", &modeCallEnd);
}

}  // namespace sac
