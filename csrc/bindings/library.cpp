// The plugin's torchbind surface, in one TORCH_LIBRARY block: torch.classes.sac.* for objects
// with a lifetime (policies, regions, audits, call profiles), torch.ops.sac.* for stateless
// calls. The Python package `sac_plugin` is a thin layer over this and the C ABI (c_api.h),
// which is the way into scopes and the keep rule on hot paths; entry points only tests use are
// registered apart, in testing_ops.cpp.

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "diagnostics/audit.h"
#include "dispatch/call_profile.h"
#include "dispatch/call_trace.h"
#include "dispatch/fallback.h"
#include "dispatch/handed_out.h"
#include "dispatch/offload.h"
#include "dispatch/region.h"
#include "dispatch/region_scopes.h"
#include "dispatch/thread_state.h"
#include "ops/op_catalog.h"
#include "ops/op_resolution.h"
#include "ops/op_traits.h"
#include "policy/policy.h"
#include "policy/unit_stack.h"

#ifndef SAC_BUILT_FOR_TORCH
#error "SAC_BUILT_FOR_TORCH must name the torch version this plugin is compiled against"
#endif

namespace sac {
namespace {

// A call-index rule (op -> indices) as PolicySpec holds it, in the order Python gave the ops.
std::vector<std::pair<std::string, std::vector<int64_t>>> callRules(
    const c10::Dict<std::string, c10::List<int64_t>>& rules) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> spec;
  spec.reserve(rules.size());
  for (const auto& rule : rules) spec.emplace_back(rule.key(), rule.value().vec());
  return spec;
}

// Call-index rules travel back flattened: op i lists the next counts[i] values of indices.
std::tuple<std::vector<std::string>, std::vector<int64_t>, std::vector<int64_t>> flatCallRules(
    const std::vector<std::pair<std::string, std::vector<int64_t>>>& rules) {
  std::vector<std::string> ops;
  std::vector<int64_t> counts;
  std::vector<int64_t> indices;
  for (const auto& [op, calls] : rules) {
    ops.push_back(op);
    counts.push_back(static_cast<int64_t>(calls.size()));
    indices.insert(indices.end(), calls.begin(), calls.end());
  }
  return std::make_tuple(ops, counts, indices);
}

// NOTE: [A policy is built from named fields]
// torch.classes.sac.Policy takes PolicySpec's fields by name (the names below, registered with
// torch::arg), and sac_plugin.Policy passes each one as a keyword, so no argument can land in its
// neighbour's place; torch's schema check names a field left out and refuses one too many. The
// rules keyed by op cross as dicts (every_nth_ops: op -> n; kept_calls, offloaded_calls: op ->
// indices), in the order Python gave them. sac_plugin.Policy has checked every value by then.
struct PolicyHandle : torch::CustomClassHolder {
  PolicyHandle(std::vector<std::string> kept_ops, std::vector<std::string> kept_units,
               const c10::Dict<std::string, int64_t>& every_nth_ops, std::vector<std::string> recomputed_units,
               const c10::Dict<std::string, c10::List<int64_t>>& kept_calls, std::vector<std::string> offloaded_ops,
               std::vector<std::string> offloaded_units,
               const c10::Dict<std::string, c10::List<int64_t>>& offloaded_calls, int64_t offload_min_bytes,
               int64_t host_memory_limit, bool pin_routing) {
    PolicySpec spec;
    spec.kept_ops = std::move(kept_ops);
    spec.kept_units = std::move(kept_units);
    for (const auto& rule : every_nth_ops) spec.every_nth_ops.emplace_back(rule.key(), rule.value());
    spec.recomputed_units = std::move(recomputed_units);
    spec.kept_calls = callRules(kept_calls);
    spec.offloaded_ops = std::move(offloaded_ops);
    spec.offloaded_units = std::move(offloaded_units);
    spec.offloaded_calls = callRules(offloaded_calls);
    spec.offload_min_bytes = offload_min_bytes;
    spec.host_memory_limit = host_memory_limit;
    spec.pin_routing = pin_routing;
    policy = Policy::create(spec);
  }

