// The dispatch-mode engine's C++ half (python/sac_plugin/_dispatch_mode.py): a Python
// TorchDispatchMode sees every call of a checkpointed region and hands it here, before and after
// running its kernel, where the call pipeline the native fallback uses decides, holds and serves
// it (NOTE: [One call pipeline] in call_pipeline.cpp). Python holds only what C++ cannot: the
// non-tensor values a kept call returned. The ops that Python calls are registered in
// bindings/mode_engine_ops.cpp.
//
// NOTE: [The dispatch-mode engine's region]
// Each checkpoint call in this engine has two regions. The marker region (a keeps-nothing
// policy, entered through its scopes like any region) labels the passes for audits and
// re-opens the units around the forward in the recompute; the fallback, installed or not, only
// counts under it. The mode region (ModeRegion below) holds the real policy and the kept
// outputs; it is never activated on the thread state, so the fallback never intercepts with it:
// only the mode drives it, pass by pass (modeRegionPass) and call by call (modeCallBegin, End).
// A call belongs to the mode region only while its marker is the innermost region on the thread,
// exactly as the fallback hands a call only to the innermost region.
//
// The same mode also runs the recompute of a region the native fallback ran forward, while other
// dispatch modes are on (NOTE: [Modes above the key see only what ran] in _mode_recompute.py):
// modeRegionOver binds a mode region to that native region, whose scopes drive its passes, and
// modeCallBeginAll names each call from all its arguments, as the fallback named it.

#include "dispatch/mode_engine.h"

#include <ATen/ScalarOps.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/function_schema.h>

#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "dispatch/call_pipeline.h"
#include "dispatch/data_flow.h"
#include "dispatch/handed_out.h"
#include "dispatch/interception.h"
#include "dispatch/ivalue_tensors.h"
#include "dispatch/region.h"
#include "dispatch/region_scopes.h"
#include "dispatch/sac_key.h"
#include "dispatch/thread_state.h"
#include "ops/op_catalog.h"
#include "ops/op_traits.h"
#include "policy/policy.h"

