#pragma once
// The process-wide catalog of ops the plugin has met: each op's traits (read once from its
// schema) and its execution counters. Entries are never freed, so a `const OpEntry*` held by a
// policy or a region stays valid; an op deregistered from the dispatcher (a Python
// torch.library scope closing) is dropped from lookup, so a new op at the same address gets a
// fresh entry.

#include <functional>

#include "ops/op_counters.h"
#include "ops/op_traits.h"

namespace c10 {
class OperatorHandle;
}

namespace sac {

struct OpEntry {
  OpTraits traits;
  mutable OpCounters counters;  // written on the hot path through const lookups
};

// Hot path: one thread-local hash lookup; the first time a thread meets an op it takes the
// catalog's lock.
const OpEntry& lookupOp(const c10::OperatorHandle& op);

// Every live entry, under the catalog's lock (for audits and reports).
void forEachOp(const std::function<void(const OpEntry&)>& visit);

}  // namespace sac