  std::shared_ptr<const Policy> policy;
};

// A layer's profile (dispatch/call_profile.h): Python opens one profiling region per run.
using ProfileRows = std::tuple<std::vector<std::string>, std::vector<int64_t>, std::vector<std::string>,
                               std::vector<int64_t>, std::vector<std::string>, std::vector<double>>;

struct ProfileHandle : torch::CustomClassHolder {
  // A profiling region, as an owned RegionHandle* that Python enters through the C ABI like any
  // region (sac_region_enter, sac_region_exit) and releases with sac_region_release.
  int64_t newRegionAddress() {
    auto handle = c10::make_intrusive<RegionHandle>(c10::make_intrusive<Region>(keeps_nothing, profile));
    return reinterpret_cast<int64_t>(handle.release());
  }

  // Columns, one row per call of the first run: op, index among the op's calls, innermost unit
  // ("" for none), new output bytes, why it cannot be kept ("" when it can), and every run's
  // seconds, flattened call-major (runs() values per call).
  ProfileRows rows() const {
    ProfileRows columns;
    for (const ProfiledCall& call : profile->calls()) {
      std::get<0>(columns).push_back(call.op->traits.qualified_name);
      std::get<1>(columns).push_back(static_cast<int64_t>(call.index));
      std::get<2>(columns).push_back(call.unit == kNoUnit ? std::string() : unitName(call.unit));
      std::get<3>(columns).push_back(call.output_bytes);
      std::get<4>(columns).push_back(call.not_keepable);
      std::get<5>(columns).insert(std::get<5>(columns).end(), call.seconds.begin(), call.seconds.end());
    }
    return columns;
  }

  std::shared_ptr<CallProfile> profile = std::make_shared<CallProfile>();
  std::shared_ptr<const Policy> keeps_nothing = Policy::create(PolicySpec{});
};

// --- audits, counts and the per-op trace ---------------------------------------------------------

// Columns in AuditRow's order (python/sac_plugin/_audit.py).
using AuditRows = std::tuple<std::vector<std::string>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
                             std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>>;

AuditRows auditColumns(const std::vector<AuditRow>& rows) {
  AuditRows columns;
  for (const AuditRow& row : rows) {
    std::get<0>(columns).push_back(row.op);
    std::get<1>(columns).push_back(static_cast<int64_t>(row.counts.executions[0]));
    std::get<2>(columns).push_back(static_cast<int64_t>(row.counts.executions[1]));
    std::get<3>(columns).push_back(static_cast<int64_t>(row.counts.executions[2]));
    std::get<4>(columns).push_back(static_cast<int64_t>(row.counts.hits));
    std::get<5>(columns).push_back(static_cast<int64_t>(row.counts.never_served));
    std::get<6>(columns).push_back(static_cast<int64_t>(row.counts.never_served_bytes));
    std::get<7>(columns).push_back(static_cast<int64_t>(row.counts.skipped));
  }
  return columns;
}

struct AuditHandle : torch::CustomClassHolder {
  ~AuditHandle() override { scope.abandon(ActivationKind::kAudit, nullptr); }

  void start() {
    TORCH_CHECK(!started, "sac: an audit can be started once; create a new audit()");
    baseline = CounterBaseline::capture();
    scope.enter(ActivationKind::kAudit, nullptr);
    started = true;
  }
  void stop() {
    TORCH_CHECK(started && !stopped, "sac: stopping an audit that is not running; nothing was changed");
    scope.checkExit("an audit");
    final_rows = baseline.changesSince();
    stopped = true;
    scope.exit(ActivationKind::kAudit, nullptr);
  }
  bool running() const { return started && !stopped; }
  std::vector<AuditRow> rows() const { return stopped ? final_rows : baseline.changesSince(); }

