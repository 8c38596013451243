#pragma once
// Data-flow identity of the op calls of one pass of a checkpointed region (its forward, or one
// recompute): a call is named by what it computes, not by when it runs, so that the recompute
// finds the forward's kept output for exactly the call that produced it. See
// NOTE: [Matching kept calls by data flow] in data_flow.cpp.

#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>
#include <c10/core/Storage.h>
#include <c10/util/intrusive_ptr.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "ops/hash_containers.h"

namespace c10 {
struct FunctionSchema;
}

namespace sac {

struct OpEntry;
struct OpTraits;

// A storage an op is about to write in place (an in-place op's self, an out= argument), noted
// before the kernel consumes its arguments.
struct WrittenStorage {
  c10::Storage storage;
  uint32_t argument;
};

// The storages of the arguments a call writes (in place, as out= arguments, or as NOTE: [Writes
// no schema declares] in ops/op_traits.h names them), noted before the kernel consumes them;
// `arguments` are the call's arguments in schema order.
std::vector<WrittenStorage> writtenStorages(const OpTraits& traits, const c10::IValue* arguments);

// What an enclosing region's recompute named, for the regions nested in it to name their inputs
// by in their own recompute (NOTE: [A nested checkpoint names its inputs as the outer does] in
// data_flow.cpp): each storage's origin, held weakly, so that an address is only read back for
// the storage that had it.
using NamesForNested = HashMap<const c10::StorageImpl*, std::pair<c10::weak_intrusive_ptr<c10::StorageImpl>, uint64_t>>;

class DataFlow {
 public:
  // Forgets the pass: storage records and occurrence counts. `salt` makes tensors whose origin
  // cannot be named (no storage) unique to this pass, so such calls never match another pass.
  // `expected_calls` reserves room for that many calls, so a pass does not regrow its tables
  // from empty (0: release the tables' memory).
  void reset(uint64_t salt, size_t expected_calls);

  // Distinct call descriptions named in this pass (what the next pass of this size reserves).
  size_t callsRecorded() const { return occurrences_.size(); }

  // The identity of one call: its op, grad mode, non-tensor arguments, the provenance of every
  // tensor argument, and how many calls with the same description came before it in this pass.
  uint64_t identify(const OpEntry& op, const c10::IValue* arguments, size_t count);

  // After the call ran (or was served): its fresh outputs (the last `num_returns` values on
  // `stack`, those the schema does not declare as aliases of an argument) now originate from
  // `call`, and so do the storages it wrote.
  void recordCall(uint64_t call, const c10::FunctionSchema& schema, const torch::jit::Stack& stack, size_t num_returns,
                  const std::vector<WrittenStorage>& written);

  // For the rest of this pass, a fresh constant handed to aten::lift_fresh (`value`, its
  // argument) is named by its value where it is small and on the CPU (NOTE: [A small constant is
  // named by its value] in data_flow.cpp).
  void nameFreshConstant(const c10::IValue& value);

  // The name this pass gives `storage`, an input of the region (no call of the pass produced it),
  // before anything writes it: what a copy of it is named as in another pass (nameCopyAs).
  uint64_t nameOfInput(const c10::StorageImpl* storage) const;
  // The same, with `offset_shift` receiving what to add to a tensor's offset in `storage` to find
  // its offset in what the name names (non-zero for a copy named as part of its original).
  uint64_t nameOfInput(const c10::StorageImpl* storage, int64_t* offset_shift) const {
    *offset_shift = 0;
    return externalOrigin(storage, offset_shift);
  }
  // For the rest of this pass, `copy` (a tensor the region made anew: an offloaded input brought
  // back for the recompute) is named as the tensor of the forward it copies, which lived at
  // `original_offset` in a storage the forward named `original_name` (nameOfInput; NOTE: [A copy
  // the region makes is named as its original] in data_flow.cpp).
  void nameCopyAs(const at::Tensor& copy, uint64_t original_name, int64_t original_offset);

  // For the rest of this pass, a storage it did not produce is named as the region around it
  // names it: by `enclosing_pass` (that region's pass under way, in the forward) or by
  // `enclosing_names` (what that region's last recompute named, in the recompute), where they
  // name it (NOTE: [A nested checkpoint names its inputs as the outer does]).
  void nameExternalsAs(const DataFlow* enclosing_pass, const NamesForNested* enclosing_names) {
    enclosing_pass_ = enclosing_pass;
    enclosing_names_ = enclosing_names;
  }
  // For the rest of this pass, note each storage it names that it did not produce, as calls read
  // them: whether the forward read outside state before writing it (NOTE: [The recompute writes
  // nothing outside its region] in outside_writes.cpp).
  void noteExternalReads() { note_external_reads_ = true; }
  bool readAsExternal(const c10::StorageImpl* storage) const { return external_reads_.count(storage) > 0; }
  // For the rest of this pass, remember what it names weakly, for the regions nested in it;
  // takeNamesForNested hands it over.
  void retainNamesForNested() { retain_for_nested_ = true; }
  NamesForNested takeNamesForNested() { return std::move(names_for_nested_); }

  // The origin this pass recorded for `storage`, or 0 when it has none (not produced or written
  // by an intercepted call of this pass).
  uint64_t originOf(const c10::StorageImpl* storage) const {
    auto found = origins_.find(storage);
    return found == origins_.end() ? 0 : found->second;
  }
  // The name of what a cast of the parameter `source` (a leaf that requires grad) to `dtype`
  // makes, wherever and whenever it is made (NOTE: [A parameter cast is named by what it casts]
  // in data_flow.cpp).
  static uint64_t parameterCastName(const at::Tensor& source, c10::ScalarType dtype);
  // After a parameter cast ran: its output `cast` is named `name` (parameterCastName), in this pass
  // and in every pass on this thread that meets it again with no call (autocast's cache).
  void nameParameterCast(const at::Tensor& cast, uint64_t name);

 private:
  uint64_t provenanceOf(const at::Tensor& tensor) const;
  // The origin of a storage no intercepted call of this pass produced: its address, or the
  // address of the storage it copies (nameCopyAs); `offset_shift` receives what to add to a
  // tensor's offset in it.
  uint64_t externalOrigin(const c10::StorageImpl* storage, int64_t* offset_shift) const;
  void mixValue(uint64_t& seed, const c10::IValue& value) const;
  void originate(const c10::Storage& storage, uint64_t origin, bool was_written);

  // The origin of each storage named in this pass, by its StorageImpl's address (NOTE: [Matching
  // kept calls by data flow]: records hold no reference to their storage).
  HashMap<const c10::StorageImpl*, uint64_t> origins_;
  HashMap<uint64_t, uint32_t> occurrences_;
  // The region's copies named as their originals (nameCopyAs): the original storage's name and
  // how far into it the copy's first element lived.
  struct CopyOf {
    uint64_t original_name;
    int64_t offset_shift;
  };
  HashMap<const c10::StorageImpl*, CopyOf> copies_;
  const DataFlow* enclosing_pass_ = nullptr;
  const NamesForNested* enclosing_names_ = nullptr;
  bool retain_for_nested_ = false;
  NamesForNested names_for_nested_;
  uint64_t salt_ = 0;
  bool note_external_reads_ = false;
  mutable HashSet<const c10::StorageImpl*> external_reads_;
};

}  // namespace sac
