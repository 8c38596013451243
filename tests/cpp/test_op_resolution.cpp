#include <gtest/gtest.h>

#include <algorithm>

#include "policy/op_resolution.h"

namespace sac {
namespace {

std::vector<std::string> overloadNames(const std::string& spelling) {
  std::vector<std::string> names;
  for (const c10::OperatorHandle& op : resolveOpSpelling(spelling)) names.push_back(op.schema().overload_name());
  std::sort(names.begin(), names.end());
  return names;
}

TEST(OpSpelling, EveryOverloadWithoutADot) {
  OpSpelling parsed = parseOpSpelling("aten::mm");
  EXPECT_EQ(parsed.base_name, "aten::mm");
  EXPECT_TRUE(parsed.every_overload);
}

TEST(OpSpelling, DefaultMeansTheEmptyOverloadName) {
  OpSpelling parsed = parseOpSpelling("aten::mm.default");
  EXPECT_EQ(parsed.base_name, "aten::mm");
  EXPECT_EQ(parsed.overload, "");
  EXPECT_FALSE(parsed.every_overload);
}

TEST(OpSpelling, PythonDottedSpellingIsAccepted) {
  OpSpelling parsed = parseOpSpelling("aten.mm.out");
  EXPECT_EQ(parsed.base_name, "aten::mm");
  EXPECT_EQ(parsed.overload, "out");
}

TEST(OpSpelling, NameWithoutNamespaceIsAValueError) {
  try {
    parseOpSpelling("mm");
    FAIL() << "expected c10::ValueError";
  } catch (const c10::ValueError& error) {
    EXPECT_NE(std::string(error.what()).find("'mm' is not an op name; expected 'namespace::op'"), std::string::npos);
  }
}

TEST(OpResolution, EveryOverloadResolvesToAllOverloads) {
  EXPECT_EQ(overloadNames("aten::mm"), (std::vector<std::string>{"", "dtype", "dtype_out", "out"}));
}

TEST(OpResolution, OneOverloadResolvesToItself) {
  EXPECT_EQ(overloadNames("aten::mm.default"), std::vector<std::string>{""});
  EXPECT_EQ(overloadNames("aten::add.Tensor"), std::vector<std::string>{"Tensor"});
}

TEST(OpResolution, UnknownNamesResolveToNothing) {
  EXPECT_TRUE(resolveOpSpelling("aten::mmm").empty());
  EXPECT_TRUE(resolveOpSpelling("aten::mm.bogus").empty());
  EXPECT_TRUE(resolveOpSpelling("nosuchns::mm").empty());
}

TEST(OpResolution, ClosestNamesOfAMisspelling) {
  std::vector<std::string> closest = closestOpNames("aten::mmm", 3);
  ASSERT_EQ(closest.size(), 3u);
  EXPECT_NE(std::find(closest.begin(), closest.end(), "aten::mm"), closest.end());
}

TEST(OpResolution, UnknownOverloadListsTheRealOnes) {
  EXPECT_EQ(describeUnknownOp("aten::mm.bogus"),
            "unknown op 'aten::mm.bogus' (aten::mm has no overload 'bogus'; it has: aten::mm.default "
            "aten::mm.dtype aten::mm.dtype_out aten::mm.out)");
}

}  // namespace
}  // namespace sac
