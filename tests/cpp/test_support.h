// What several C++ test files share: an op's catalog entry by name or by spelling, and an op's
// count in an audit's rows. Each test file includes it from its own directory.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "diagnostics/audit.h"
#include "ops/op_catalog.h"
#include "ops/op_resolution.h"

namespace sac {

// The catalog entry of overload `overload` of `name` ("" is the default overload); a test that
// names an op the dispatcher lacks fails here, naming it.
inline const OpEntry& entryOf(const char* name, const char* overload = "") {
  auto handle = c10::Dispatcher::singleton().findSchema({name, overload});
  EXPECT_TRUE(handle.has_value()) << name << "." << overload;
  return lookupOp(*handle);
}

// The catalog entry of the overload `spelling` names ("aten::tanh" is the default overload,
// "aten::add_.Tensor" that one).
inline const OpEntry& entrySpelled(const std::string& spelling) {
  for (const c10::OperatorHandle& handle : resolveOpSpelling(spelling)) {
    const OpEntry& entry = lookupOp(handle);
    if (entry.traits.qualified_name == spelling || entry.traits.qualified_name == spelling + ".default") return entry;
  }
  throw std::invalid_argument("no overload spelled " + spelling);
}

// `op`'s executions in `phase` among an audit's rows, or its hits where `phase` is negative.
inline uint64_t countOf(const std::vector<AuditRow>& rows, const std::string& op, int phase) {
  for (const AuditRow& row : rows) {
    if (row.op == op) return phase < 0 ? row.counts.hits : row.counts.executions[phase];
  }
  return 0;
}

}  // namespace sac