namespace sac {
namespace {

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

// One op overload as the mode passes it: resolved once per process (Python caches its handle).
struct ModeOp {
  explicit ModeOp(const c10::OperatorHandle& op) : handle(op) {
    for (const c10::Argument& argument : op.schema().arguments()) arguments.push_back(slotOf(argument.type()));
    for (const c10::Argument& value : op.schema().returns()) returns.push_back(slotOf(value.type()));
  }
  c10::OperatorHandle handle;
  std::vector<Slot> arguments;
  std::vector<Slot> returns;
  int64_t handed_out = 0;  // NOTE: [A handle that comes back is checked] (handed_out.h)
};

std::mutex mode_ops_mutex;

const ModeOp& modeOp(const std::string& name, const std::string& overload) {
  // Leaked, like the catalog's entries: Python holds the handles for the life of the process.
  static auto* ops = new std::unordered_map<std::string, ModeOp*>();
  std::lock_guard<std::mutex> lock(mode_ops_mutex);
  const std::string key = name + "." + overload;
  auto found = ops->find(key);
  if (found != ops->end()) return *found->second;
  auto handle = c10::Dispatcher::singleton().findOp(c10::OperatorName(name, overload));
  TORCH_CHECK_VALUE(handle.has_value(), "sac: the dispatch-mode engine was handed ", key,
                    ", which the dispatcher does not know");
  ModeOp* op = new ModeOp(*handle);
  op->handed_out = HandedOut<ModeOp>::add(op);  // NOTE: [A handle that comes back is checked]
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
        if (end > next)
          values[slot] = tensors[next].has_value() ? c10::IValue(*tensors[next]) : c10::IValue(at::Tensor());
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
  TORCH_CHECK_VALUE(next == positions.size(),
                    "sac: the dispatch-mode engine passed tensor positions out of order or "
                    "beyond the ",
                    slots.size(), " slots of the schema");
  return values;
}

// An empty list as the fallback receives it for an argument of `type` (Python passes `()`: an
// empty list has no type of its own there). Lists of ints, SymInts included, are int lists.
c10::IValue emptyListOf(c10::TypePtr type) {
  if (auto optional = type->cast<c10::OptionalType>()) type = optional->getElementType();
  auto list = type->cast<c10::ListType>();
  if (list == nullptr) return c10::IValue();
  const c10::TypePtr& element = list->getElementType();
  if (element->kind() == c10::TypeKind::IntType || element->kind() == c10::TypeKind::SymIntType) {
    return c10::List<int64_t>();
  }
  if (element->kind() == c10::TypeKind::FloatType) return c10::List<double>();
  if (element->kind() == c10::TypeKind::BoolType) return c10::List<bool>();
  return c10::impl::GenericList(element);
}

// The full argument values, as the native fallback receives them on its stack: `rebuild`'s
// tensors, and each other argument from `others` (its position in `other_positions`) or, where
// torch left it out of the Python call because it equals its default, the schema's default.
std::vector<c10::IValue> rebuildAll(const c10::FunctionSchema& schema, const std::vector<Slot>& slots,
                                    const std::vector<std::optional<at::Tensor>>& tensors,
                                    const std::vector<int64_t>& positions, const c10::List<c10::IValue>& others,
                                    const std::vector<int64_t>& other_positions) {
  std::vector<c10::IValue> values = rebuild(slots, tensors, positions);
  TORCH_CHECK_VALUE(others.size() == other_positions.size(), "sac: the dispatch-mode engine passed ", others.size(),
                    " other arguments with ", other_positions.size(), " positions");
  std::vector<bool> given(values.size(), false);
  for (size_t i = 0; i < positions.size(); ++i) given[static_cast<size_t>(positions[i])] = true;
  for (size_t i = 0; i < others.size(); ++i) {
    const int64_t position = other_positions[i];
    TORCH_CHECK_VALUE(position >= 0 && position < static_cast<int64_t>(values.size()),
                      "sac: the dispatch-mode engine passed an argument at position ", position, " of a schema with ",
                      values.size(), " arguments");
    c10::IValue value = others.get(i);
    if (value.isTuple() && value.toTupleRef().elements().empty())
      value = emptyListOf(schema.arguments()[position].type());
    if (slots[position] == Slot::kTensor && value.isScalar()) {
      // Python's `x * 0.5` reaches the fallback as a wrapped-number tensor, and the mode as the
      // number itself: it is named by its value and dtype, so the same wrapped number names it.
      at::Tensor number = c10::scalar_to_tensor(value.toScalar());
      number.unsafeGetTensorImpl()->set_wrapped_number(true);
      value = std::move(number);
    }
    values[position] = std::move(value);
    given[position] = true;
  }
  for (size_t slot = 0; slot < values.size(); ++slot) {
    if (given[slot] || slots[slot] != Slot::kOther) continue;
    const auto& default_value = schema.arguments()[slot].default_value();
    if (default_value.has_value()) values[slot] = *default_value;
  }
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

}  // namespace

struct ModeRegion {
  // The marker is the innermost region while the function runs: the inputs it is handed go to the
  // region that holds the outputs (NOTE: [Offloading a layer's inputs] in offload.cpp).
  ModeRegion(std::shared_ptr<Site> site, c10::intrusive_ptr<Region> marker_region)
      : region(c10::make_intrusive<Region>(std::move(site))), marker(std::move(marker_region)) {
    marker->delegateInputsTo(region);
    handed_out = HandedOut<ModeRegion>::add(this);  // NOTE: [A handle that comes back is checked]
  }
  ~ModeRegion() { HandedOut<ModeRegion>::remove(handed_out); }
  // The recompute of a region whose forward the native fallback ran (NOTE: [Modes above the key
  // see only what ran]): its scopes drive its passes, the mode only its calls.
  ModeRegion(c10::intrusive_ptr<Region> native_region, c10::intrusive_ptr<Region> marker_region, bool in_recompute)
      : region(std::move(native_region)), marker(std::move(marker_region)), recompute(in_recompute) {
    marker->delegateInputsTo(region);
    handed_out = HandedOut<ModeRegion>::add(this);
  }

  c10::intrusive_ptr<Region> region;
  c10::intrusive_ptr<Region> marker;
  bool recompute = false;
  int64_t handed_out = 0;

