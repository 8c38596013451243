#include "dispatch/data_flow.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/function_schema.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <string_view>
#include <vector>

#include "dispatch/ivalue_tensors.h"
#include "ops/op_traits.h"

namespace sac {

// NOTE: [Matching kept calls by data flow]
// The forward keeps the outputs of some calls; the recompute must hand each of them back to the
// call that produced it and to no other. Counting calls ("the 3rd mm") breaks as soon as a call
// runs in one pass only: a no_grad cache filled on the first step, a lazy init, FSDP2's
// all-gather of a nested module's parameters, a profiler. So a call is named by what it
// computes:
//   identity = hash(op overload, grad mode, non-tensor arguments, provenance of each tensor
//                   argument) mixed with the number of earlier calls in this pass with the same
//                   description (two identical calls are told apart by order, and only then).
// The provenance of a tensor is the origin of its storage plus where in that storage it looks
// (offset, sizes, strides, dtype):
//   - a storage first produced in this pass takes the identity of the call that produced it and
//     the output's position; views and detach share their base's storage, so they need no record
//     and are named by their geometry;
//   - a storage written in place in this pass (in-place ops, out= arguments) takes a new origin
//     mixed from its old one and the writing call, so a read before a write and a read after it
//     differ;
//   - any other storage is the region's input, a parameter or a buffer: the same object in the
//     forward and in the recompute (torch's checkpoint hands the recompute the very tensors it
//     saved), named by its address.
// A call made in one pass only therefore produces origins that nothing in the other pass
// carries, and cannot move what any other call is served. Two calls with equal identities
// compute the same value from the same inputs (random calls are never kept, and the recompute
// restores the generator), so serving one's output to the other is exact. Where the origin of a
// tensor cannot be named (no storage, symbolic shapes), the identity is unique to the pass and
// the call simply runs: the match can only fail towards recomputing, never towards a wrong
// tensor.
//
// The records are keyed by the StorageImpl's address, live for one pass, and hold no reference
// to the storage: a storage that dies leaves its record behind. Every storage an intercepted
// call produces replaces the record at its address as it is made, so a storage with an origin is
// always named by its own. A storage made during the pass outside any intercepted call (a
// from_numpy, a kernel's cache, the plugin's own copies) has no origin: it is named by its
// address, or by the record a dead storage left there. Both names follow the order in which the
// region allocates and frees, so they agree between the passes where the region runs the same
// code on the same values twice, the premise of every match above. A reference that kept
// addresses unique (a weak one on each storage) would add no guarantee to that premise and
// costs three atomic operations and a deferred free per storage: a tenth of the per-call cost
// on a block of small ops.

// NOTE: [A copy the region makes is named as its original]
// An input the region offloads for its recompute comes back in a new storage: named by its
// address, it would carry an origin nothing in the forward carried, and no call computed from it
// would ever be served (every kept output of the layer held for nothing). The region knows which
// tensor of the forward each copy stands for, so the copy is named as that tensor: its storage
// takes the name the forward gave the original storage (its address, or the name the region
// around it gave it: NOTE: [A nested checkpoint names its inputs as the outer does]), and its
// offset is counted as the original's. The copy holds the very values the original held at the
// end of the forward (the region refuses an input written after it, NOTE: [Offloading a layer's
// inputs] in offload.cpp), so a call computed from it computes what its twin in the forward
// computed.

namespace {

inline void mix(uint64_t& seed, uint64_t value) {
  // boost::hash_combine's mixing, widened to 64 bits.
  seed ^= value + 0x9e3779b97f4a7c15ULL + (seed << 12) + (seed >> 4);
}

inline uint64_t mixed(uint64_t a, uint64_t b) {
  mix(a, b);
  return a;
}

inline uint64_t bitsOf(double value) {
  uint64_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// Scalars that Python passes as tensors (`x * 0.5` becomes mul.Tensor with a wrapped number) are
// made anew, outside the dispatcher, for every call: they are named by their value.
uint64_t wrappedNumberValue(const at::Tensor& tensor) {
  const void* data = tensor.const_data_ptr();
  uint64_t seed = static_cast<uint64_t>(tensor.scalar_type());
  switch (tensor.scalar_type()) {
    case at::kDouble:
      mix(seed, bitsOf(*static_cast<const double*>(data)));
      break;
    case at::kLong:
      mix(seed, static_cast<uint64_t>(*static_cast<const int64_t*>(data)));
      break;
    case at::kBool:
      mix(seed, *static_cast<const bool*>(data) ? 2 : 1);
      break;
    case at::kComplexDouble: {
      const double* parts = static_cast<const double*>(data);
      mix(seed, bitsOf(parts[0]));
      mix(seed, bitsOf(parts[1]));
      break;
    }
    default:
      return 0;  // not a kind Python wraps: the caller names it by its storage instead
  }
  return seed;
}

// NOTE: [A small constant is named by its value]
// A constant the code builds from Python values (`torch.tensor([...])`, the index tensor of
// `x[:, [0, 2]]`) is made outside the dispatcher, in a new storage each pass: named by its
// address, every call computed from it would differ between the passes and never be served, and
// a router computed through one would be recomputed instead of pinned. torch hands every such
// tensor to `aten::lift_fresh` as it is made, so there a small contiguous CPU one is named by its
// value (dtype and bytes) for the rest of the pass. Equal names then mean equal values, so a call
// served by that name computes what its twin computed. Only fresh constants: a buffer or an input
// made before the pass keeps its address, so that a router whose buffer changed between the
// forward and the recompute is still served the forward's routing. A constant made on an
// accelerator, or a large one, keeps its address too (reading it would wait on the device, or
// cost more than it finds).
constexpr int64_t kMostElementsNamedByValue = 64;

bool namedByValue(const c10::TensorImpl* impl) {
  return impl->device_type() == c10::DeviceType::CPU && impl->numel() <= kMostElementsNamedByValue &&
         !impl->requires_grad() && impl->is_contiguous() && impl->storage().data() != nullptr;
}

uint64_t valueOf(const at::Tensor& tensor) {
  const size_t bytes = static_cast<size_t>(tensor.numel()) * tensor.dtype().itemsize();
  uint64_t seed =
      std::hash<std::string_view>{}(std::string_view(static_cast<const char*>(tensor.const_data_ptr()), bytes));
  mix(seed, static_cast<uint64_t>(tensor.scalar_type()) + 0x76616c75ULL);  // "valu"
  return seed;
}

constexpr uint64_t kUndefinedTensor = 0x7e57;
constexpr uint64_t kWrittenTag = 0x5772697465ULL;      // "Write"
constexpr uint64_t kExternalTag = 0x6578746eULL;       // "extn"
constexpr uint64_t kNestedTag = 0x6e657374ULL;         // "nest"
constexpr uint64_t kParameterCastTag = 0x63617374ULL;  // "cast"

}  // namespace

void DataFlow::reset(uint64_t salt, size_t expected_calls) {
  origins_.clear();
  occurrences_.clear();
  copies_.clear();
  enclosing_pass_ = nullptr;
  enclosing_names_ = nullptr;
  retain_for_nested_ = false;
  names_for_nested_.clear();
  note_external_reads_ = false;
  external_reads_.clear();
  if (expected_calls > 0) {
    // One allocation per pass instead of a rehash at every doubling; every call produces about
    // one storage.
    origins_.reserve(expected_calls);
    occurrences_.reserve(expected_calls);
  }
  salt_ = salt;
}

uint64_t DataFlow::provenanceOf(const at::Tensor& tensor) const {
  if (C10_UNLIKELY(!tensor.defined())) return kUndefinedTensor;
  const c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
  if (impl->is_wrapped_number() && tensor.device().is_cpu()) {
    if (uint64_t value = wrappedNumberValue(tensor)) return value;
  }
  if (C10_UNLIKELY(!tensor.has_storage() || impl->has_symbolic_sizes_strides())) {
    // No origin to name: unique to this pass and to this tensor.
    return mixed(salt_, reinterpret_cast<uintptr_t>(impl));
  }
  const c10::StorageImpl* storage = impl->storage().unsafeGetStorageImpl();
  auto found = origins_.find(storage);
  int64_t offset = impl->storage_offset();
  if (note_external_reads_ && found == origins_.end()) external_reads_.insert(storage);
  uint64_t seed = found != origins_.end() ? found->second : externalOrigin(storage, &offset);
  // Where in the storage the tensor looks: dtype and offset, then each dimension's size and
  // stride folded into one word (the hash is 64-bit either way; one mix per dimension, not two).
  mix(seed, (static_cast<uint64_t>(offset) << 8) ^ static_cast<uint64_t>(tensor.scalar_type()));
  c10::IntArrayRef sizes = impl->sizes();
  c10::IntArrayRef strides = impl->strides();
  for (size_t d = 0; d < sizes.size(); ++d) {
    mix(seed, static_cast<uint64_t>(sizes[d]) * 0x9e3779b97f4a7c15ULL ^ static_cast<uint64_t>(strides[d]));
  }
  return seed;
}

void DataFlow::mixValue(uint64_t& seed, const c10::IValue& value) const {
  if (value.isTensor()) {
    mix(seed, 1);
    mix(seed, provenanceOf(value.toTensor()));
  } else if (value.isTensorList()) {
    mix(seed, 2);
    for (const c10::IValue& element : value.toListRef()) mix(seed, provenanceOf(element.toTensor()));
  } else if (value.isInt()) {
    mix(seed, 3);
    mix(seed, static_cast<uint64_t>(value.toInt()));
  } else if (value.isDouble()) {
    mix(seed, 4);
    mix(seed, bitsOf(value.toDouble()));
  } else if (value.isBool()) {
    mix(seed, value.toBool() ? 6 : 5);
  } else if (value.isIntList()) {
    mix(seed, 7);
    for (int64_t element : value.toIntList()) mix(seed, static_cast<uint64_t>(element));
  } else if (value.isString()) {
    mix(seed, 8);
    mix(seed, std::hash<std::string>{}(value.toStringRef()));
  } else if (value.isList()) {
    mix(seed, 9);
    for (const c10::IValue& element : value.toListRef()) mixValue(seed, element);
  } else if (value.isNone()) {
    mix(seed, 10);
  } else if (value.isComplexDouble()) {
    mix(seed, 11);
    c10::complex<double> number = value.toComplexDouble();
    mix(seed, bitsOf(number.real()));
    mix(seed, bitsOf(number.imag()));
  } else {
    // Devices, dtypes, layouts and memory formats arrive as ints; generators, objects and other
    // rare kinds are named by kind only.
    mix(seed, 12 + static_cast<uint64_t>(value.isDevice()));
    if (value.isDevice())
      mix(seed, static_cast<uint64_t>(value.toDevice().type()) * 256 + value.toDevice().index() + 1);
  }
}

uint64_t DataFlow::identify(const OpEntry& op, const c10::IValue* arguments, size_t count) {
  uint64_t description = reinterpret_cast<uintptr_t>(&op);
  mix(description, c10::GradMode::is_enabled() ? 2 : 1);
  for (size_t i = 0; i < count; ++i) mixValue(description, arguments[i]);
  uint32_t earlier = occurrences_[description]++;
  return mixed(description, earlier);
}

// NOTE: [A parameter cast is named by what it casts]
// Autocast caches its cast of a parameter for as long as the outermost autocast context is open,
// and hands it to whoever casts the same parameter again, with no call. A backward run inside that
// context (the usual loop: forward, loss and backward under one `with torch.autocast(...)`) lets a
// recompute reuse the cast its forward made; a second backward reuses the first recompute's; a
// nested checkpoint's recompute reuses the one the outer recompute's replay of it made. Named by
// the call that made it, or by its address where no call made it, such a cast would carry a
// different name in each pass, and no call computed from the weight (every matmul of the layer)
// would be served. So a cast of a parameter is named by what it casts, the parameter's storage and
// place in it, and the dtype it casts to, wherever it is made; and a thread remembers the casts it
// named (weakly: an address is read back only for the storage that had it, and a storage whose
// last reference went is forgotten), so that a pass that meets one with no call names it alike.
// Two casts of one parameter to one dtype hold the same values, so naming them alike is sound.
namespace {

// Set once any thread has named a parameter cast: until then, naming a storage no call of the pass
// produced costs no thread-local lookup.
std::atomic<bool> parameter_casts_named{false};

struct RememberedCast {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  uint64_t name;
};

class ParameterCasts {
 public:
  static ParameterCasts& current() {
    thread_local ParameterCasts casts;
    return casts;
  }
  void remember(const c10::Storage& storage, uint64_t name) {
    parameter_casts_named.store(true, std::memory_order_relaxed);
    if (casts_.size() >= prune_at_) prune();
    casts_.insert_or_assign(storage.unsafeGetStorageImpl(), RememberedCast{storage.getWeakStorageImpl(), name});
  }
  uint64_t nameOf(const c10::StorageImpl* storage) const {
    if (casts_.empty()) return 0;
    auto found = casts_.find(storage);
    if (found == casts_.end()) return 0;
    c10::intrusive_ptr<c10::StorageImpl> alive = found->second.storage.lock();
    return alive.get() == storage ? found->second.name : 0;
  }

