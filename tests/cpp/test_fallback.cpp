#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "diagnostics/audit.h"
#include "dispatch/call_signature.h"
#include "dispatch/fallback.h"
#include "dispatch/region.h"
#include "dispatch/sac_key.h"
#include "dispatch/thread_state.h"
#include "policy/unit_stack.h"

namespace sac {
namespace {

bool keySetsEqual(const c10::impl::LocalDispatchKeySet& a, const c10::impl::LocalDispatchKeySet& b) {
  return a.included_ == b.included_ && a.excluded_ == b.excluded_;
}

bool sacKeyIncluded() { return c10::impl::tls_local_dispatch_key_set().included_.has(kSacKey); }

uint64_t countOf(const std::vector<AuditRow>& rows, const std::string& op, int phase) {
  for (const AuditRow& row : rows) {
    if (row.op == op) return phase < 0 ? row.counts.hits : row.counts.executions[phase];
  }
  return 0;
}

void dummyFallback(const c10::OperatorHandle&, c10::DispatchKeySet, torch::jit::Stack*) {}

// The refusal can only be observed in a process where sac's fallback is not installed yet:
// installFallback() is idempotent once it succeeded. ctest runs each test in its own process,
// but the binary run as one process (or with --gtest_shuffle) may run FallbackTest first. So
// when the fallback is already installed here, the same test is run again in a fresh child
// process (this executable, filtered to this one test) and must pass there.
constexpr char kFreshProcessVariable[] = "SAC_TEST_FRESH_PROCESS";

void checkRefusalInThisProcess() {
  ASSERT_FALSE(fallbackInstalled());
  auto other = c10::Dispatcher::singleton().registerFallback(
      kSacKey, c10::KernelFunction::makeFromBoxedFunction<&dummyFallback>(), "another library");
  try {
    installFallback();
    FAIL() << "expected c10::Error";
  } catch (const c10::Error& error) {
    EXPECT_EQ(std::string(error.what_without_backtrace()),
              "sac_plugin cannot load: the dispatch key Fake already holds a backend fallback in this torch, "
              "registered by torch itself or another library. sac_plugin intercepts ops through a fallback on "
              "that key and needs it free (see NOTE: [The dispatch key sac_plugin intercepts on] in "
              "csrc/dispatch/sac_key.h)");
  }
  EXPECT_FALSE(fallbackInstalled());
}

// Runs this executable again with only the current test selected; returns its exit status.
int runThisTestInAFreshProcess() {
  const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string filter = std::string("--gtest_filter=") + test->test_suite_name() + "." + test->name();
  std::string marker = std::string(kFreshProcessVariable) + "=1";
  // Everything the child needs is built before fork: between fork and exec a child of a
  // multithreaded process may only make async-signal-safe calls.
  std::vector<char*> environment;
  for (char** variable = environ; *variable != nullptr; ++variable) environment.push_back(*variable);
  environment.push_back(marker.data());
  environment.push_back(nullptr);
  char* const argv[] = {const_cast<char*>("sac_cpp_tests"), filter.data(), nullptr};
  pid_t child = fork();
  if (child == 0) {
    execve("/proc/self/exe", argv, environment.data());
    _exit(127);  // exec failed
  }
  int status = 0;
  if (child < 0 || waitpid(child, &status, 0) != child) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(FallbackInstall, RefusesAKeyThatAlreadyHoldsAFallback) {
  if (!fallbackInstalled()) {
    checkRefusalInThisProcess();
    return;
  }
  // Already installed here by an earlier test; a child that finds it installed too would fail
  // its ASSERT, never recurse.
  ASSERT_EQ(std::getenv(kFreshProcessVariable), nullptr) << "the fallback is installed in a fresh process";
  EXPECT_EQ(runThisTestInAFreshProcess(), 0) << "the refusal check failed in a fresh process (its output is above)";
}

class FallbackTest : public ::testing::Test {
 protected:
  void SetUp() override {
    installFallback();
    before_ = c10::impl::tls_local_dispatch_key_set();
  }
  void TearDown() override {
    EXPECT_TRUE(keySetsEqual(before_, c10::impl::tls_local_dispatch_key_set()));
    EXPECT_FALSE(sacKeyIncluded());
    EXPECT_EQ(ThreadState::current().depth(), 0u);
    EXPECT_EQ(UnitStack::current().depth(), 0u);
  }
  c10::impl::LocalDispatchKeySet before_ = c10::impl::tls_local_dispatch_key_set();
};

TEST_F(FallbackTest, InstallIsIdempotent) {
  installFallback();
  EXPECT_TRUE(fallbackInstalled());
  EXPECT_TRUE(c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(kSacKey));
}

TEST_F(FallbackTest, KeyIsIncludedOnlyInsideAnInterceptingRegion) {
  auto keeping = c10::make_intrusive<Region>(Policy::create({"aten::tanh"}, {}));
  auto plain = c10::make_intrusive<Region>(Policy::create({}, {}));
  {
    ActivationScope forward(ActivationKind::kForward, keeping.get());
    EXPECT_TRUE(sacKeyIncluded());
  }
  EXPECT_FALSE(sacKeyIncluded());
  {
    ActivationScope forward(ActivationKind::kForward, plain.get());
    EXPECT_FALSE(sacKeyIncluded());
  }
}

TEST_F(FallbackTest, KeySetIsRestoredAfterAnException) {
  auto region = c10::make_intrusive<Region>(Policy::create({"aten::tanh"}, {}));
  try {
    ActivationScope forward(ActivationKind::kForward, region.get());
    UnitScope attn("attn");
    throw std::runtime_error("boom");
  } catch (const std::runtime_error&) {
  }
}

TEST_F(FallbackTest, OtherThreadsAreUntouched) {
  auto region = c10::make_intrusive<Region>(Policy::create({"aten::tanh"}, {}));
  ActivationScope forward(ActivationKind::kForward, region.get());
  bool included_elsewhere = true;
  std::thread other([&] { included_elsewhere = sacKeyIncluded(); });
  other.join();
  EXPECT_FALSE(included_elsewhere);
}

TEST_F(FallbackTest, MisnestedExitUnwindsEverythingAndSaysSo) {
  auto outer = c10::make_intrusive<Region>(Policy::create({"aten::tanh"}, {}));
  auto inner = c10::make_intrusive<Region>(Policy::create({"aten::sin"}, {}));
  ThreadState& state = ThreadState::current();
  size_t outer_depth = state.enter(ActivationKind::kForward, outer.get());
  state.enter(ActivationKind::kForward, inner.get());
  try {
    state.exit(ActivationKind::kForward, outer.get(), outer_depth);
    FAIL() << "expected c10::Error";
  } catch (const c10::Error& error) {
    EXPECT_EQ(std::string(error.what_without_backtrace()),
              "sac: a checkpointed forward exited while a checkpointed forward inside it was still open; both were "
              "closed and the dispatch key set restored");
  }
}

TEST_F(FallbackTest, KeptOutputIsServedInTheRecompute) {
  auto region = c10::make_intrusive<Region>(Policy::create({"aten::tanh"}, {}));
  at::Tensor x = at::full({3}, 0.5);
  at::Tensor forward_out;
  CounterBaseline baseline = CounterBaseline::capture();
  {
    ActivationScope forward(ActivationKind::kForward, region.get());
    forward_out = at::sin(at::tanh(x));
  }
  EXPECT_EQ(region->keptCalls(), 1);
  EXPECT_EQ(region->keptBytes(), 3 * 4);
  at::Tensor recomputed;
  {
    ActivationScope recompute(ActivationKind::kRecompute, region.get());
    // Different input: a served output proves the kernel did not run.
    recomputed = at::tanh(at::full({3}, 2.0));
  }
  EXPECT_TRUE(at::equal(recomputed, at::tanh(x)));
  EXPECT_EQ(region->keptCalls(), 0);  // consumed and freed
  std::vector<AuditRow> rows = baseline.changesSince();
  EXPECT_EQ(countOf(rows, "aten::tanh", 0), 1u);
  EXPECT_EQ(countOf(rows, "aten::tanh", 1), 0u);
  EXPECT_EQ(countOf(rows, "aten::tanh", -1), 1u);
  EXPECT_EQ(countOf(rows, "aten::sin", 0), 1u);
}

TEST_F(FallbackTest, SecondRecomputeAfterConsumptionIsAnError) {
  auto region = c10::make_intrusive<Region>(Policy::create({"aten::tanh"}, {}));
  at::Tensor x = at::ones({2});
  {
    ActivationScope forward(ActivationKind::kForward, region.get());
    at::tanh(x);
  }
  {
    ActivationScope recompute(ActivationKind::kRecompute, region.get());
    at::tanh(x);
  }
  ActivationScope again(ActivationKind::kRecompute, region.get());
  try {
    at::tanh(x);
    FAIL() << "expected c10::Error";
  } catch (const c10::Error& error) {
    EXPECT_EQ(std::string(error.what_without_backtrace()),
              "sac: the kept output of aten::tanh (kept by the op list), call 1 of this region, was already used "
              "by an earlier backward and freed. Trying to backward an extra time: a selectively checkpointed "
              "region supports a second backward only when the first runs with retain_graph=True");
  }
}

TEST_F(FallbackTest, MutatedKeptTensorIsAnErrorNamingTheOpAndUnit) {
  auto region = c10::make_intrusive<Region>(Policy::create({}, {"attn"}));
  at::Tensor x = at::ones({2});
  at::Tensor kept;
  {
    ActivationScope forward(ActivationKind::kForward, region.get());
    UnitScope attn("attn");
    kept = at::tanh(x);
  }
  kept.add_(1);
  ActivationScope recompute(ActivationKind::kRecompute, region.get());
  UnitScope attn("attn");
  try {
    at::tanh(x);
    FAIL() << "expected c10::Error";
  } catch (const c10::Error& error) {
    EXPECT_EQ(std::string(error.what_without_backtrace()),
              "sac: a tensor kept for backward was mutated after it was saved: the output of aten::tanh (kept in "
              "unit 'attn'), call 1 of this region, changed version from 0 to 1. The recompute would read the "
              "mutated value; clone it before mutating in place, or do not keep aten::tanh");
  }
}

TEST_F(FallbackTest, RecomputeCallTheForwardDidNotMakeRunsItsKernel) {
  auto region = c10::make_intrusive<Region>(Policy::create({"aten::tanh"}, {}));
  at::Tensor x = at::full({2}, 0.5);
  at::Tensor y = at::full({2}, 0.25);
  {
    ActivationScope forward(ActivationKind::kForward, region.get());
    at::tanh(x);
  }
  CounterBaseline baseline = CounterBaseline::capture();
  at::Tensor served, extra;
  {
    ActivationScope recompute(ActivationKind::kRecompute, region.get());
    served = at::tanh(y);  // served: the forward's tanh(x)
    extra = at::tanh(y);   // the forward made one call only: this one runs
  }
  EXPECT_TRUE(at::allclose(served, at::tanh(x)));
  EXPECT_TRUE(at::allclose(extra, at::tanh(y)));
  std::vector<AuditRow> rows = baseline.changesSince();
  EXPECT_EQ(countOf(rows, "aten::tanh", -1), 1u);
  EXPECT_EQ(countOf(rows, "aten::tanh", 1), 1u);
}

TEST_F(FallbackTest, OnePassCallWithOtherShapesDoesNotShiftServing) {
  // A framework call of a kept op made in the forward only (FSDP2's all-gather path) must not
  // make the model's own call be served the framework call's output.
  auto region = c10::make_intrusive<Region>(Policy::create({"aten::mm"}, {}));
  at::Tensor a = at::full({2, 3}, 0.5), b = at::full({3, 4}, 0.25);
  at::Tensor framework = at::ones({5, 5});
  at::Tensor expected = at::mm(a, b);
  {
    ActivationScope forward(ActivationKind::kForward, region.get());
    at::mm(framework, framework);  // forward only
    at::mm(a, b);
  }
  at::Tensor served;
  {
    ActivationScope recompute(ActivationKind::kRecompute, region.get());
    served = at::mm(at::zeros({2, 3}), at::zeros({3, 4}));
  }
  EXPECT_TRUE(at::equal(served, expected));
}

TEST_F(FallbackTest, UnitsAroundTheForwardAreReopenedInTheRecompute) {
  auto region = c10::make_intrusive<Region>(Policy::create({}, {"attn"}));
  at::Tensor x = at::ones({2});
  {
    UnitScope attn("attn");
    ActivationScope forward(ActivationKind::kForward, region.get());
    at::tanh(x);  // kept: the unit was opened outside the checkpointed function
  }
  EXPECT_EQ(region->keptCalls(), 1);
  at::Tensor other_input = at::zeros({2});
  at::Tensor expected = at::tanh(x);
  at::Tensor served;
  {
    ActivationScope recompute(ActivationKind::kRecompute, region.get());
    EXPECT_EQ(UnitStack::current().depth(), 1u);
    served = at::tanh(other_input);
  }
  EXPECT_TRUE(at::equal(served, expected));
  EXPECT_EQ(region->keptCalls(), 0);
}

TEST_F(FallbackTest, OutVariantIsServedIntoTheOutArgument) {
  auto region = c10::make_intrusive<Region>(Policy::create({"aten::tanh.out"}, {}));
  at::Tensor x = at::full({2}, 0.25);
  {
    ActivationScope forward(ActivationKind::kForward, region.get());
    at::Tensor out = at::empty({2});
    at::tanh_out(out, x);
  }
  at::Tensor fresh = at::zeros({2});
  at::Tensor other_input = at::full({2}, 3.0);
  {
    ActivationScope recompute(ActivationKind::kRecompute, region.get());
    at::tanh_out(fresh, other_input);
  }
  EXPECT_TRUE(at::equal(fresh, at::tanh(x)));
}

TEST_F(FallbackTest, OpsInsideAKernelAreNotIntercepted) {
  // randn's kernel calls empty and normal_; only randn is a call of the checkpointed function.
  auto region = c10::make_intrusive<Region>(Policy::create({"aten::tanh"}, {}));
  CounterBaseline baseline = CounterBaseline::capture();
  {
    ActivationScope forward(ActivationKind::kForward, region.get());
    at::randn({2});
  }
  std::vector<AuditRow> rows = baseline.changesSince();
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].op, "aten::randn");
}

TEST_F(FallbackTest, KeptOutputWrittenInTheForwardIsRecomputedInstead) {
  auto region = c10::make_intrusive<Region>(Policy::create({"aten::tanh"}, {}));
  at::Tensor x = at::full({2}, 0.5);
  CounterBaseline baseline = CounterBaseline::capture();
  at::Tensor forward_out;
  {
    ActivationScope forward(ActivationKind::kForward, region.get());
    forward_out = at::tanh(x);
    forward_out.view({2}).add_(1);  // a write through a view of the kept output
  }
  EXPECT_EQ(region->keptCalls(), 0);
  at::Tensor recomputed;
  {
    ActivationScope recompute(ActivationKind::kRecompute, region.get());
    recomputed = at::tanh(x);
    recomputed.view({2}).add_(1);
  }
  EXPECT_TRUE(at::equal(recomputed, forward_out));
  std::vector<AuditRow> rows = baseline.changesSince();
  EXPECT_EQ(countOf(rows, "aten::tanh", 0), 1u);
  EXPECT_EQ(countOf(rows, "aten::tanh", 1), 1u);
  EXPECT_EQ(countOf(rows, "aten::tanh", -1), 0u);
}

TEST_F(FallbackTest, MetaTensorsPassThroughUncounted) {
  auto region = c10::make_intrusive<Region>(Policy::create({"aten::tanh"}, {}));
  at::Tensor meta = at::empty({2}, at::TensorOptions().device(at::kMeta));
  CounterBaseline baseline = CounterBaseline::capture();
  {
    ActivationScope forward(ActivationKind::kForward, region.get());
    at::tanh(meta);
  }
  EXPECT_EQ(region->keptCalls(), 0);
  EXPECT_TRUE(baseline.changesSince().empty());
}

TEST_F(FallbackTest, AnOpenActivationKeepsItsRegionAlive) {
  auto region = c10::make_intrusive<Region>(Policy::create({"aten::tanh"}, {}));
  c10::weak_intrusive_ptr<Region> observer(region);
  ThreadState& state = ThreadState::current();
  Region* raw = region.get();
  size_t depth = state.enter(ActivationKind::kForward, raw);
  region.reset();  // the owner lets go while the region is open
  EXPECT_FALSE(observer.expired());
  at::tanh(at::ones({2}));
  EXPECT_EQ(raw->keptCalls(), 1);
  state.exit(ActivationKind::kForward, raw, depth);
  EXPECT_TRUE(observer.expired());
}

TEST(CallSignatureTest, ShapesDtypesAndScalarsMatterValuesDoNot) {
  auto signature = [](std::vector<c10::IValue> arguments) { return callSignature(arguments.data(), arguments.size()); };
  at::Tensor a = at::zeros({2, 3}), b = at::ones({2, 3});
  EXPECT_EQ(signature({a, 1.0}), signature({b, 1.0}));
  EXPECT_NE(signature({a, 1.0}), signature({at::zeros({3, 2}), 1.0}));
  EXPECT_NE(signature({a, 1.0}), signature({a.to(at::kDouble), 1.0}));
  EXPECT_NE(signature({a, 1.0}), signature({a, 2.0}));
  EXPECT_NE(signature({a, std::vector<int64_t>{1, 2}}), signature({a, std::vector<int64_t>{2, 1}}));
  EXPECT_NE(signature({a}), signature({a, c10::IValue()}));
}

}  // namespace
}  // namespace sac
