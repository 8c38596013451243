#pragma once
// The library's C ABI, what Python calls through ctypes on the hot paths (bound, with every
// signature and the ABI version check, in sac_plugin/_native.py): the scopes a
// checkpointed step opens and closes (a region, created once per checkpoint call, its forward and
// recompute entered and exited; a recompute unit), called by sac_plugin/_scopes.py, and the keep
// rule (Policy::decide) for the Python front doors that decide calls themselves (torch.compile's
// policy function, the dispatch-mode engine, the planner), called by sac_plugin/_rule.py.
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
// A checkpointed region's own two scopes go one step further: they are a Python type written in C
// (NOTE: [Scopes as a C type] in python_scopes.cpp); the region functions below serve the marker
// regions of the recompute above dispatch modes.
//
// Python finds these symbols in the library torch.ops.load_library loaded (ctypes.CDLL on the
// same path returns the same handle), so SAC_PLUGIN_LIBRARY builds serve them too.

#include <cstdint>

#define SAC_C_API extern "C" __attribute__((visibility("default")))

// Bumped when a signature or a meaning changes; Python (sac_plugin/_native.py, C_API_VERSION)
// refuses a library with another version.
inline constexpr int32_t kSacCApiVersion = 9;

// Status of a call that can fail; the message is sac_scope_last_error()'s.
enum SacScopeStatus : int32_t {
  kSacScopeOk = 0,
  kSacScopeRuntimeError = 1,
  kSacScopeValueError = 2,
};

SAC_C_API int32_t sac_scope_c_api_version();

// A new checkpoint site (NOTE: [What a site learns] in dispatch/site.h) for the policy at
// `policy_address` (PolicyHandle.policy_address(): the address of a std::shared_ptr<const Policy>
// that outlives the call), named `label` in messages (the checkpointed layer; null or empty: none,
// NOTE: [Unpinned routing must repeat itself] in dispatch/routing_check.cpp). Returns an owned std::shared_ptr<Site>*,
// or null when the policy address is null; sac_site_release drops it (the site lives on in the regions made from it).
SAC_C_API void* sac_site_new(const void* policy_address, const char* label, int32_t watches_outside_writes);
// What the site's forwards showed of writes outside their regions (sac::Site::OutsideWritesSeen):
// 0 not yet known, 1 none, 2 some (NOTE: [The recompute writes nothing outside its region]).
SAC_C_API int32_t sac_site_outside_writes(const void* site);
SAC_C_API void sac_site_release(void* site);
// A new region of the site at `site_address` (sac_site_new). Returns an owned RegionHandle*, or
// null when the site address is null.
SAC_C_API void* sac_region_new(const void* site_address);
// Drops the reference sac_region_new returned.
SAC_C_API void sac_region_release(void* region);
// `recompute`: 0 for the forward, 1 for the recompute. Enter returns the depth (> 0) to pass to
// exit, or minus a SacScopeStatus on error; exit returns a SacScopeStatus.
SAC_C_API int64_t sac_region_enter(void* region, int32_t recompute);
SAC_C_API int32_t sac_region_exit(void* region, int32_t recompute, int64_t depth);
// NOTE: [Kept outputs the recompute never reaches] (dispatch/region.cpp): the forward's position
// (calls decided so far), read at each tensor saved for backward; and, at the forward's end,
// freeing the kept outputs after the last save's position (returns how many, or minus a status).
SAC_C_API int64_t sac_region_forward_position(void* region);
SAC_C_API int64_t sac_region_release_unreached(void* region, int64_t last_saved_position);
// NOTE: [The recompute runs only what backward needs] (dispatch/dead_calls.cpp): what the site's
// watched forwards found (sac::Site::DeadCallsSeen: 0 not yet known, 1 no call to skip, 2 some);
// whether this forward of the region notes its calls (1) or has nothing to find (0), called
// before its first call; and a tensor autograd saved, by its StorageImpl's address (0: a tensor
// with no storage the region can name, after which the forward skips nothing).
SAC_C_API int32_t sac_site_dead_calls(const void* site);
SAC_C_API int32_t sac_region_watch_saves(void* region);
SAC_C_API void sac_region_note_saved(void* region, uintptr_t storage);

