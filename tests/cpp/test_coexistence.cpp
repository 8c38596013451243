// The coexisting path, in a process where another library (tests/support/foreign_fake_owner.cpp,
// linked into this binary) registered a fallback on the plugin's key before the plugin installs
// its interception: the plugin must still work, and the other owner must see exactly the calls
// it sees without the plugin.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <gtest/gtest.h>
#include <torch/library.h>

#include "diagnostics/audit.h"
#include "dispatch/fallback.h"
#include "dispatch/region.h"
#include "dispatch/sac_key.h"
#include "dispatch/thread_state.h"
#include "test_support.h"

namespace sac {
namespace {

void setOwnerMode(bool on) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("sac_test_foreign::set_mode", "").typed<void(bool)>();
  op.call(on);
}

int64_t ownerActed() {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("sac_test_foreign::acted_calls", "").typed<int64_t()>();
  return op.call();
}

at::Tensor ownersTensor(const at::Tensor& tensor) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("sac_test_foreign::mark", "")
                       .typed<at::Tensor(const at::Tensor&)>();
  return op.call(tensor);
}

// The model of a region: tanh kept, sin recomputed.
at::Tensor layer(const at::Tensor& x) { return at::sin(at::tanh(x)); }

class CoexistenceTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(installInterception(), InterceptionPath::kCoexisting); }
  void TearDown() override {
    EXPECT_FALSE(c10::impl::tls_is_dispatch_key_included(kSacKey));
    EXPECT_EQ(ThreadState::current().depth(), 0u);
  }
};

TEST_F(CoexistenceTest, TheKeyIsSharedNotRefused) {
  EXPECT_TRUE(c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(kSacKey));
  EXPECT_EQ(interceptionPath(), InterceptionPath::kCoexisting);
  EXPECT_EQ(installInterception(), InterceptionPath::kCoexisting);  // idempotent
}

TEST_F(CoexistenceTest, RegionsWorkAndTheOwnerSeesNoneOfTheirCalls) {
  auto region = c10::make_intrusive<Region>(Policy::create({"aten::tanh"}, {}));
  at::Tensor x = at::full({3}, 0.5);
  int64_t acted = ownerActed();
  CounterBaseline baseline = CounterBaseline::capture();
  at::Tensor forward_out, recomputed;
  {
    ActivationScope forward(ActivationKind::kForward, region.get());
    forward_out = layer(x);
  }
  EXPECT_EQ(region->keptCalls(), 1);
  {
    ActivationScope recompute(ActivationKind::kRecompute, region.get());
    recomputed = layer(x);
  }
  EXPECT_TRUE(at::equal(recomputed, forward_out));
  std::vector<AuditRow> rows = baseline.changesSince();
  EXPECT_EQ(countOf(rows, "aten::tanh", -1), 1u);
  EXPECT_EQ(countOf(rows, "aten::sin", 1), 1u);
  EXPECT_EQ(ownerActed(), acted);
}

TEST_F(CoexistenceTest, TheOwnersModeGetsEveryCallInsideARegionItEnclosesAndTheKeyStaysItsOwn) {
  auto region = c10::make_intrusive<Region>(Policy::create({"aten::tanh"}, {}));
  at::Tensor x = at::full({3}, 0.5);
  int64_t acted = ownerActed();
  setOwnerMode(true);
  CounterBaseline baseline = CounterBaseline::capture();
  {
    ActivationScope forward(ActivationKind::kForward, region.get());
    layer(x);
  }
  // The key was the owner's when the region began: the region keeps nothing and counts nothing.
  EXPECT_EQ(region->keptCalls(), 0);
  EXPECT_TRUE(baseline.changesSince().empty());
  EXPECT_TRUE(c10::impl::tls_is_dispatch_key_included(kSacKey));  // still the owner's
  setOwnerMode(false);
  EXPECT_EQ(ownerActed(), acted + 2);  // tanh and sin, as without the plugin
}

TEST_F(CoexistenceTest, TheOwnersTensorsPassThroughUncounted) {
  auto region = c10::make_intrusive<Region>(Policy::create({"aten::tanh"}, {}));
  at::Tensor owners = ownersTensor(at::full({3}, 0.5));
  int64_t acted = ownerActed();
  CounterBaseline baseline = CounterBaseline::capture();
  {
    ActivationScope forward(ActivationKind::kForward, region.get());
    at::tanh(owners);
  }
  EXPECT_EQ(region->keptCalls(), 0);
  EXPECT_TRUE(baseline.changesSince().empty());
  EXPECT_EQ(ownerActed(), acted + 1);
}

TEST_F(CoexistenceTest, OpsDefinedAfterInstallAreInterceptedToo) {
  static torch::Library* library = nullptr;  // the op outlives the test
  if (library == nullptr) {
    library = new torch::Library(torch::Library::DEF, "sac_test_late", std::nullopt, __FILE__, __LINE__);
    library->def("twice(Tensor x) -> Tensor");
    library->impl("twice", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd,
                                           [](const at::Tensor& x) { return x * 2; }));
  }
  auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("sac_test_late::twice", "").typed<at::Tensor(const at::Tensor&)>();
  auto region = c10::make_intrusive<Region>(Policy::create({"sac_test_late::twice"}, {}));
  at::Tensor x = at::full({2}, 0.5);
  int64_t acted = ownerActed();
  CounterBaseline baseline = CounterBaseline::capture();
  {
    ActivationScope forward(ActivationKind::kForward, region.get());
    op.call(x);
  }
  EXPECT_EQ(region->keptCalls(), 1);
  EXPECT_EQ(countOf(baseline.changesSince(), "sac_test_late::twice", 0), 1u);
  EXPECT_EQ(ownerActed(), acted);
}

TEST_F(CoexistenceTest, OnlyOurBitIsCleared) {
  auto region = c10::make_intrusive<Region>(Policy::create({"aten::tanh"}, {}));
  {
    ActivationScope forward(ActivationKind::kForward, region.get());
    EXPECT_TRUE(c10::impl::tls_is_dispatch_key_included(kSacKey));
    // Another bit changed inside the region survives its exit.
    c10::impl::tls_set_dispatch_key_included(c10::DispatchKey::PythonTLSSnapshot, true);
  }
  EXPECT_TRUE(c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::PythonTLSSnapshot));
  c10::impl::tls_set_dispatch_key_included(c10::DispatchKey::PythonTLSSnapshot, false);
}

}  // namespace
}  // namespace sac
