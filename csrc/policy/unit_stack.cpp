#include "policy/unit_stack.h"

#include <c10/util/Exception.h>

#include <deque>
#include <mutex>

#include "hash_containers.h"

namespace sac {
namespace {

struct UnitNames {
  std::mutex mutex;
  HashMap<std::string, UnitId> ids;
  std::deque<std::string> names;  // deque: references stay valid as it grows
};

UnitNames& unitNames() {
  static auto* names = new UnitNames();
  return *names;
}

}  // namespace

UnitId internUnit(const std::string& name) {
  TORCH_CHECK_VALUE(!name.empty(), "sac: a recompute unit needs a non-empty name, e.g. 'attn'");
  UnitNames& table = unitNames();
  std::lock_guard<std::mutex> lock(table.mutex);
  auto [it, inserted] = table.ids.try_emplace(name, static_cast<UnitId>(table.names.size()));
  if (inserted) table.names.push_back(name);
  return it->second;
}

const std::string& unitName(UnitId unit) {
  UnitNames& table = unitNames();
  std::lock_guard<std::mutex> lock(table.mutex);
  return table.names.at(unit);
}

UnitStack& UnitStack::current() {
  thread_local UnitStack stack;
  return stack;
}

size_t UnitStack::push(UnitId unit) {
  units_.push_back(unit);
  return units_.size();
}

void UnitStack::pop(UnitId unit, size_t depth) {
  TORCH_CHECK(depth == units_.size() && !units_.empty() && units_.back() == unit,
              "sac: recompute unit '", unitName(unit), "' (opened at depth ", depth,
              ") closed out of order: the innermost open unit is ",
              units_.empty() ? std::string("none") : "'" + unitName(units_.back()) + "'",
              " at depth ", units_.size(), "; units must close in the reverse order they opened");
  units_.pop_back();
}

void UnitStack::pushAll(const std::vector<UnitId>& units) {
  units_.insert(units_.end(), units.begin(), units.end());
}

void UnitStack::truncate(size_t depth) {
  if (depth < units_.size()) units_.resize(depth);
}

UnitScope::UnitScope(const std::string& name)
    : unit_(internUnit(name)), depth_(UnitStack::current().push(unit_)) {}

UnitScope::~UnitScope() { UnitStack::current().truncate(depth_ - 1); }

}  // namespace sac
