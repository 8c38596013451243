// The scope C ABI (NOTE: [Scopes through a C ABI] in scope_c_api.h): thin wrappers over
// RegionHandle and UnitStack that turn every exception into a status and a message.

#include "dispatch/scope_c_api.h"

#include <c10/util/Exception.h>

#include <exception>
#include <memory>
#include <string>

#include "dispatch/region_scopes.h"
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

ActivationKind kindOf(int32_t recompute) { return recompute != 0 ? ActivationKind::kRecompute : ActivationKind::kForward; }

// Ids cross the ABI as id + 1, so that 0 can mean "failed".
bool validUnit(int64_t id_plus_one) {
  return id_plus_one >= 1 && static_cast<size_t>(id_plus_one - 1) < internedUnitCount();
}

}  // namespace
}  // namespace sac

using sac::guarded;

SAC_C_API int32_t sac_scope_c_api_version() { return kSacScopeCApiVersion; }

SAC_C_API void* sac_region_new(const void* policy_address) {
  if (policy_address == nullptr) return nullptr;
  const auto& policy = *static_cast<const std::shared_ptr<const sac::Policy>*>(policy_address);
  void* region = nullptr;
  guarded([&] { region = c10::make_intrusive<sac::RegionHandle>(policy).release(); });
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
