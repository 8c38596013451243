// The C ABI (NOTE: [Scopes through a C ABI] in c_api.h): thin wrappers over RegionHandle,
// UnitStack, Policy::decide and CallDecider that turn every exception into a status and a message.

#include "bindings/c_api.h"

#include <c10/util/Exception.h>

#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "dispatch/handed_out.h"
#include "dispatch/region_scopes.h"
#include "ops/op_catalog.h"
#include "ops/op_resolution.h"
#include "policy/offload_rule.h"
#include "policy/policy.h"
#include "policy/unit_stack.h"

namespace sac {
namespace {

std::string& lastError() {
  thread_local std::string message;
  return message;
}

// Runs `body`; on an exception records its message and returns the status of its Python type.
template <typename Body>
int32_t guarded(Body&& body) noexcept {
  try {
    body();
    return kSacScopeOk;
  } catch (const c10::ValueError& error) {
    lastError() = error.what_without_backtrace();
    return kSacScopeValueError;
  } catch (const c10::Error& error) {
    lastError() = error.what_without_backtrace();
    return kSacScopeRuntimeError;
  } catch (const std::exception& error) {
    lastError() = error.what();
    return kSacScopeRuntimeError;
  } catch (...) {
    lastError() = "sac: unknown C++ exception";
    return kSacScopeRuntimeError;
  }
}

ActivationKind kindOf(int32_t recompute) {
  return recompute != 0 ? ActivationKind::kRecompute : ActivationKind::kForward;
}

// Ids cross the ABI as id + 1, so that 0 can mean "failed".
// A region opening (NOTE: [Region openings carry their flag] in unit_stack.h) is valid when
// the unit it opens is.
bool validUnit(int64_t id_plus_one) {
  if (id_plus_one < 1 || id_plus_one - 1 > int64_t{UINT32_MAX} - 1) return false;
  const UnitId unit = static_cast<UnitId>(id_plus_one - 1);
  if (unit != baseUnit(unit) && !isRegionOpening(unit)) return false;
  return static_cast<size_t>(baseUnit(unit)) < internedUnitCount();
}

constexpr int32_t kFactDrawsRandom = 1;
constexpr int32_t kFactCastsAParameter = 2;
constexpr int32_t kFactRoutesTokens = 4;
constexpr int32_t kFactRoutingFromOp = 8;

// The open units of a decision, as the policy reads them: ids checked, in a per-thread vector
// that keeps its capacity, so a decision allocates nothing once warm.
const std::vector<UnitId>& openUnits(const int64_t* unit_ids_plus_one, int64_t unit_count) {
  thread_local std::vector<UnitId> units;
  TORCH_CHECK_VALUE(unit_count >= 0 && (unit_count == 0 || unit_ids_plus_one != nullptr),
                    "sac: a decision needs unit_count >= 0 and the unit ids, got ", unit_count, " units");
  units.clear();
  for (int64_t i = 0; i < unit_count; ++i) {
    TORCH_CHECK_VALUE(validUnit(unit_ids_plus_one[i]), "sac: no recompute unit has id ", unit_ids_plus_one[i] - 1,
                      " (units cross the C ABI as sac_unit_id returns them: id + 1)");
    units.push_back(static_cast<UnitId>(unit_ids_plus_one[i] - 1));
  }
  return units;
}

CallFacts callFacts(int32_t facts, const OpEntry& op) {
  TORCH_CHECK_VALUE((facts & ~(kFactDrawsRandom | kFactCastsAParameter | kFactRoutesTokens | kFactRoutingFromOp)) == 0,
                    "sac: call facts are bit 0 (draws random numbers), bit 1 (casts a parameter), bit 2 (routes "
                    "tokens) and bit 3 (whether it routes tokens follows from the op), got ",
                    facts);
  CallFacts call;
  call.draws_random = (facts & kFactDrawsRandom) != 0;
  call.casts_a_parameter = (facts & kFactCastsAParameter) != 0;
  call.routes_tokens =
      (facts & kFactRoutesTokens) != 0 || ((facts & kFactRoutingFromOp) != 0 && routesTokens(op.traits, nullptr));
  return call;
}

const OpEntry& entryAt(const void* op_entry) {
  TORCH_CHECK_VALUE(op_entry != nullptr, "sac: a decision needs the op entry sac_op_entry returned, got null");
  return *static_cast<const OpEntry*>(op_entry);
}

// The layout c_api.h documents.
int64_t encode(const Decision& decision) {
  int64_t unit_plus_one = decision.unit == kNoUnit ? 0 : static_cast<int64_t>(decision.unit) + 1;
  return static_cast<int64_t>(decision.outcome) | (static_cast<int64_t>(decision.reason) << 8) |
         (decision.mutating_in_kept_unit ? int64_t{1} << 16 : 0) |
         (decision.random_call_of_kept_op ? int64_t{1} << 17 : 0) | (unit_plus_one << 32);
}

// The one overload `name` names (see sac_op_entry in c_api.h).
const OpEntry& singleOverload(const std::string& name) {
  std::vector<c10::OperatorHandle> handles = resolveOpSpelling(name);
  TORCH_CHECK_VALUE(!handles.empty(), "sac: ", describeUnknownOp(name));
  if (handles.size() == 1) return lookupOp(handles.front());
  const OpEntry* match = nullptr;
  for (const c10::OperatorHandle& handle : handles) {
    const OpEntry& entry = lookupOp(handle);
    if (entry.traits.qualified_name == name) match = &entry;
  }
  TORCH_CHECK_VALUE(match != nullptr, "sac: '", printableName(name), "' names ", handles.size(),
                    " overloads; name one, such as '", lookupOp(handles.front()).traits.qualified_name, "'");
  return *match;
}

}  // namespace
}  // namespace sac

