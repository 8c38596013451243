#pragma once
// Turning the names users write into op overloads, once, at declaration time.
//
// Accepted spellings (Python's `str(torch.ops.aten.mm.default)` spelling too):
//   "aten::mm"          every overload of aten::mm
//   "aten::mm.default"  the default overload (schema overload name "")
//   "aten::mm.out"      one named overload
//   "aten.mm", "aten.mm.default"

#include <ATen/core/dispatch/Dispatcher.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace sac {

// Longest spelling accepted. Registered op names are a few dozen characters; the bound keeps a
// garbage string from costing time in resolution and in the closest-name search.
inline constexpr size_t kMaxOpNameLength = 1024;

struct OpSpelling {
  std::string base_name;  // "aten::mm"
  std::string overload;   // "" for the default overload
  bool every_overload = false;
};

// Throws c10::ValueError for a string that is no op spelling at all (no namespace, longer than
// kMaxOpNameLength, or holding a NUL character).
OpSpelling parseOpSpelling(const std::string& spelling);

// The registered overloads a spelling names; empty when it names none. Served from an index of
// every registered op by base name, rebuilt only after ops register or deregister.
std::vector<c10::OperatorHandle> resolveOpSpelling(const std::string& spelling);

// How many times the index above was rebuilt (a full scan of the dispatcher's op names each).
uint64_t opIndexRebuilds();

// Registered op names nearest to a misspelling (edit distance), best first; only names within
// a small distance are offered, so the list may be shorter than `limit` or empty. `work`, when
// given, receives the number of edit-distance cells computed (bounded: see the .cpp).
std::vector<std::string> closestOpNames(const std::string& spelling, size_t limit, uint64_t* work = nullptr);

// "unknown op 'aten::mmm'; closest registered names: aten::mm, aten::mv, ..."
std::string describeUnknownOp(const std::string& spelling);

// The spelling as it may appear in a message: non-printable bytes escaped (\x00), so that a NUL
// cannot cut the message short, and very long spellings shortened.
std::string printableName(const std::string& name);

}  // namespace sac
