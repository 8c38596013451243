#pragma once
// Turning the names users write into op overloads, once, at declaration time.
//
// Accepted spellings (Python's `str(torch.ops.aten.mm.default)` spelling too):
//   "aten::mm"          every overload of aten::mm
//   "aten::mm.default"  the default overload (schema overload name "")
//   "aten::mm.out"      one named overload
//   "aten.mm", "aten.mm.default"

#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <vector>

namespace sac {

struct OpSpelling {
  std::string base_name;  // "aten::mm"
  std::string overload;   // "" for the default overload
  bool every_overload = false;
};

// Throws c10::ValueError for a string that is no op spelling at all (no namespace).
OpSpelling parseOpSpelling(const std::string& spelling);

// The registered overloads a spelling names; empty when it names none.
std::vector<c10::OperatorHandle> resolveOpSpelling(const std::string& spelling);

// Registered op names nearest to a misspelling (edit distance), best first.
std::vector<std::string> closestOpNames(const std::string& spelling, size_t limit);

// "unknown op 'aten::mmm'; closest registered names: aten::mm, aten::mv, ..."
std::string describeUnknownOp(const std::string& spelling);

}  // namespace sac