// Units by interned id (sac_unit_id: id + 1, or minus a SacScopeStatus on error). Push returns
// the depth (> 0), or minus a SacScopeStatus; pop returns a SacScopeStatus.
SAC_C_API int64_t sac_unit_id(const char* name, int64_t length);
SAC_C_API int64_t sac_unit_push(int64_t unit_id_plus_one);
SAC_C_API int32_t sac_unit_pop(int64_t unit_id_plus_one, int64_t depth);

// The message of this thread's last failed call; the status says which Python exception.
SAC_C_API const char* sac_scope_last_error();

// The module of the region scope type, a Python type written in C (NOTE: [Scopes as a C type] in
// bindings/python_scopes.cpp): a new reference to a PyObject, which ctypes takes as py_object with
// the GIL held (PyDLL). It is the one function here that calls the Python C API.
struct _object;
SAC_C_API _object* sac_python_scope_types();

// --- The keep rule (NOTE: [The keep rule] in policy/policy.cpp) ---------------------------------
//
// A decision is returned as one int64, never negative on success (minus a SacScopeStatus on error):
//   bits 0-7    Outcome (0 recompute, 1 keep, 2 offload)
//   bits 8-15   Reason (sac::Reason; sac_reason_text names it)
//   bit 16      a mutating op selected by a kept unit (worth a warning)
//   bit 17      a selected op's call that draws random numbers, e.g. attention with dropout_p > 0
//               (worth a warning)
//   bits 32-62  the id + 1 of the kept or offloaded unit that selected the call, 0 for none
// Units cross as sac_unit_id returns them (id + 1), or as region openings of them (NOTE:
// [Region openings carry their flag] in policy/unit_stack.h). `facts`: bit 0, the call draws
// random numbers; bit 1, it casts a parameter; bit 2, it routes tokens or copies a value to the
// host (ops/routing.h); bit 3, whether it does follows from the op alone (routesTokens without
// arguments), for a caller that does not read the arguments; other bits are refused.

// The catalog entry of exactly one op overload: "aten::mm.default", "aten.mm.default", or a
// qualified name as profiles and audits write it ("aten::mm" for the default overload, which
// is how this function reads a name that could also mean every overload). Null, with a
// ValueError message, for a name that names no overload or several. Entries live as long as
// the process.
SAC_C_API const void* sac_op_entry(const char* name, int64_t length);

// A decider for one region: it numbers each op's calls per pass exactly as the native fallback
// numbers the forward's (Policy::countsCalls), then decides. Owned; release it once. Null, with
// a message, when the policy address is null.
SAC_C_API void* sac_call_decider_new(const void* policy_address);
SAC_C_API void sac_call_decider_release(void* decider);
// `pass`: 0 for the forward, 1 for the recompute (each counts from 0).
SAC_C_API int64_t sac_call_decider_decide(void* decider, const void* op_entry, int32_t pass,
                                          const int64_t* unit_ids_plus_one, int64_t unit_count, int32_t facts);

// Stateless, for a caller that knows the call's 0-based index among the region's counted calls
// of its op (the planner).
SAC_C_API int64_t sac_policy_decide(const void* policy_address, const void* op_entry, const int64_t* unit_ids_plus_one,
                                    int64_t unit_count, int64_t call_index, int32_t facts);

// The label of a Reason ("mutates an input"); null for a value that is no Reason.
SAC_C_API const char* sac_reason_text(int32_t reason);

// --- Where an offloaded call's outputs live (NOTE: [Where an offloaded call's outputs live] in
// policy/offload_rule.cpp), for the planner -------------------------------------------------------

// sac::offloadPlacement: 0 host, 1 device (under offload_min_bytes), 2 device (host_memory_limit
// reached); host_memory_limit -1 for none. Never fails.
SAC_C_API int32_t sac_offload_placement(int64_t bytes, int64_t reserved_host_bytes, int64_t offload_min_bytes,
                                        int64_t host_memory_limit);
