#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "diagnostics/audit.h"
#include "dispatch/data_flow.h"
#include "dispatch/fallback.h"
#include "dispatch/region.h"
#include "dispatch/sac_key.h"
#include "dispatch/site.h"
#include "dispatch/thread_state.h"
#include "ops/op_catalog.h"
#include "policy/unit_stack.h"
#include "test_support.h"

namespace sac {
namespace {

bool keySetsEqual(const c10::impl::LocalDispatchKeySet& a, const c10::impl::LocalDispatchKeySet& b) {
  return a.included_ == b.included_ && a.excluded_ == b.excluded_;
}

bool sacKeyIncluded() { return c10::impl::tls_local_dispatch_key_set().included_.has(kSacKey); }

class FallbackTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(installInterception(), InterceptionPath::kNative);
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
  EXPECT_EQ(installInterception(), InterceptionPath::kNative);
  EXPECT_EQ(interceptionPath(), InterceptionPath::kNative);
  EXPECT_TRUE(c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(kSacKey));
}

TEST_F(FallbackTest, KeyIsIncludedOnlyInsideAnInterceptingRegion) {
  auto keeping = c10::make_intrusive<Region>(Policy::create({"aten::tanh"}, {}));
  {
    ActivationScope forward(ActivationKind::kForward, keeping.get());
    EXPECT_TRUE(sacKeyIncluded());
  }
  EXPECT_FALSE(sacKeyIncluded());
  // A policy that keeps nothing intercepts its site's forwards until one shows that the layer
  // writes nothing outside its region (NOTE: [The recompute writes nothing outside its region]).
  auto site = std::make_shared<Site>(Policy::create({}, {}));
  auto first = c10::make_intrusive<Region>(site);
  {
    ActivationScope forward(ActivationKind::kForward, first.get());
    EXPECT_TRUE(sacKeyIncluded());
  }
  EXPECT_EQ(site->outsideWritesSeen(), Site::OutsideWritesSeen::kNone);
  auto later = c10::make_intrusive<Region>(site);
  {
    ActivationScope forward(ActivationKind::kForward, later.get());
    EXPECT_FALSE(sacKeyIncluded());
  }
  // A site that only marks passes never intercepts.
  auto marker = c10::make_intrusive<Region>(std::make_shared<Site>(Policy::create({}, {}), "", false));
  {
    ActivationScope forward(ActivationKind::kForward, marker.get());
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
    recomputed = at::tanh(x);
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
  at::Tensor other, served, again;
  {
    ActivationScope recompute(ActivationKind::kRecompute, region.get());
    other = at::tanh(y);   // another input: not the forward's call, runs
    served = at::tanh(x);  // the forward's call: served
    again = at::tanh(x);   // a second identical call the forward never made: runs
  }
  EXPECT_TRUE(at::equal(other, at::tanh(y)));
  EXPECT_TRUE(at::equal(served, at::tanh(x)));
  EXPECT_TRUE(at::equal(again, at::tanh(x)));
  std::vector<AuditRow> rows = baseline.changesSince();
  EXPECT_EQ(countOf(rows, "aten::tanh", -1), 1u);
  EXPECT_EQ(countOf(rows, "aten::tanh", 1), 2u);
}

// A call of a kept op that the forward makes and the recompute does not (a no_grad cache filled
// on the first step, FSDP2's all-gather path) must not move what the model's own calls are
// served, whatever its shapes: the forward keeps both, the recompute is served only its own.
TEST_F(FallbackTest, OnePassCallsDoNotShiftServing) {
  auto region = c10::make_intrusive<Region>(Policy::create({"aten::mm"}, {}));
  at::Tensor a = at::full({2, 3}, 0.5), b = at::full({3, 4}, 0.25);
  at::Tensor cache_input = at::full({2, 3}, 2.0);  // same shapes as the model's call
  at::Tensor framework = at::ones({5, 5});
  at::Tensor forward_out;
  {
    ActivationScope forward(ActivationKind::kForward, region.get());
    at::mm(framework, framework);  // forward only, other shapes
    at::mm(cache_input, b);        // forward only, same shapes and the same weight
    forward_out = at::mm(a, b);
  }
  EXPECT_EQ(region->keptCalls(), 3);
  CounterBaseline baseline = CounterBaseline::capture();
  at::Tensor served;
  {
    ActivationScope recompute(ActivationKind::kRecompute, region.get());
    served = at::mm(a, b);
  }
  EXPECT_TRUE(at::equal(served, at::mm(a, b)));
  EXPECT_EQ(served.data_ptr(), forward_out.data_ptr());  // the forward's own output, not a twin
  EXPECT_EQ(countOf(baseline.changesSince(), "aten::mm", -1), 1u);
}

// The chain matters, not only the op: mm(tanh(a), b) in the recompute is served only if its tanh
// input descends from the same call as in the forward.
TEST_F(FallbackTest, ProvenanceFollowsTheChainOfCalls) {
  auto region = c10::make_intrusive<Region>(Policy::create({"aten::mm"}, {}));
  at::Tensor a = at::full({2, 3}, 0.5), c = at::full({2, 3}, -0.5), b = at::full({3, 4}, 0.25);
  at::Tensor forward_out;
  {
    ActivationScope forward(ActivationKind::kForward, region.get());
    forward_out = at::mm(at::tanh(a), b);
  }
  CounterBaseline baseline = CounterBaseline::capture();
  at::Tensor from_other_chain, served;
  {
    ActivationScope recompute(ActivationKind::kRecompute, region.get());
    from_other_chain = at::mm(at::tanh(c), b);  // same shapes, other origin: runs
    served = at::mm(at::tanh(a), b);
  }
  EXPECT_TRUE(at::equal(from_other_chain, at::mm(at::tanh(c), b)));
  EXPECT_EQ(served.data_ptr(), forward_out.data_ptr());
  std::vector<AuditRow> rows = baseline.changesSince();
  EXPECT_EQ(countOf(rows, "aten::mm", -1), 1u);
  EXPECT_EQ(countOf(rows, "aten::mm", 1), 1u);
}

// A read before an in-place write and a read after it name different values.
TEST_F(FallbackTest, InPlaceWritesChangeProvenance) {
  auto region = c10::make_intrusive<Region>(Policy::create({"aten::sin"}, {}));
  at::Tensor x = at::full({2}, 0.5);
  at::Tensor before_write, after_write;
  {
    ActivationScope forward(ActivationKind::kForward, region.get());
    at::Tensor h = at::tanh(x);
    before_write = at::sin(h);
    h.mul_(2);
    after_write = at::sin(h);
  }
  at::Tensor first, second;
  {
    ActivationScope recompute(ActivationKind::kRecompute, region.get());
    at::Tensor h = at::tanh(x);
    h.mul_(2);  // the write now comes first: sin(h) is the forward's second call, not its first
    second = at::sin(h);
  }
  EXPECT_EQ(second.data_ptr(), after_write.data_ptr());
  EXPECT_TRUE(at::equal(second, at::sin(at::tanh(x) * 2)));
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
  at::Tensor expected = at::tanh(x);
  at::Tensor served;
  {
    ActivationScope recompute(ActivationKind::kRecompute, region.get());
    EXPECT_EQ(UnitStack::current().depth(), 1u);
    served = at::tanh(x);
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
  CounterBaseline baseline = CounterBaseline::capture();
  at::Tensor fresh;
  {
    ActivationScope recompute(ActivationKind::kRecompute, region.get());
    fresh = at::empty({2});
    at::tanh_out(fresh, x);
  }
  EXPECT_TRUE(at::equal(fresh, at::tanh(x)));
  std::vector<AuditRow> rows = baseline.changesSince();
  EXPECT_EQ(countOf(rows, "aten::tanh.out", -1), 1u);
  EXPECT_EQ(countOf(rows, "aten::tanh.out", 1), 0u);
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

// NOTE: [Kept outputs written in the forward]: the region holds the value from before the write
// and serves it; the recompute applies the write again.
TEST_F(FallbackTest, KeptOutputWrittenInTheForwardIsServedAsTheCallMadeIt) {
  auto region = c10::make_intrusive<Region>(Policy::create({"aten::tanh"}, {}));
  at::Tensor x = at::full({2}, 0.5);
  CounterBaseline baseline = CounterBaseline::capture();
  at::Tensor forward_out;
  {
    ActivationScope forward(ActivationKind::kForward, region.get());
    forward_out = at::tanh(x);
    forward_out.view({2}).add_(1);  // a write through a view of the kept output
  }
  EXPECT_EQ(region->keptCalls(), 1);
  at::Tensor recomputed;
  at::Tensor served;
  {
    ActivationScope recompute(ActivationKind::kRecompute, region.get());
    recomputed = at::tanh(x);
    served = recomputed.clone();
    recomputed.view({2}).add_(1);
  }
  EXPECT_TRUE(at::equal(served, at::tanh(x)));  // the value before the write
  EXPECT_TRUE(at::equal(recomputed, forward_out));
  std::vector<AuditRow> rows = baseline.changesSince();
  EXPECT_EQ(countOf(rows, "aten::tanh", 0), 1u);
  EXPECT_EQ(countOf(rows, "aten::tanh", 1), 0u);
  EXPECT_EQ(countOf(rows, "aten::tanh", -1), 1u);
}

// A kept output in a tensor list cannot be stored as a view of a copy: a write into it releases
// the call, which the recompute runs again.
TEST_F(FallbackTest, KeptOutputInATensorListWrittenInTheForwardIsRecomputed) {
  auto region = c10::make_intrusive<Region>(Policy::create({"aten::_foreach_mul"}, {}));
  std::vector<at::Tensor> inputs{at::full({2}, 0.5), at::full({3}, 2.0)};
  CounterBaseline baseline = CounterBaseline::capture();
  std::vector<at::Tensor> forward_out;
  {
    ActivationScope forward(ActivationKind::kForward, region.get());
    forward_out = at::_foreach_mul(inputs, 3);
    EXPECT_EQ(region->keptCalls(), 1);
    forward_out[1].add_(1);
  }
  EXPECT_EQ(region->keptCalls(), 0);
  std::vector<at::Tensor> recomputed;
  {
    ActivationScope recompute(ActivationKind::kRecompute, region.get());
    recomputed = at::_foreach_mul(inputs, 3);
    recomputed[1].add_(1);
  }
  EXPECT_TRUE(at::equal(recomputed[0], forward_out[0]) && at::equal(recomputed[1], forward_out[1]));
  std::vector<AuditRow> rows = baseline.changesSince();
  EXPECT_EQ(countOf(rows, "aten::_foreach_mul.Scalar", 1), 1u);
  EXPECT_EQ(countOf(rows, "aten::_foreach_mul.Scalar", -1), 0u);
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

// Tensors that carry the key in their own key set belong to another owner of the key (a C++
// FakeTensor): they pass through, uncounted and never kept.
TEST_F(FallbackTest, TensorsCarryingTheKeyPassThroughUncounted) {
  auto region = c10::make_intrusive<Region>(Policy::create({"aten::tanh"}, {}));
  at::Tensor real = at::full({3}, 0.5);
  auto impl =
      c10::make_intrusive<c10::TensorImpl>(c10::Storage(real.storage()), real.key_set().add(kSacKey), real.dtype());
  impl->set_sizes_and_strides(real.sizes(), real.strides(), real.storage_offset());
  at::Tensor carrying(std::move(impl));
  CounterBaseline baseline = CounterBaseline::capture();
  at::Tensor out;
  {
    ActivationScope forward(ActivationKind::kForward, region.get());
    out = at::tanh(carrying);
  }
  EXPECT_TRUE(at::equal(out, at::tanh(real)));
  EXPECT_EQ(region->keptCalls(), 0);
  EXPECT_TRUE(baseline.changesSince().empty());
}

// An activation that finds the key already included neither adds nor removes it, and leaves
// every other bit as it is on exit.
TEST_F(FallbackTest, OnlyTheBitAnActivationAddedIsCleared) {
  auto region = c10::make_intrusive<Region>(Policy::create({"aten::tanh"}, {}));
  {
    ActivationScope forward(ActivationKind::kForward, region.get());
    c10::impl::tls_set_dispatch_key_included(c10::DispatchKey::PythonTLSSnapshot, true);
  }
  EXPECT_FALSE(sacKeyIncluded());
  EXPECT_TRUE(c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::PythonTLSSnapshot));
  c10::impl::tls_set_dispatch_key_included(c10::DispatchKey::PythonTLSSnapshot, false);
  c10::impl::tls_set_dispatch_key_included(kSacKey, true);
  {
    ActivationScope forward(ActivationKind::kForward, region.get());
  }
  EXPECT_TRUE(sacKeyIncluded());  // not ours to clear
  c10::impl::tls_set_dispatch_key_included(kSacKey, false);
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

TEST(DataFlowTest, IdentityNamesOriginsNotValues) {
  const OpEntry& tanh = lookupOp(*c10::Dispatcher::singleton().findSchema({"aten::tanh", ""}));
  auto identify = [&](DataFlow& flow, std::vector<c10::IValue> arguments) {
    return flow.identify(tanh, arguments.data(), arguments.size());
  };
  at::Tensor a = at::zeros({2, 3}), b = at::zeros({2, 3});
  DataFlow first, second;
  first.reset(1, 0);
  second.reset(2, 0);
  // The same external tensor in two passes: the same identity; a same-shaped other tensor: not.
  uint64_t first_a = identify(first, {a});
  EXPECT_EQ(first_a, identify(second, {a}));
  EXPECT_NE(identify(first, {b}), identify(second, {at::zeros({2, 3})}));
  // A repeat of the same call in one pass is told apart by order, the same way in both passes.
  uint64_t first_a_again = identify(first, {a});
  EXPECT_NE(first_a_again, first_a);
  EXPECT_EQ(first_a_again, identify(second, {a}));
  // Views are named by geometry, scalars and int lists by value.
  DataFlow flow;
  flow.reset(3, 0);
  EXPECT_NE(identify(flow, {a.view({3, 2})}), identify(flow, {a.view({6})}));
  EXPECT_NE(identify(flow, {a, 1.0}), identify(flow, {a, 2.0}));
  EXPECT_NE(identify(flow, {a, std::vector<int64_t>{1, 2}}), identify(flow, {a, std::vector<int64_t>{2, 1}}));
}

TEST(DataFlowTest, GradModeIsPartOfTheIdentity) {
  const OpEntry& tanh = lookupOp(*c10::Dispatcher::singleton().findSchema({"aten::tanh", ""}));
  at::Tensor a = at::zeros({2});
  std::vector<c10::IValue> arguments{a};
  DataFlow with_grad, without_grad;
  with_grad.reset(1, 0);
  without_grad.reset(2, 0);
  uint64_t enabled = with_grad.identify(tanh, arguments.data(), 1);
  c10::AutoGradMode no_grad(false);
  EXPECT_NE(without_grad.identify(tanh, arguments.data(), 1), enabled);
}

TEST(DataFlowTest, TensorsWithoutANameableOriginNeverMatchAcrossPasses) {
  const OpEntry& tanh = lookupOp(*c10::Dispatcher::singleton().findSchema({"aten::tanh", ""}));
  at::Tensor sparse = at::zeros({2, 2}).to_sparse();
  std::vector<c10::IValue> arguments{sparse};
  DataFlow first, second;
  first.reset(1, 0);
  second.reset(2, 0);
  EXPECT_NE(first.identify(tanh, arguments.data(), 1), second.identify(tanh, arguments.data(), 1));
}

TEST(DataFlowTest, RecordsNameAStorageByItsLatestProducerAndHoldNoReference) {
  const c10::OperatorHandle handle = *c10::Dispatcher::singleton().findSchema({"aten::tanh", ""});
  const OpEntry& tanh = lookupOp(handle);
  const c10::FunctionSchema& schema = handle.schema();
  at::Tensor output = at::zeros({2});
  c10::weak_intrusive_ptr<c10::StorageImpl> watch = output.storage().getWeakStorageImpl();
  const size_t weak_references = watch.weak_use_count();
  auto consumer = [&](DataFlow& flow) {
    std::vector<c10::IValue> arguments{output};
    return flow.identify(tanh, arguments.data(), arguments.size());
  };
  // A storage produced at an address a dead storage held is recorded as that address's new
  // producer: the same storage recorded by a second call stands in for it.
  DataFlow first, second;
  first.reset(1, 0);
  second.reset(2, 0);
  torch::jit::Stack stack{at::zeros({2}), output};
  first.recordCall(/*call=*/11, schema, stack, 1, {});
  first.recordCall(/*call=*/12, schema, stack, 1, {});
  second.recordCall(/*call=*/12, schema, stack, 1, {});
  EXPECT_EQ(consumer(first), consumer(second));
  DataFlow third;
  third.reset(3, 0);
  third.recordCall(/*call=*/11, schema, stack, 1, {});
  EXPECT_NE(consumer(third), consumer(second));
  // No record keeps the storage, or its address, alive.
  EXPECT_EQ(watch.weak_use_count(), weak_references);
}

}  // namespace
}  // namespace sac