using sac::guarded;

SAC_C_API int32_t sac_scope_c_api_version() { return kSacCApiVersion; }

SAC_C_API void* sac_site_new(const void* policy_address, const char* label, int32_t watches_outside_writes) {
  if (policy_address == nullptr) return nullptr;
  const auto& policy = *static_cast<const std::shared_ptr<const sac::Policy>*>(policy_address);
  void* site = nullptr;
  guarded([&] {
    auto* holder = new std::shared_ptr<sac::Site>(
        std::make_shared<sac::Site>(policy, label == nullptr ? "" : label, watches_outside_writes != 0));
    sac::HandedOut<std::shared_ptr<sac::Site>>::add(holder);  // NOTE: [An address that comes back is checked]
    site = holder;
  });
  return site;
}

SAC_C_API int32_t sac_site_outside_writes(const void* site) {
  if (site == nullptr) return 0;
  return static_cast<int32_t>((*static_cast<const std::shared_ptr<sac::Site>*>(site))->outsideWritesSeen());
}

SAC_C_API void sac_site_release(void* site) {
  auto* holder = static_cast<std::shared_ptr<sac::Site>*>(site);
  sac::HandedOut<std::shared_ptr<sac::Site>>::remove(holder);
  delete holder;
}

SAC_C_API void* sac_region_new(const void* site_address) {
  if (site_address == nullptr) return nullptr;
  const auto& site = *static_cast<const std::shared_ptr<sac::Site>*>(site_address);
  void* region = nullptr;
  guarded([&] { region = c10::make_intrusive<sac::RegionHandle>(site).release(); });
  return region;
}

SAC_C_API void sac_region_release(void* region) {
  if (region == nullptr) return;
  // Adopts the reference sac_region_new handed out; the handle's destructor closes a scope still
  // open on this thread (NOTE: [Scopes are checked before they change anything]).
  c10::intrusive_ptr<sac::RegionHandle>::reclaim(static_cast<sac::RegionHandle*>(region));
}

SAC_C_API int64_t sac_region_enter(void* region, int32_t recompute) {
  int64_t depth = 0;
  int32_t status = guarded([&] { depth = static_cast<sac::RegionHandle*>(region)->enter(sac::kindOf(recompute)); });
  return status == kSacScopeOk ? depth : -status;
}

SAC_C_API int32_t sac_region_exit(void* region, int32_t recompute, int64_t depth) {
  return guarded([&] { static_cast<sac::RegionHandle*>(region)->exit(sac::kindOf(recompute), depth); });
}

SAC_C_API int64_t sac_region_forward_position(void* region) {
  return static_cast<sac::RegionHandle*>(region)->region->forwardPosition();
}

SAC_C_API int64_t sac_region_release_unreached(void* region, int64_t last_saved_position) {
  int64_t released = 0;
  int32_t status = guarded(
      [&] { released = static_cast<sac::RegionHandle*>(region)->region->releaseUnreached(last_saved_position); });
  return status == kSacScopeOk ? released : -status;
}

SAC_C_API int32_t sac_site_dead_calls(const void* site) {
  if (site == nullptr) return 0;
  return static_cast<int32_t>((*static_cast<const std::shared_ptr<sac::Site>*>(site))->deadCallsSeen());
}

SAC_C_API int32_t sac_region_watch_saves(void* region) {
  sac::Region& watched = *static_cast<sac::RegionHandle*>(region)->region;
  watched.watchSaves();
  return watched.deadCalls().tracking() ? 1 : 0;
}

SAC_C_API void sac_region_note_saved(void* region, uintptr_t storage) {
  sac::DeadCalls& dead = static_cast<sac::RegionHandle*>(region)->region->deadCalls();
  if (storage == 0) {
    dead.noteWhatItCannotFollow();
  } else {
    dead.noteSaved(storage);
  }
}

