#include "policy/unit_stack.h"

#include <c10/util/Exception.h>

#include <deque>
#include <mutex>

#include "ops/hash_containers.h"
#include "ops/op_resolution.h"
#include "ops/per_thread.h"

namespace sac {
namespace {

struct UnitNames {
  std::mutex mutex;
  HashMap<std::string, UnitId> ids;
  std::deque<std::string> names;  // deque: references stay valid as it grows
  // 65,536 names of at most 256 characters bound the table to ~20 MiB in the worst case.
  size_t limit = 65536;
};

UnitNames& unitNames() {
  static auto* names = new UnitNames();
  return *names;
}

}  // namespace

UnitId internUnit(const std::string& name) {
  TORCH_CHECK_VALUE(!name.empty(), "sac: a recompute unit needs a non-empty name, e.g. 'attn'");
  TORCH_CHECK_VALUE(name.size() <= kMaxUnitNameLength, "sac: a recompute unit name has at most ", kMaxUnitNameLength,
                    " characters (names are kept for the life of the process), got one of ", name.size(), ": '",
                    printableName(name), "'");
  TORCH_CHECK_VALUE(name.find('\0') == std::string::npos,
                    "sac: a recompute unit name cannot contain a NUL character, got '", printableName(name), "'");
  UnitNames& table = unitNames();
  std::lock_guard<std::mutex> lock(table.mutex);
  auto it = table.ids.find(name);
  if (it != table.ids.end()) return it->second;
  TORCH_CHECK_VALUE(table.names.size() < table.limit && table.names.size() < kUnitIdMask, "sac: recompute unit '",
                    printableName(name), "' is refused: this process already holds ", table.limit,
                    " distinct unit names, the limit (names are kept for the life of the process). Unit names are a "
                    "small vocabulary such as 'attn' or 'moe_gate', not per-call values");
  UnitId id = static_cast<UnitId>(table.names.size());
  table.ids.emplace(name, id);
  table.names.push_back(name);
  return id;
}

size_t internedUnitCount() {
  UnitNames& table = unitNames();
  std::lock_guard<std::mutex> lock(table.mutex);
  return table.names.size();
}

size_t maxInternedUnits() {
  UnitNames& table = unitNames();
  std::lock_guard<std::mutex> lock(table.mutex);
  return table.limit;
}

size_t setMaxInternedUnitsForTesting(size_t limit) {
  UnitNames& table = unitNames();
  std::lock_guard<std::mutex> lock(table.mutex);
  size_t previous = table.limit;
  table.limit = limit;
  return previous;
}

const std::string& unitName(UnitId unit) {
  UnitNames& table = unitNames();
  std::lock_guard<std::mutex> lock(table.mutex);
  return table.names.at(baseUnit(unit));
}

// One lookup per call: NOTE: [One lookup per thread-local object] in ops/per_thread.h.
UnitStack& UnitStack::current() { return PerThread<UnitStack>::get(); }

size_t UnitStack::push(UnitId unit) {
  units_.push_back(unit);
  return units_.size();
}

void UnitStack::pop(UnitId unit, size_t depth) {
  TORCH_CHECK(depth == units_.size() && !units_.empty() && units_.back() == unit, "sac: recompute unit '",
              unitName(unit), "' (opened at depth ", depth, ") closed out of order: the innermost open unit is ",
              units_.empty() ? std::string("none") : "'" + unitName(units_.back()) + "'", " at depth ", units_.size(),
              "; units must close in the reverse order they opened");
  units_.pop_back();
}

void UnitStack::pushAll(const std::vector<UnitId>& units) { units_.insert(units_.end(), units.begin(), units.end()); }

void UnitStack::truncate(size_t depth) {
  if (depth < units_.size()) units_.resize(depth);
}

UnitScope::UnitScope(const std::string& name) : unit_(internUnit(name)), depth_(UnitStack::current().push(unit_)) {}

UnitScope::~UnitScope() { UnitStack::current().truncate(depth_ - 1); }

}  // namespace sac
