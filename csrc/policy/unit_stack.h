#pragma once
// Recompute units: named regions of a model (`attn`, `moe_gate`) that a policy can keep.
// Each thread has its own stack of open units; units open and close strictly nested, through
// RAII in C++ and context managers in Python, so an exception cannot leave one open.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace sac {

using UnitId = uint32_t;

// Unit names are interned once, for the life of the process; the hot path compares small
// integers. Because they are never freed, names are bounded: at most kMaxUnitNameLength
// characters, no NUL, and at most maxInternedUnits() distinct names (a vocabulary such as
// 'attn', 'moe_gate', not per-call values). internUnit throws c10::ValueError otherwise.
inline constexpr size_t kMaxUnitNameLength = 256;
UnitId internUnit(const std::string& name);
const std::string& unitName(UnitId unit);
size_t internedUnitCount();
size_t maxInternedUnits();
// For tests: sets the limit on distinct names and returns the previous one.
size_t setMaxInternedUnitsForTesting(size_t limit);

class UnitStack {
 public:
  // This thread's stack.
  static UnitStack& current();

  // Returns the depth after the push; pass it back to pop().
  size_t push(UnitId unit);
  // Closes the innermost unit. Throws, changing nothing, if `unit` is not the innermost
  // open unit at `depth` (units closed out of order).
  void pop(UnitId unit, size_t depth);

  const std::vector<UnitId>& units() const { return units_; }
  size_t depth() const { return units_.size(); }

  // Region support: a recompute re-opens the units that were open around the forward.
  void pushAll(const std::vector<UnitId>& units);
  void truncate(size_t depth);

 private:
  std::vector<UnitId> units_;
};

class UnitScope {
 public:
  explicit UnitScope(const std::string& name);
  ~UnitScope();
  UnitScope(const UnitScope&) = delete;
  UnitScope& operator=(const UnitScope&) = delete;

 private:
  UnitId unit_;
  size_t depth_;
};

}  // namespace sac
