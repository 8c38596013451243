#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <thread>

#include "policy/unit_stack.h"

namespace sac {
namespace {

TEST(UnitNames, InterningIsStable) {
  UnitId attn = internUnit("attn");
  EXPECT_EQ(internUnit("attn"), attn);
  EXPECT_NE(internUnit("moe_gate"), attn);
  EXPECT_EQ(unitName(attn), "attn");
  EXPECT_THROW(internUnit(""), c10::ValueError);
}

TEST(UnitStackTest, PushAndPopNest) {
  UnitStack& stack = UnitStack::current();
  size_t outer = stack.push(internUnit("attn"));
  size_t inner = stack.push(internUnit("rope"));
  EXPECT_EQ(stack.depth(), 2u);
  stack.pop(internUnit("rope"), inner);
  stack.pop(internUnit("attn"), outer);
  EXPECT_EQ(stack.depth(), 0u);
}

TEST(UnitStackTest, OutOfOrderPopThrowsAndChangesNothing) {
  UnitStack& stack = UnitStack::current();
  size_t outer = stack.push(internUnit("attn"));
  size_t inner = stack.push(internUnit("rope"));
  try {
    stack.pop(internUnit("attn"), outer);
    FAIL() << "expected c10::Error";
  } catch (const c10::Error& error) {
    EXPECT_EQ(std::string(error.what_without_backtrace()),
              "sac: recompute unit 'attn' (opened at depth 1) closed out of order: the innermost open unit is "
              "'rope' at depth 2; units must close in the reverse order they opened");
  }
  EXPECT_EQ(stack.depth(), 2u);
  stack.pop(internUnit("rope"), inner);
  stack.pop(internUnit("attn"), outer);
}

TEST(UnitStackTest, ScopeUnwindsOnException) {
  try {
    UnitScope attn("attn");
    UnitScope rope("rope");
    EXPECT_EQ(UnitStack::current().depth(), 2u);
    throw std::runtime_error("boom");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(UnitStack::current().depth(), 0u);
}

TEST(UnitStackTest, EachThreadHasItsOwnStack) {
  UnitScope attn("attn");
  size_t depth_elsewhere = 99;
  std::thread other([&] { depth_elsewhere = UnitStack::current().depth(); });
  other.join();
  EXPECT_EQ(depth_elsewhere, 0u);
  EXPECT_EQ(UnitStack::current().depth(), 1u);
}

std::string valueErrorOfIntern(const std::string& name) {
  try {
    internUnit(name);
  } catch (const c10::ValueError& error) {
    return error.what_without_backtrace();
  }
  return "no error";
}

// Names are interned for the life of the process, so their length is bounded.
TEST(UnitNames, LengthIsBounded) {
  EXPECT_EQ(unitName(internUnit(std::string(kMaxUnitNameLength, 'u'))), std::string(kMaxUnitNameLength, 'u'));
  size_t before = internedUnitCount();
  EXPECT_EQ(valueErrorOfIntern(std::string(kMaxUnitNameLength + 1, 'u')),
            "sac: a recompute unit name has at most 256 characters (names are kept for the life of the process), got "
            "one of 257: '" +
                std::string(80, 'u') + "... (257 characters)'");
  EXPECT_EQ(valueErrorOfIntern(std::string(10'000'000, 'u')),
            "sac: a recompute unit name has at most 256 characters (names are kept for the life of the process), got "
            "one of 10000000: '" +
                std::string(80, 'u') + "... (10000000 characters)'");
  EXPECT_EQ(valueErrorOfIntern(std::string("at\0tn", 5)),
            "sac: a recompute unit name cannot contain a NUL character, got 'at\\x00tn'");
  EXPECT_EQ(internedUnitCount(), before);  // refused names are not interned
}

TEST(UnitNames, DistinctNamesAreBounded) {
  internUnit("attn");
  size_t count = internedUnitCount();
  size_t previous = setMaxInternedUnitsForTesting(count + 1);
  EXPECT_EQ(previous, 65536u);
  std::string fresh = "bounded_" + std::to_string(count);
  internUnit(fresh);
  EXPECT_EQ(internUnit("attn"), internUnit("attn"));  // names already interned still resolve
  EXPECT_EQ(valueErrorOfIntern(fresh + "_more"),
            "sac: recompute unit '" + fresh + "_more' is refused: this process already holds " +
                std::to_string(count + 1) +
                " distinct unit names, the limit (names are kept for the life of the process). Unit names are a "
                "small vocabulary such as 'attn' or 'moe_gate', not per-call values");
  EXPECT_EQ(internedUnitCount(), count + 1);
  setMaxInternedUnitsForTesting(previous);
}

}  // namespace
}  // namespace sac
