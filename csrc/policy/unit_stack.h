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

// NOTE: [Region openings carry their flag]
// A torch_remat region (`torch_remat.region(fn, name, recompute=...)`) is a unit that says
// itself whether it keeps: recompute=False keeps its calls unless the policy names the unit,
// recompute=True recomputes them. The flag belongs to the opening, not to the name, and the
// recompute re-opens the forward's units by id (UnitStack::pushAll), so the flag travels in the
// id: bit 29 marks a region opening, bit 30 its recompute=True. Interned names stay far below
// bit 29 (maxInternedUnits), and kNoUnit (all bits set) is never an opening. unitName and the
// policy read the name's id through baseUnit.
inline constexpr uint32_t kRegionOpeningBit = uint32_t{1} << 29;
inline constexpr uint32_t kRegionRecomputesBit = uint32_t{1} << 30;
inline constexpr uint32_t kUnitIdMask = kRegionOpeningBit - 1;
inline UnitId regionOpening(UnitId unit, bool recompute) {
  return (unit & kUnitIdMask) | kRegionOpeningBit | (recompute ? kRegionRecomputesBit : 0);
}
inline UnitId baseUnit(UnitId unit) { return unit & kUnitIdMask; }
inline bool isRegionOpening(UnitId unit) { return (unit & kRegionOpeningBit) != 0 && (unit >> 31) == 0; }
inline bool regionRecomputes(UnitId unit) { return (unit & kRegionRecomputesBit) != 0; }

// Unit names are interned once, for the life of the process; the hot path compares small
// integers. Because they are never freed, names are bounded: at most kMaxUnitNameLength
// characters, no NUL, and at most maxInternedUnits() distinct names (a vocabulary such as
// 'attn', 'moe_gate', not per-call values). internUnit throws c10::ValueError otherwise.
inline constexpr size_t kMaxUnitNameLength = 256;
UnitId internUnit(const std::string& name);
// The name of a unit, or of the unit a region opening opens.
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