  // The call between modeCallBegin and modeCallEnd. The mode runs the kernel with itself off, so
  // one region's calls never nest.
  const ModeOp* pending_op = nullptr;
  CallInFlight pending;
};

namespace {

ModeRegion& modeRegion(int64_t handle) {
  return HandedOut<ModeRegion>::at(handle, "the dispatch-mode engine", "a mode region (Site.new_mode_region)");
}

const ModeOp& modeOpAt(int64_t handle) {
  return HandedOut<ModeOp>::at(handle, "the dispatch-mode engine", "an op (mode_op)");
}

// The checks that come before the call pipeline, where the engines differ in how they find the
// call's region: calls that never count, meta tensors, tensors carrying the key (NOTE: [Calls that
// are not ours] in fallback.cpp), and a region that is not the innermost one. Then the pipeline
// (NOTE: [One call pipeline] in call_pipeline.cpp), with the kernel run by Python in between.
// Execution counts are the fallback's, under the marker region; hits are counted here, where the
// kernel is skipped. The call's arguments: its tensors alone, with Python's key for the rest (a
// mode region), or all of them (a native region's recompute, whose forward the fallback named
// from all of them).
using BuildArguments = std::function<torch::jit::Stack()>;

// The tensors of the call's arguments on `stack`, in the order the mode gave them (`positions`).
std::vector<std::optional<at::Tensor>> argumentTensors(const torch::jit::Stack& stack, size_t num_arguments,
                                                       const std::vector<int64_t>& positions) {
  std::vector<std::optional<at::Tensor>> tensors;
  tensors.reserve(positions.size());
  int64_t last = -1;
  for (int64_t position : positions) {
    if (position == last) continue;  // a list's tensors share its position
    last = position;
    const c10::IValue& value = stack[stack.size() - num_arguments + static_cast<size_t>(position)];
    if (value.isTensor()) {
      tensors.emplace_back(value.toTensor());
    } else if (value.isList()) {
      for (const c10::IValue& element : value.toListRef()) {
        tensors.push_back(element.isTensor() ? std::optional<at::Tensor>(element.toTensor()) : std::nullopt);
      }
    } else {
      tensors.emplace_back(std::nullopt);
    }
  }
  return tensors;
}

BeginResult beginCall(ModeRegion& mode, const ModeOp& op, const std::vector<std::optional<at::Tensor>>& tensors,
                      const std::vector<int64_t>& positions, const BuildArguments& build, std::optional<int64_t> key,
                      bool draws_random, std::vector<c10::IValue>* other_returns) {
  BeginResult result{kRunOnly, 0, {}, {}};
  const OpEntry& entry = lookupOp(op.handle);
  if (entry.traits.never_counts || anyMetaTensor(tensors)) return result;
  Region* region = mode.region.get();
  if (!region->intercepts()) return result;
  const ThreadState& state = ThreadState::current();
  const bool innermost = state.region() == mode.marker.get();
  // NOTE: [A checkpoint nested in another is named by the outer too] (call_pipeline.cpp): the
  // calls a nested region's mode runs reach this mode next, to be named, never decided here.
  if (!innermost && !state.encloses(mode.marker.get())) return result;

  const c10::FunctionSchema& schema = op.handle.schema();
  const size_t num_arguments = schema.arguments().size();
  torch::jit::Stack stack = build();
  if (carriesOurKey(stack, num_arguments)) return result;
  // NOTE: [The recompute writes nothing outside its region] (outside_writes.cpp): each mode
  // redirects for its own region, the innermost first (its mode is on top).
  if (C10_UNLIKELY(mode.recompute && region->outsideWrites().any()) &&
      region->outsideWrites().redirect(region->flow(), entry, &stack[stack.size() - num_arguments], num_arguments,
                                       region->pass())) {
    std::get<0>(result) = kRedirected;
    std::get<2>(result) = argumentTensors(stack, num_arguments, positions);
  }
  CallInFlight& call = mode.pending;
  if (!innermost) {
    if (!nameCall(*region, mode.recompute, entry, &stack, num_arguments, key, &call)) return result;
    mode.pending_op = &op;
    std::get<0>(result) |= kRunAndRecord;
    std::get<1>(result) = static_cast<int64_t>(call.identity);
    return result;
  }
  const CallStep step =
      sac::beginCall(*region, mode.recompute, entry, op.handle, &stack, num_arguments, key, draws_random, &call);
  if (step == CallStep::kRunOnly) return result;
  std::get<1>(result) = static_cast<int64_t>(call.identity);
  if (step == CallStep::kServed || step == CallStep::kSkipped) {
    if (step == CallStep::kSkipped) {
      // NOTE: [The recompute runs only what backward needs] (dead_calls.cpp): a native region's
      // recompute run above dispatch modes hands its stand-ins back as a served call's outputs.
      entry.counters.recordSkipped();
    } else if (pythonBelowSacKey() && c10::impl::tls_is_dispatch_key_included(kSacKey)) {
      entry.counters.reclassifyRecomputeAsHit();
    } else {
      entry.counters.recordHit();
    }
    std::vector<c10::IValue> served(stack.end() - static_cast<std::ptrdiff_t>(schema.returns().size()), stack.end());
    std::get<0>(result) = kServed;
    std::get<2>(result).clear();  // a served call runs on no arguments
    flatten(served, &std::get<2>(result), &std::get<3>(result));
    if (other_returns != nullptr) {
      // The native fallback kept the non-tensor returns too (a mode region's stay in Python).
      for (const c10::IValue& value : served) {
        other_returns->push_back(value.isTensor() || value.isTensorList() ? c10::IValue() : value);
      }
    }
    return result;
  }
  mode.pending_op = &op;
  std::get<0>(result) |= call.hold ? kRunAndKeep : kRunAndRecord;
  return result;
}

}  // namespace

BeginResult modeCallBegin(int64_t region, int64_t op_handle, int64_t key,
                          const std::vector<std::optional<at::Tensor>>& tensors, const std::vector<int64_t>& positions,
                          bool draws_random) {
  const ModeOp& op = modeOpAt(op_handle);
  return beginCall(
      modeRegion(region), op, tensors, positions, [&] { return rebuild(op.arguments, tensors, positions); }, key,
      draws_random, nullptr);
}

void modeCallBeginAll(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const bool draws_random = torch::jit::pop(*stack).toBool();
  const std::vector<int64_t> other_positions = torch::jit::pop(*stack).toIntVector();
  const c10::List<c10::IValue> others = torch::jit::pop(*stack).toList();
  const std::vector<int64_t> positions = torch::jit::pop(*stack).toIntVector();
  const c10::IValue tensor_list = torch::jit::pop(*stack);
  std::vector<std::optional<at::Tensor>> tensors;
  for (const c10::IValue& tensor : tensor_list.toListRef()) {
    tensors.push_back(tensor.isNone() ? std::nullopt : std::optional<at::Tensor>(tensor.toTensor()));
  }
  const int64_t op_handle = torch::jit::pop(*stack).toInt();
  const int64_t region = torch::jit::pop(*stack).toInt();
  const ModeOp& op = modeOpAt(op_handle);
  std::vector<c10::IValue> other_returns;
  BeginResult result = beginCall(
      modeRegion(region), op, tensors, positions,
      [&] { return rebuildAll(op.handle.schema(), op.arguments, tensors, positions, others, other_positions); },
      std::nullopt, draws_random, &other_returns);
  c10::List<std::optional<at::Tensor>> served;
  for (auto& tensor : std::get<2>(result)) served.push_back(std::move(tensor));
  c10::impl::GenericList values(c10::AnyType::get());
  for (auto& value : other_returns) values.push_back(std::move(value));
  torch::jit::push(*stack, std::get<0>(result), std::get<1>(result), std::move(served),
                   c10::List<int64_t>(std::get<3>(result)), std::move(values));
}

void modeCallEnd(int64_t region, const std::vector<std::optional<at::Tensor>>& tensors,
                 const std::vector<int64_t>& positions) {
  ModeRegion& mode = modeRegion(region);
  TORCH_CHECK(mode.pending_op != nullptr, "sac: the dispatch-mode engine ended a call it did not begin");
  const ModeOp& op = *mode.pending_op;
  mode.pending_op = nullptr;
  torch::jit::Stack stack = rebuild(op.returns, tensors, positions);
  sac::finishCall(*mode.region, mode.pending, op.handle.schema(), stack, stack.size());
}

std::string modeRegionPass(int64_t handle, int64_t pass) {
  ModeRegion& mode = modeRegion(handle);
  mode.pending_op = nullptr;  // a kernel that raised leaves its call unfinished
  mode.pending.written.clear();
  mode.pending.casts_a_parameter = false;
  mode.pending.cast_source.reset();  // not held past the call that raised
  switch (pass) {
    case kBeginForward:
      mode.recompute = false;
      mode.region->beginForward();
      return {};
    case kEndForward:
      mode.region->endForward();
      return {};
    case kBeginRecompute:
      mode.recompute = true;
      mode.region->beginRecompute();
      return {};
    case kEndRecompute:
      mode.region->endRecompute(/*keep_entries=*/currentBackwardKeepsGraph());
      mode.recompute = false;
      return mode.region->takeNeverServedNotice();
    default:
      TORCH_CHECK_VALUE(false,
                        "sac: mode_region_pass takes 0 to 3 (begin forward, end forward, begin recompute, "
                        "end recompute), got ",
                        pass);
      return {};
  }
}

int64_t modeOpHandle(const std::string& name, const std::string& overload) { return modeOp(name, overload).handed_out; }

int64_t newModeRegion(std::shared_ptr<Site> site, c10::intrusive_ptr<Region> marker) {
  return (new ModeRegion(std::move(site), std::move(marker)))->handed_out;
}

int64_t modeRegionOver(c10::intrusive_ptr<Region> native, c10::intrusive_ptr<Region> marker) {
  // A region that intercepts nothing kept nothing: its recompute has nothing to serve.
  if (!native->intercepts()) return 0;
  return (new ModeRegion(std::move(native), std::move(marker), /*in_recompute=*/true))->handed_out;
}

void releaseModeRegion(int64_t handle) { delete &modeRegion(handle); }

Region& modeRegionRegion(int64_t handle) { return *modeRegion(handle).region; }

}  // namespace sac