  CounterBaseline baseline;
  OpenScope scope;
  bool started = false;
  bool stopped = false;
  std::vector<AuditRow> final_rows;
};

// This thread's counts since it was made, with no activation of its own: a report's per-pass and
// per-unit counts, taken inside the report's audit, which open and close in whatever order the
// passes and units of nested reports do.
struct CountsHandle : torch::CustomClassHolder {
  CounterBaseline baseline = CounterBaseline::capture();
};

using TraceRows =
    std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<std::string>, std::vector<std::string>>;

// A per-op trace (dispatch/call_trace.h); Python installs it on the thread of each region pass.
struct TraceHandle : torch::CustomClassHolder {
  // Columns, one row per call in the order decided: op, phase, outcome, innermost unit ("" none).
  TraceRows rows() const {
    TraceRows columns;
    for (const TracedCall& call : trace->calls()) {
      std::get<0>(columns).push_back(call.op->traits.qualified_name);
      std::get<1>(columns).push_back(phaseName(call.phase));
      std::get<2>(columns).push_back(callOutcomeName(call.outcome));
      std::get<3>(columns).push_back(call.unit == kNoUnit ? std::string() : unitName(call.unit));
    }
    return columns;
  }

  std::shared_ptr<CallTrace> trace = std::make_shared<CallTrace>();
};

// --- end of audits, counts and the per-op trace --------------------------------------------------

std::vector<std::string> openUnits() {
  std::vector<std::string> names;
  for (UnitId unit : UnitStack::current().units()) names.push_back(unitName(unit));
  return names;
}

std::vector<std::string> overloadNames(const std::string& spelling) {
  std::vector<std::string> names;
  for (const c10::OperatorHandle& op : resolveOpSpelling(spelling)) {
    names.push_back(qualifiedOpName(op.schema().name(), op.schema().overload_name()));
  }
  TORCH_CHECK_VALUE(!names.empty(), "sac: ", describeUnknownOp(spelling));
  return names;
}

using OpTraitsTuple = std::tuple<bool, bool, bool, bool, bool, int64_t>;

// The traits the fallback decides with, for Python's policy function under torch.compile, so the
// compiled and the eager selection read one classification.
OpTraitsTuple opTraits(const std::string& spelling) {
  std::vector<c10::OperatorHandle> handles = resolveOpSpelling(spelling);
  TORCH_CHECK_VALUE(handles.size() == 1, "sac: op_traits needs one overload such as 'aten::mm.default', got '",
                    spelling, "' (", handles.size(), " overloads)");
  const OpTraits& traits = lookupOp(handles.front()).traits;
  return {traits.is_collective,  traits.never_counts, traits.is_random,
          traits.mutates_inputs, traits.is_view,      traits.dropout_p_argument};
}

}  // namespace