SAC_C_API int64_t sac_unit_id(const char* name, int64_t length) {
  int64_t id_plus_one = 0;
  int32_t status = guarded([&] {
    TORCH_CHECK_VALUE(name != nullptr && length >= 0, "sac: a recompute unit needs a name");
    id_plus_one = static_cast<int64_t>(sac::internUnit(std::string(name, static_cast<size_t>(length)))) + 1;
  });
  return status == kSacScopeOk ? id_plus_one : -status;
}

SAC_C_API int64_t sac_unit_push(int64_t unit_id_plus_one) {
  int64_t depth = 0;
  int32_t status = guarded([&] {
    TORCH_CHECK_VALUE(sac::validUnit(unit_id_plus_one), "sac: no recompute unit has id ", unit_id_plus_one - 1);
    depth = static_cast<int64_t>(sac::UnitStack::current().push(static_cast<sac::UnitId>(unit_id_plus_one - 1)));
  });
  return status == kSacScopeOk ? depth : -status;
}

SAC_C_API int32_t sac_unit_pop(int64_t unit_id_plus_one, int64_t depth) {
  return guarded([&] {
    TORCH_CHECK_VALUE(sac::validUnit(unit_id_plus_one), "sac: no recompute unit has id ", unit_id_plus_one - 1);
    TORCH_CHECK_VALUE(depth > 0, "sac: unit depth must be positive, got ", depth);
    sac::UnitStack::current().pop(static_cast<sac::UnitId>(unit_id_plus_one - 1), static_cast<size_t>(depth));
  });
}

SAC_C_API const char* sac_scope_last_error() { return sac::lastError().c_str(); }

SAC_C_API const void* sac_op_entry(const char* name, int64_t length) {
  const void* entry = nullptr;
  guarded([&] {
    TORCH_CHECK_VALUE(name != nullptr && length >= 0, "sac: sac_op_entry needs an op name");
    entry = &sac::singleOverload(std::string(name, static_cast<size_t>(length)));
  });
  return entry;
}

SAC_C_API void* sac_call_decider_new(const void* policy_address) {
  void* decider = nullptr;
  guarded([&] {
    TORCH_CHECK_VALUE(policy_address != nullptr, "sac: a call decider needs a policy address, got null");
    decider = new sac::CallDecider(*static_cast<const std::shared_ptr<const sac::Policy>*>(policy_address));
  });
  return decider;
}

SAC_C_API void sac_call_decider_release(void* decider) { delete static_cast<sac::CallDecider*>(decider); }

SAC_C_API int64_t sac_call_decider_decide(void* decider, const void* op_entry, int32_t pass,
                                          const int64_t* unit_ids_plus_one, int64_t unit_count, int32_t facts) {
  int64_t result = 0;
  int32_t status = guarded([&] {
    TORCH_CHECK_VALUE(decider != nullptr, "sac: a decision needs the decider sac_call_decider_new returned, got null");
    TORCH_CHECK_VALUE(pass == 0 || pass == 1, "sac: pass is 0 (forward) or 1 (recompute), got ", pass);
    result = sac::encode(static_cast<sac::CallDecider*>(decider)->decide(
        sac::entryAt(op_entry), pass == 0 ? sac::Pass::kForward : sac::Pass::kRecompute,
        sac::openUnits(unit_ids_plus_one, unit_count), sac::callFacts(facts, sac::entryAt(op_entry))));
  });
  return status == kSacScopeOk ? result : -status;
}

SAC_C_API int64_t sac_policy_decide(const void* policy_address, const void* op_entry, const int64_t* unit_ids_plus_one,
                                    int64_t unit_count, int64_t call_index, int32_t facts) {
  int64_t result = 0;
  int32_t status = guarded([&] {
    TORCH_CHECK_VALUE(policy_address != nullptr, "sac: a decision needs a policy address, got null");
    TORCH_CHECK_VALUE(call_index >= 0, "sac: a call index counts from 0, got ", call_index);
    sac::CallFacts call = sac::callFacts(facts, sac::entryAt(op_entry));
    call.call_index = static_cast<uint64_t>(call_index);
    const auto& policy = *static_cast<const std::shared_ptr<const sac::Policy>*>(policy_address);
    result = sac::encode(policy->decide(sac::entryAt(op_entry), sac::openUnits(unit_ids_plus_one, unit_count), call));
  });
  return status == kSacScopeOk ? result : -status;
}

SAC_C_API const char* sac_reason_text(int32_t reason) {
  if (reason < 0 || reason >= sac::kNumReasons) return nullptr;
  return sac::reasonText(static_cast<sac::Reason>(reason));
}

// --- Where an offloaded call's outputs live ---------------------------------------------------------

SAC_C_API int32_t sac_offload_placement(int64_t bytes, int64_t reserved_host_bytes, int64_t offload_min_bytes,
                                        int64_t host_memory_limit) {
  return static_cast<int32_t>(sac::offloadPlacement(bytes, reserved_host_bytes, offload_min_bytes, host_memory_limit));
}
