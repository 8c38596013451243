#pragma once
// The scopes a checkpointed step opens and closes from Python, as plain C functions: a region
// (created once per checkpoint call, its forward and recompute entered and exited) and a
// recompute unit. Python calls them through ctypes (sac_plugin/_scopes.py).
//
// NOTE: [Scopes through a C ABI]
// Each checkpoint call creates a region and enters and exits two scopes; a model with units
// opens a unit per attention or MLP call. Through torchbind, each of those calls cost 3-5 us
// warm and 10+ us in a real step (pybind11 dispatch, a ScriptMethod per attribute lookup, a
// schema match, the GIL released and taken back), which made a region's fixed cost larger than
// the interception of 100 ops. A ctypes call of a C function costs ~0.4 us. The functions here
// take and return only integers and pointers, never throw (every exception becomes a status
// and a per-thread message, with its Python type), and do exactly what the torchbind methods
// do, through the same RegionHandle and UnitStack code, so the checks are identical.
//
// Python finds these symbols in the library torch.ops.load_library loaded (ctypes.CDLL on the
// same path returns the same handle), so SAC_PLUGIN_LIBRARY builds serve them too.

#include <cstdint>

#define SAC_C_API extern "C" __attribute__((visibility("default")))

// Bumped when a signature or a meaning changes; Python refuses a library with another version.
inline constexpr int32_t kSacScopeCApiVersion = 1;

// Status of a call that can fail; the message is sac_scope_last_error()'s.
enum SacScopeStatus : int32_t {
  kSacScopeOk = 0,
  kSacScopeRuntimeError = 1,
  kSacScopeValueError = 2,
};

SAC_C_API int32_t sac_scope_c_api_version();

// A new region for the policy at `policy_address` (PolicyHandle.policy_address(): the address of
// a std::shared_ptr<const Policy> that outlives the call). Returns an owned RegionHandle*, or
// null when the policy address is null.
SAC_C_API void* sac_region_new(const void* policy_address);
// Drops the reference sac_region_new returned.
SAC_C_API void sac_region_release(void* region);
// `recompute`: 0 for the forward, 1 for the recompute. Enter returns the depth (> 0) to pass to
// exit, or minus a SacScopeStatus on error; exit returns a SacScopeStatus.
SAC_C_API int64_t sac_region_enter(void* region, int32_t recompute);
SAC_C_API int32_t sac_region_exit(void* region, int32_t recompute, int64_t depth);

// Units by interned id (sac_unit_id: id + 1, or minus a SacScopeStatus on error). Push returns
// the depth (> 0), or minus a SacScopeStatus; pop returns a SacScopeStatus.
SAC_C_API int64_t sac_unit_id(const char* name, int64_t length);
SAC_C_API int64_t sac_unit_push(int64_t unit_id_plus_one);
SAC_C_API int32_t sac_unit_pop(int64_t unit_id_plus_one, int64_t depth);

// The message of this thread's last failed call; the status says which Python exception.
SAC_C_API const char* sac_scope_last_error();