TORCH_LIBRARY(sac, m) {
  // Registered first: region_at returns it. Every region, checkpoint or profiling, is made,
  // entered and exited through the C ABI (sac_region_new, sac_region_enter, sac_region_exit): the
  // one way into scopes. region_at gives one its queries.
  m.class_<RegionHandle>("Region")
      .def("kept_bytes", [](const c10::intrusive_ptr<RegionHandle>& self) { return self->region->keptBytes(); })
      .def("kept_calls", [](const c10::intrusive_ptr<RegionHandle>& self) { return self->region->keptCalls(); })
      .def("kept_tensors", [](const c10::intrusive_ptr<RegionHandle>& self) { return self->region->keptTensors(); })
      .def("offloaded_bytes",
           [](const c10::intrusive_ptr<RegionHandle>& self) { return self->region->offloadedBytes(); })
      .def("offloaded_calls",
           [](const c10::intrusive_ptr<RegionHandle>& self) { return self->region->offloadedCalls(); })
      .def("offloaded_input_bytes",
           [](const c10::intrusive_ptr<RegionHandle>& self) { return self->region->offloadedInputBytes(); })
      .def("offloaded_inputs",
           [](const c10::intrusive_ptr<RegionHandle>& self) { return self->region->offloadedInputs(); });

  m.class_<PolicyHandle>("Policy")
      // Fields by name (NOTE: [A policy is built from named fields]).
      .def(torch::init<std::vector<std::string>, std::vector<std::string>, c10::Dict<std::string, int64_t>,
                       std::vector<std::string>, c10::Dict<std::string, c10::List<int64_t>>, std::vector<std::string>,
                       std::vector<std::string>, c10::Dict<std::string, c10::List<int64_t>>, int64_t, int64_t, bool>(),
           "A policy from PolicySpec's fields, each passed by name",
           {torch::arg("kept_ops"), torch::arg("kept_units"), torch::arg("every_nth_ops"),
            torch::arg("recomputed_units"), torch::arg("kept_calls"), torch::arg("offloaded_ops"),
            torch::arg("offloaded_units"), torch::arg("offloaded_calls"), torch::arg("offload_min_bytes"),
            torch::arg("host_memory_limit"), torch::arg("pin_routing")})
      // For the C ABI (bindings/c_api.cpp): the address of this handle's policy pointer, valid
      // while the handle lives (the Python Policy holds it for its whole life).
      .def("policy_address",
           [](const c10::intrusive_ptr<PolicyHandle>& self) { return reinterpret_cast<int64_t>(&self->policy); })
      .def("kept_ops", [](const c10::intrusive_ptr<PolicyHandle>& self) { return self->policy->keptOpNames(); })
      .def("kept_units", [](const c10::intrusive_ptr<PolicyHandle>& self) { return self->policy->keptUnitNames(); })
      .def("recomputed_units",
           [](const c10::intrusive_ptr<PolicyHandle>& self) { return self->policy->recomputedUnitNames(); })
      .def("every_nth_ops",
           [](const c10::intrusive_ptr<PolicyHandle>& self) {
             std::vector<std::string> ops;
             std::vector<int64_t> every;
             for (const auto& [op, n] : self->policy->everyNthOps()) {
               ops.push_back(op);
               every.push_back(n);
             }
             return std::make_tuple(ops, every);
           })
      .def("kept_calls",
           [](const c10::intrusive_ptr<PolicyHandle>& self) { return flatCallRules(self->policy->keptCalls()); })
      .def("offloaded_ops",
           [](const c10::intrusive_ptr<PolicyHandle>& self) { return self->policy->offloadedOpNames(); })
      .def("offloaded_units",
           [](const c10::intrusive_ptr<PolicyHandle>& self) { return self->policy->offloadedUnitNames(); })
      .def("offloaded_calls",
           [](const c10::intrusive_ptr<PolicyHandle>& self) { return flatCallRules(self->policy->offloadedCalls()); })
      .def("pin_routing", [](const c10::intrusive_ptr<PolicyHandle>& self) { return self->policy->pinsRouting(); })
      .def("keeps_nothing", [](const c10::intrusive_ptr<PolicyHandle>& self) { return self->policy->keepsNothing(); });

  m.class_<ProfileHandle>("CallProfile")
      .def(torch::init<>())
      .def("new_region_address", [](const c10::intrusive_ptr<ProfileHandle>& self) { return self->newRegionAddress(); })
      .def("begin_run", [](const c10::intrusive_ptr<ProfileHandle>& self) { self->profile->beginRun(); })
      .def("end_run", [](const c10::intrusive_ptr<ProfileHandle>& self) { self->profile->endRun(); })
      .def("runs", [](const c10::intrusive_ptr<ProfileHandle>& self) { return self->profile->runs(); })
      .def("recorded_in_run",
           [](const c10::intrusive_ptr<ProfileHandle>& self) { return self->profile->recordedInRun(); })
      .def("note_layer_outputs",
           [](const c10::intrusive_ptr<ProfileHandle>& self, const std::vector<at::Tensor>& outputs) {
             self->profile->noteLayerOutputs(outputs);
           })
      .def("rows", [](const c10::intrusive_ptr<ProfileHandle>& self) { return self->rows(); });

  // Audits, counts and the per-op trace.
  m.class_<AuditHandle>("Audit")
      .def(torch::init<>())
      .def("start", [](const c10::intrusive_ptr<AuditHandle>& self) { self->start(); })
      .def("stop", [](const c10::intrusive_ptr<AuditHandle>& self) { self->stop(); })
      .def("running", [](const c10::intrusive_ptr<AuditHandle>& self) { return self->running(); })
      .def("rows", [](const c10::intrusive_ptr<AuditHandle>& self) { return auditColumns(self->rows()); })
      .def("table", [](const c10::intrusive_ptr<AuditHandle>& self) { return formatAuditTable(self->rows()); });
  m.class_<CountsHandle>("Counts").def(torch::init<>()).def("rows", [](const c10::intrusive_ptr<CountsHandle>& self) {
    return auditColumns(self->baseline.changesSince());
  });
  m.class_<TraceHandle>("CallTrace")
      .def(torch::init<>())
      .def("install", [](const c10::intrusive_ptr<TraceHandle>& self) { CallTrace::install(self->trace); })
      .def("uninstall", [](const c10::intrusive_ptr<TraceHandle>& self) { CallTrace::uninstall(self->trace.get()); })
      .def("size",
           [](const c10::intrusive_ptr<TraceHandle>& self) { return static_cast<int64_t>(self->trace->size()); })
      .def("rows", [](const c10::intrusive_ptr<TraceHandle>& self) { return self->rows(); });

  // The torchbind face of a region the scope C ABI created (sac_region_new), for the rare
  // accessors (kept bytes, kept tensors); shares ownership with the C reference.
  m.def("region_at(int address) -> __torch__.torch.classes.sac.Region", [](int64_t address) {
    // NOTE: [An address that comes back is checked] (dispatch/handed_out.h)
    RegionHandle& handle = HandedOut<RegionHandle>::at(address, "region_at", "a region (sac_region_new)");
    return c10::intrusive_ptr<RegionHandle>::unsafe_reclaim_from_nonowning(&handle);
  });
  m.def("install_fallback() -> str", []() { return std::string(interceptionPathName(installInterception())); });
  m.def("interception_path() -> str", []() { return std::string(interceptionPathName(interceptionPath())); });
  m.def("built_for_torch() -> str", []() { return std::string(SAC_BUILT_FOR_TORCH); });
  m.def("open_units() -> str[]", &openUnits);
  m.def("resolvable_op_names(str[] names) -> str[]", &resolvableOpNames);
  m.def("overloads_of(str spelling) -> str[]", &overloadNames);
  m.def("op_traits(str spelling) -> (bool, bool, bool, bool, bool, int)", &opTraits);
  // NOTE: [Offloading kept outputs] (dispatch/offload.cpp): copies each way with their bytes,
  // the pinned pool's bytes (all, in use, cached), its allocations and trims, and the exposed
  // copy time (us), in the order of sac_plugin.memory.OFFLOAD_STATS.
  m.def("offload_stats() -> int[]", []() {
    OffloadStats stats = offloadStats();
    return std::vector<int64_t>{stats.copies_to_host,     stats.bytes_to_host,    stats.copies_to_device,
                                stats.bytes_to_device,    stats.pool_bytes,       stats.pool_bytes_in_use,
                                stats.pool_bytes_cached,  stats.pool_allocations, stats.pool_trims,
                                stats.pool_bytes_trimmed, stats.exposed_copy_us};
  });
  m.def("empty_offload_pool() -> int", []() { return emptyOffloadPool(); });
  // NOTE: [Offloading a layer's inputs] (dispatch/offload.cpp): the function a checkpoint runs
  // hands its inputs to the innermost region on this thread at the end of its forward, and takes
  // them back in its recompute.
  // Answers (whether each input was offloaded, a warning for the user or "").
  m.def("region_hold_inputs(Tensor[] inputs, str[] names) -> (bool[], str)",
        [](const std::vector<at::Tensor>& inputs, const std::vector<std::string>& names) {
          ThreadState& state = ThreadState::current();
          TORCH_CHECK(state.region() != nullptr && !state.regionInRecompute(),
                      "sac: region_hold_inputs runs at the end of a checkpointed region's forward, and no region's "
                      "forward is open on this thread");
          std::string notice;
          std::vector<bool> offloaded = state.region()->inputsOwner()->holdInputs(inputs, names, &notice);
          c10::List<bool> answer;
          for (bool each : offloaded) answer.push_back(each);
          return std::make_tuple(answer, notice);
        });
  m.def("region_take_inputs() -> Tensor[]", []() {
    ThreadState& state = ThreadState::current();
    TORCH_CHECK(state.region() != nullptr && state.regionInRecompute(),
                "sac: region_take_inputs runs in a checkpointed region's recompute, and no region's recompute is "
                "open on this thread");
    return state.region()->inputsOwner()->takeInputs();
  });
}

}  // namespace sac
