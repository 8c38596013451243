#include <gtest/gtest.h>

#include <c10/util/Exception.h>

#include <stdexcept>
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

}  // namespace
}  // namespace sac
