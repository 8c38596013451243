#include <gtest/gtest.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <set>
#include <string>

#include "ops/op_resolution.h"

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

// Resolution is served from a cached index: a scan of every registered op per spelling made
// 16,000 spellings cost seconds.
TEST(OpResolution, RepeatedSpellingsDoNotRescanTheDispatcher) {
  resolveOpSpelling("aten::mm");
  uint64_t before = opIndexRebuilds();
  for (int i = 0; i < 16000; ++i) ASSERT_EQ(resolveOpSpelling("aten::mm").size(), 4u);
  EXPECT_EQ(opIndexRebuilds(), before);
}

TEST(OpResolution, TheIndexFollowsRegistrationAndDeregistration) {
  EXPECT_TRUE(resolveOpSpelling("sac_index_test::probe").empty());
  uint64_t before = opIndexRebuilds();
  {
    torch::Library library(torch::Library::DEF, "sac_index_test", std::nullopt, __FILE__, __LINE__);
    library.def("probe(Tensor x) -> Tensor");
    library.def("probe.other(Tensor x, int n) -> Tensor");
    EXPECT_EQ(overloadNames("sac_index_test::probe"), (std::vector<std::string>{"", "other"}));
    EXPECT_EQ(opIndexRebuilds(), before + 1);
    EXPECT_EQ(overloadNames("sac_index_test::probe"), (std::vector<std::string>{"", "other"}));
    EXPECT_EQ(opIndexRebuilds(), before + 1);
  }
  EXPECT_TRUE(resolveOpSpelling("sac_index_test::probe").empty());
}

std::string valueErrorOfParse(const std::string& spelling) {
  try {
    parseOpSpelling(spelling);
  } catch (const c10::ValueError& error) {
    return error.what_without_backtrace();
  }
  return "no error";
}

// A garbage name is refused by length before any edit distance against every op is computed.
TEST(OpResolution, AbsurdLengthsAreRefused) {
  EXPECT_EQ(valueErrorOfParse("aten::" + std::string(160000, 'x')),
            "sac: an op name has at most 1024 characters, got one of 160006: 'aten::" + std::string(74, 'x') +
                "... (160006 characters)'");
  EXPECT_EQ(valueErrorOfParse(std::string("aten::mm\0.out", 13)),
            "sac: an op name cannot contain a NUL character, got 'aten::mm\\x00.out'");
  EXPECT_EQ(parseOpSpelling("aten::" + std::string(kMaxOpNameLength - 6, 'x')).base_name.size(), kMaxOpNameLength);
}

TEST(OpResolution, SuggestionWorkIsBounded) {
  uint64_t work = 0;
  // Nothing registered is within a few edits of a 1,000-character name: nothing is compared.
  EXPECT_TRUE(closestOpNames("aten::" + std::string(1000, 'x'), 3, &work).empty());
  EXPECT_EQ(work, 0u);
  // A plausible misspelling still finds its op, computing at most a band of 17 diagonals of
  // each name of a similar length.
  std::string misspelled = "aten::scaled_dot_product_atention";
  std::vector<std::string> closest = closestOpNames(misspelled, 3, &work);
  ASSERT_FALSE(closest.empty());
  EXPECT_EQ(closest.front(), "aten::scaled_dot_product_attention");
  std::set<std::string> similar;
  for (const c10::OperatorName& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name.size() + 8 >= misspelled.size() && name.name.size() <= misspelled.size() + 8) {
      similar.insert(name.name);
    }
  }
  EXPECT_LE(work, similar.size() * misspelled.size() * 17);
  EXPECT_EQ(describeUnknownOp("aten::" + std::string(50, 'q')),
            "unknown op 'aten::" + std::string(50, 'q') + "'; no registered op has a similar name");
}

}  // namespace
}  // namespace sac