 private:
  void prune() {
    std::vector<const c10::StorageImpl*> forgotten;
    for (const auto& [storage, cast] : casts_) {
      if (cast.storage.expired()) forgotten.push_back(storage);
    }
    for (const c10::StorageImpl* storage : forgotten) casts_.erase(storage);
    prune_at_ = std::max<size_t>(64, 2 * casts_.size());
  }
  HashMap<const c10::StorageImpl*, RememberedCast> casts_;
  size_t prune_at_ = 64;
};

}  // namespace

uint64_t DataFlow::parameterCastName(const at::Tensor& source, c10::ScalarType dtype) {
  uint64_t name = mixed(kParameterCastTag, reinterpret_cast<uintptr_t>(source.storage().unsafeGetStorageImpl()));
  mix(name, static_cast<uint64_t>(source.storage_offset()));
  mix(name, static_cast<uint64_t>(dtype));
  return name;
}

void DataFlow::nameParameterCast(const at::Tensor& cast, uint64_t name) {
  if (!cast.defined() || !cast.has_storage()) return;
  origins_.insert_or_assign(cast.storage().unsafeGetStorageImpl(), name);
  ParameterCasts::current().remember(cast.storage(), name);
}

// NOTE: [A nested checkpoint names its inputs as the outer does]
// torch hands a nested checkpoint's recompute the inputs its enclosing checkpoint's recompute
// made (the inputs of a nested checkpoint are tensors its parent saves, and recomputes), new
// storages where the forward's inputs were the parent's own intermediates. Named by address, no
// call reading them would match the forward, and nothing the nested region kept would be served.
// So a nested region names a storage it did not produce as the region around it names it: in its
// forward by that region's pass under way; in its recompute by what that region's last recompute
// named, which it retains, weakly, for the regions nested in it. The enclosing region names the
// same tensor alike in its two passes (NOTE: [A checkpoint nested in another is named by the
// outer too] in call_pipeline.cpp), so the nested region's two passes do too. What neither names
// (a parameter, the enclosing region's own inputs) keeps its address.
uint64_t DataFlow::externalOrigin(const c10::StorageImpl* storage, int64_t* offset_shift) const {
  // NOTE: [A parameter cast is named by what it casts]
  if (C10_UNLIKELY(parameter_casts_named.load(std::memory_order_relaxed))) {
    if (uint64_t cast = ParameterCasts::current().nameOf(storage)) return cast;
  }
  if (C10_UNLIKELY(enclosing_pass_ != nullptr)) {
    if (uint64_t origin = enclosing_pass_->originOf(storage)) return mixed(kNestedTag, origin);
  } else if (C10_UNLIKELY(enclosing_names_ != nullptr)) {
    auto named = enclosing_names_->find(storage);
    if (named != enclosing_names_->end()) {
      c10::intrusive_ptr<c10::StorageImpl> alive = named->second.first.lock();
      if (alive.get() == storage) return mixed(kNestedTag, named->second.second);
    }
  }
  if (C10_UNLIKELY(!copies_.empty())) {
    auto copy = copies_.find(storage);
    if (copy != copies_.end()) {
      *offset_shift += copy->second.offset_shift;
      return copy->second.original_name;
    }
  }
  return mixed(kExternalTag, reinterpret_cast<uintptr_t>(storage));
}

uint64_t DataFlow::nameOfInput(const c10::StorageImpl* storage) const {
  int64_t unused_shift = 0;
  return externalOrigin(storage, &unused_shift);
}

void DataFlow::nameFreshConstant(const c10::IValue& value) {
  if (!value.isTensor()) return;
  const at::Tensor& tensor = value.toTensor();
  if (!tensor.defined() || !tensor.has_storage() || !namedByValue(tensor.unsafeGetTensorImpl())) return;
  origins_.insert_or_assign(tensor.storage().unsafeGetStorageImpl(), valueOf(tensor));
}

void DataFlow::nameCopyAs(const at::Tensor& copy, uint64_t original_name, int64_t original_offset) {
  if (!copy.defined() || !copy.has_storage()) return;
  copies_.insert_or_assign(copy.storage().unsafeGetStorageImpl(),
                           CopyOf{original_name, original_offset - copy.storage_offset()});
}

void DataFlow::originate(const c10::Storage& storage, uint64_t origin, bool was_written) {
  const c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  uint64_t named = origin;
  if (!was_written) {
    origins_.insert_or_assign(impl, origin);
  } else {
    // A write to a storage this pass has not produced (an input, a buffer) keeps the name that
    // storage had (externalOrigin) in the origin: that name is the same in both passes.
    auto record = origins_.find(impl);
    if (record == origins_.end()) {
      int64_t unused_shift = 0;
      record = origins_.emplace(impl, externalOrigin(impl, &unused_shift)).first;
    }
    record->second = mixed(record->second, origin);
    named = record->second;
  }
  // NOTE: [A nested checkpoint names its inputs as the outer does]
  if (C10_UNLIKELY(retain_for_nested_)) names_for_nested_.insert_or_assign(impl, {storage.getWeakStorageImpl(), named});
}

void DataFlow::recordCall(uint64_t call, const c10::FunctionSchema& schema, const torch::jit::Stack& stack,
                          size_t num_returns, const std::vector<WrittenStorage>& written) {
  for (const WrittenStorage& write : written) {
    originate(write.storage, mixed(mixed(call, kWrittenTag), write.argument), /*was_written=*/true);
  }
  const auto& returns = schema.returns();
  const size_t first = stack.size() - num_returns;
  for (size_t i = 0; i < num_returns; ++i) {
    // Returns annotated as aliases (views, in-place and out= results) share an argument's
    // storage, already named by the argument or by the write above.
    if (i < returns.size() && returns[i].alias_info() != nullptr) continue;
    uint64_t position = i;
    forEachTensor(stack[first + i], [&](const at::Tensor& tensor) {
      if (tensor.defined() && tensor.has_storage()) {
        originate(tensor.storage(), mixed(call, position), /*was_written=*/false);
      }
      position += 0x100000000ULL;  // the next element of a Tensor[] return
    });
  }
}

std::vector<WrittenStorage> writtenStorages(const OpTraits& traits, const c10::IValue* arguments) {
  std::vector<WrittenStorage> storages;
  for (uint32_t i : traits.written_arguments) {
    forEachTensor(arguments[i], [&](const at::Tensor& tensor) {
      if (tensor.defined() && tensor.has_storage()) storages.push_back(WrittenStorage{tensor.storage(), i});
    });
  }
  return storages;
}

}  // namespace sac
