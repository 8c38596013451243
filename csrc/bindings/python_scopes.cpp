// sac_plugin._C's scopes part: Site, Region and RegionScope, and the recompute units' functions.

#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <memory>
#include <string>

#include "bindings/python_module.h"
#include "bindings/rule_calls.h"
#include "dispatch/mode_engine.h"
#include "dispatch/region_scopes.h"
#include "dispatch/site.h"
#include "policy/unit_stack.h"

namespace sac {
namespace python {
namespace {

// NOTE: [Scopes as a C type]
// torch's checkpoint makes a region per call through the context function and enters and exits
// its two scopes: five crossings from Python into the library per checkpoint call, and a sixth
// when the region is dropped. Through ctypes each crossing cost about 2 us in a training step
// (the interpreter's and libffi's code paths are cold between two of them): on a block of 64
// small ops that was a fifth of the plugin's whole overhead. Here the scopes are a Python type
// written in C, whose __enter__ and __exit__ are C methods, so each crossing is a C call with no
// argument conversion. They run RegionHandle's code (NOTE: [Scopes are checked before they change
// anything] in region_scopes.h), with its messages and Python exception types. Each scope owns
// one reference to the region's handle, so the region lives while either scope does and dies
// with the last of them, whichever way the step ends.

struct RegionScopeObject {
  PyObject_HEAD RegionHandle* handle;  // one reference, owned
  ActivationKind kind;
  int64_t depth;
  // The recompute's context above the dispatch modes that are on (NOTE: [Modes above the key see
  // only what ran] in sac_plugin/_mode_recompute.py), while it is open; null otherwise.
  PyObject* above_modes;
};

struct RegionObject {
  PyObject_HEAD RegionHandle* handle;  // one reference, owned
};

struct SiteObject {
  PyObject_HEAD std::shared_ptr<Site>* site;  // owned
};

PyTypeObject* region_scope_type = nullptr;
PyTypeObject* region_type = nullptr;
PyTypeObject* site_type = nullptr;
// sac_plugin._mode_recompute.recompute_above_modes, set when that module is imported.
PyObject* recompute_above_modes = nullptr;
// sac_plugin.HeldNeverServedWarning, set when sac_plugin._scopes is imported.
PyObject* never_served_warning = nullptr;

// --- Region ------------------------------------------------------------------------------------------

// A Region sharing `handle` (a new reference to it is taken).
PyObject* newRegion(RegionHandle* handle) {
  auto* self = reinterpret_cast<RegionObject*>(allocate(region_type));
  if (self == nullptr) return nullptr;
  c10::raw::intrusive_ptr::incref(handle);
  self->handle = handle;
  return reinterpret_cast<PyObject*>(self);
}

RegionHandle* handleOf(PyObject* object, const char* what) {
  if (!PyObject_TypeCheck(object, region_type)) {
    PyErr_Format(PyExc_TypeError, "sac: %s needs a _C.Region", what);
    return nullptr;
  }
  return reinterpret_cast<RegionObject*>(object)->handle;
}

void regionDealloc(PyObject* self) {
  // The last reference closes a scope still open on this thread (RegionHandle's destructor).
  auto* region = reinterpret_cast<RegionObject*>(self);
  if (region->handle != nullptr) c10::intrusive_ptr<RegionHandle>::reclaim(region->handle);
  deallocate(self);
}

Region& regionIn(PyObject* self) { return *reinterpret_cast<RegionObject*>(self)->handle->region; }

ActivationKind kindOf(PyObject* recompute) {
  return PyObject_IsTrue(recompute) ? ActivationKind::kRecompute : ActivationKind::kForward;
}

// enter(recompute) -> depth: a marker region's forward or recompute (NOTE: [Modes above the key
// see only what ran] in sac_plugin/_mode_recompute.py).
PyObject* regionEnter(PyObject* self, PyObject* recompute) {
  RegionHandle* handle = reinterpret_cast<RegionObject*>(self)->handle;
  return guarded([&] { return PyLong_FromLongLong(handle->enter(kindOf(recompute))); });
}

// exit(recompute, depth) -> None.
PyObject* regionExit(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  int64_t depth = 0;
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "sac: Region.exit takes (recompute, depth), got %zd arguments", nargs);
    return nullptr;
  }
  if (!toInt64(args[1], "depth", &depth)) return nullptr;
  RegionHandle* handle = reinterpret_cast<RegionObject*>(self)->handle;
  return guarded([&] {
    handle->exit(kindOf(args[0]), depth);
    Py_RETURN_NONE;
  });
}

PyObject* forwardPosition(PyObject* self, PyObject*) { return PyLong_FromLongLong(regionIn(self).forwardPosition()); }

// NOTE: [Kept outputs the recompute never reaches] (dispatch/kept_outputs.cpp).
PyObject* releaseUnreached(PyObject* self, PyObject* position) {
  int64_t last_saved = 0;
  if (!toInt64(position, "last_saved_position", &last_saved)) return nullptr;
  return guarded([&] { return PyLong_FromLongLong(regionIn(self).releaseUnreached(last_saved)); });
}

// NOTE: [The recompute runs only what backward needs] (dispatch/dead_calls.cpp): whether this
// forward of the region notes its calls, called before its first call.
PyObject* watchSaves(PyObject* self, PyObject*) {
  Region& region = regionIn(self);
  region.watchSaves();
  return PyBool_FromLong(region.deadCalls().tracking());
}

// note_saved(storage): a tensor autograd saved, by its storage's identity (the StorageImpl's
// address, only compared, never read); 0 for a tensor the region cannot place, after which the
// forward skips nothing.
PyObject* noteSaved(PyObject* self, PyObject* storage) {
  int64_t key = 0;
  if (!toInt64(storage, "storage", &key)) return nullptr;
  DeadCalls& dead = regionIn(self).deadCalls();
  if (key == 0) {
    dead.noteWhatItCannotFollow();
  } else {
    dead.noteSaved(static_cast<uintptr_t>(key));
  }
  Py_RETURN_NONE;
}

// mode_region_over(marker) -> handle: a mode region over this region in its recompute, bound to
// the marker region (NOTE: [Modes above the key see only what ran]); 0 for a region that
// intercepts nothing.
PyObject* modeRegionOverThis(PyObject* self, PyObject* marker) {
  RegionHandle* marker_handle = handleOf(marker, "mode_region_over");
  if (marker_handle == nullptr) return nullptr;
  RegionHandle* handle = reinterpret_cast<RegionObject*>(self)->handle;
  return guarded([&] { return PyLong_FromLongLong(modeRegionOver(handle->region, marker_handle->region)); });
}

PyObject* regionHandle(PyObject* self, void*) {
  return PyLong_FromLongLong(reinterpret_cast<RegionObject*>(self)->handle->handed_out);
}

#define SAC_REGION_COUNT(name, member) \
  PyObject* name(PyObject* self, PyObject*) { return PyLong_FromLongLong(regionIn(self).member()); }
SAC_REGION_COUNT(keptBytes, keptBytes)
SAC_REGION_COUNT(keptCalls, keptCalls)
SAC_REGION_COUNT(offloadedBytes, offloadedBytes)
SAC_REGION_COUNT(offloadedCalls, offloadedCalls)
SAC_REGION_COUNT(offloadedInputBytes, offloadedInputBytes)
SAC_REGION_COUNT(offloadedInputs, offloadedInputs)
#undef SAC_REGION_COUNT

PyMethodDef region_methods[] = {
    {"enter", regionEnter, METH_O, "(recompute) -> depth: opens a marker region's pass on this thread."},
    {"exit", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(regionExit)), METH_FASTCALL,
     "(recompute, depth) -> None: closes it; raises if it cannot be closed here (nothing is changed then)."},
    {"forward_position", forwardPosition, METH_NOARGS, "The forward's calls decided so far."},
    {"release_unreached", releaseUnreached, METH_O, "(last_saved_position) -> the kept calls freed after it."},
    {"watch_saves", watchSaves, METH_NOARGS, "Whether this forward notes its calls and saves."},
    {"note_saved", noteSaved, METH_O, "(storage) -> None: a saved tensor's storage identity, 0 for none."},
    {"mode_region_over", modeRegionOverThis, METH_O, "(marker) -> a mode region's handle over this recompute."},
    {"kept_bytes", keptBytes, METH_NOARGS, "Bytes of the unique storages the region holds for backward."},
    {"kept_calls", keptCalls, METH_NOARGS, "Calls whose outputs the region holds, kept or offloaded."},
    {"offloaded_bytes", offloadedBytes, METH_NOARGS, "Pinned host bytes of the offloaded outputs."},
    {"offloaded_calls", offloadedCalls, METH_NOARGS, "Calls whose outputs are offloaded."},
    {"offloaded_input_bytes", offloadedInputBytes, METH_NOARGS, "Pinned host bytes of the offloaded inputs."},
    {"offloaded_inputs", offloadedInputs, METH_NOARGS, "Inputs held in pinned host memory."},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef region_getset[] = {
    {"handle", regionHandle, nullptr,
     "The region's handle, as torch.ops.sac.region_kept_tensors takes it (NOTE: [A handle that comes back is "
     "checked]).",
     nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyType_Slot region_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(regionDealloc)},
    {Py_tp_methods, region_methods},
    {Py_tp_getset, region_getset},
    {Py_tp_doc, const_cast<char*>("One checkpoint call's region (C++ sac::Region), shared with its scopes.")},
    {0, nullptr}};

PyType_Spec region_spec = {"sac_plugin._C.Region", sizeof(RegionObject), 0,
                           Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, region_slots};

// --- RegionScope -------------------------------------------------------------------------------------

// Whether the exception a context's __exit__ was handed ends the recompute as designed: none, or
// torch's early stop (_StopRecomputationError), raised once every tensor saved for backward is
// recomputed.
bool endedAsDesigned(PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || args[0] == Py_None) return true;
  PyObject* name = PyObject_GetAttrString(args[0], "__name__");
  if (name == nullptr) {
    PyErr_Clear();
    return false;
  }
  const bool early_stop = PyUnicode_CompareWithASCIIString(name, "_StopRecomputationError") == 0;
  Py_DECREF(name);
  return early_stop;
}

// NOTE: [Served, or named] (dispatch/kept_outputs.cpp): the warning a recompute left, issued where the
// user's warning filters apply. False with the warning raised as an exception (an "error" filter).
bool warnAboutUnservedOutputs(RegionScopeObject* scope, PyObject* const* args, Py_ssize_t nargs) {
  if (scope->kind != ActivationKind::kRecompute) return true;
  const std::string notice = scope->handle->region->takeNeverServedNotice();
  // A recompute that raised has not served what it would have: its error says enough.
  if (notice.empty() || never_served_warning == nullptr || !endedAsDesigned(args, nargs)) return true;
  return PyErr_WarnEx(never_served_warning, notice.c_str(), 1) == 0;
}

// Exits the scope's activation; false with a Python exception set when refused.
bool exitActivation(RegionScopeObject* scope) {
  try {
    scope->handle->exit(scope->kind, scope->depth);
    return true;
  } catch (...) {
    raiseTranslated();
    return false;
  }
}

// With a Python exception set: exits the scope's activation and returns null, the exception still
// the one raised (a refused exit is dropped, not raised in its place).
PyObject* exitKeepingTheError(RegionScopeObject* scope) {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  if (!exitActivation(scope)) PyErr_Clear();
  PyErr_Restore(type, value, traceback);
  return nullptr;
}

// A scope owning the reference `owned` (adopted, and dropped if the scope cannot be made).
PyObject* newScope(RegionHandle* owned, ActivationKind kind) {
  auto* scope = reinterpret_cast<RegionScopeObject*>(allocate(region_scope_type));
  if (scope == nullptr) {
    c10::intrusive_ptr<RegionHandle>::reclaim(owned);
    return nullptr;
  }
  scope->handle = owned;
  scope->kind = kind;
  scope->depth = 0;
  scope->above_modes = nullptr;
  return reinterpret_cast<PyObject*>(scope);
}

void scopeDealloc(PyObject* self) {
  auto* scope = reinterpret_cast<RegionScopeObject*>(self);
  Py_CLEAR(scope->above_modes);
  // The last reference closes a scope still open on this thread (RegionHandle's destructor).
  if (scope->handle != nullptr) c10::intrusive_ptr<RegionHandle>::reclaim(scope->handle);
  deallocate(self);
}

PyObject* scopeEnter(PyObject* self, PyObject* /*unused*/) {
  auto* scope = reinterpret_cast<RegionScopeObject*>(self);
  try {
    scope->depth = scope->handle->enter(scope->kind);
  } catch (...) {
    raiseTranslated();
    return nullptr;
  }
  if (scope->kind == ActivationKind::kRecompute && recompute_above_modes != nullptr &&
      c10::impl::TorchDispatchModeTLS::stack_len() > 0) {
    PyObject* region = newRegion(scope->handle);
    PyObject* above =
        region == nullptr ? nullptr : PyObject_CallFunctionObjArgs(recompute_above_modes, region, nullptr);
    Py_XDECREF(region);
    if (above != nullptr && above != Py_None) {
      PyObject* entered = PyObject_CallMethod(above, "__enter__", nullptr);
      if (entered == nullptr) Py_CLEAR(above);
      Py_XDECREF(entered);
    }
    // The recompute does not run: its activation closes again.
    if (above == nullptr) return exitKeepingTheError(scope);
    if (above == Py_None) {
      Py_DECREF(above);
    } else {
      scope->above_modes = above;
    }
  }
  Py_INCREF(self);
  return self;
}

PyObject* scopeExit(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  auto* scope = reinterpret_cast<RegionScopeObject*>(self);
  PyObject* above = scope->above_modes;
  if (above != nullptr) {
    scope->above_modes = nullptr;
    const bool given = nargs == 3;
    PyObject* result = PyObject_CallMethod(above, "__exit__", "OOO", given ? args[0] : Py_None,
                                           given ? args[1] : Py_None, given ? args[2] : Py_None);
    Py_DECREF(above);
    // The context above the modes raised: the activation closes anyway.
    if (result == nullptr) return exitKeepingTheError(scope);
    Py_DECREF(result);
  }
  if (!exitActivation(scope)) return nullptr;
  if (!warnAboutUnservedOutputs(scope, args, nargs)) return nullptr;
  Py_RETURN_FALSE;
}

PyObject* scopeRegion(PyObject* self, void* /*closure*/) {
  return newRegion(reinterpret_cast<RegionScopeObject*>(self)->handle);
}

PyMethodDef scope_methods[] = {
    {"__enter__", scopeEnter, METH_NOARGS, "Opens the scope on this thread."},
    {"__exit__", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(scopeExit)), METH_FASTCALL,
     "Closes the scope; raises if it cannot be closed here (nothing is changed then)."},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef scope_getset[] = {{"region", scopeRegion, nullptr, "The scope's region (a _C.Region sharing it).", nullptr},
                              {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyType_Slot scope_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(scopeDealloc)},
    {Py_tp_methods, scope_methods},
    {Py_tp_getset, scope_getset},
    {Py_tp_doc, const_cast<char*>("The forward or the recompute of one checkpointed region, as a context manager.")},
    {0, nullptr}};

PyType_Spec scope_spec = {"sac_plugin._C.RegionScope", sizeof(RegionScopeObject), 0,
                          Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, scope_slots};

// --- Site ----------------------------------------------------------------------------------------------

// Site(policy, label="", watches_outside_writes=True): a checkpoint site (NOTE: [What a site
// learns] in dispatch/site.h), one policy applied at one place, named `label` in messages (the
// checkpointed layer; empty: none, NOTE: [Unpinned routing must repeat itself] in
// dispatch/routing_check.cpp). A site whose regions only mark passes (a dispatch-mode engine's
// marker) leaves the calls to another region, which finds out what they write outside it.
PyObject* siteNew(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"policy", "label", "watches_outside_writes", nullptr};
  PyObject* policy = nullptr;
  const char* label = "";
  int watches_outside_writes = 1;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|sp:Site", const_cast<char**>(names), &policy, &label,
                                   &watches_outside_writes)) {
    return nullptr;
  }
  const std::shared_ptr<const Policy>* held = policyOf(policy, "Site");
  if (held == nullptr) return nullptr;
  return guarded([&]() -> PyObject* {
    auto site = std::make_unique<std::shared_ptr<Site>>(
        std::make_shared<Site>(*held, std::string(label), watches_outside_writes != 0));
    auto* self = reinterpret_cast<SiteObject*>(allocate(type));
    if (self != nullptr) self->site = site.release();
    return reinterpret_cast<PyObject*>(self);
  });
}

void siteDealloc(PyObject* self) {
  delete reinterpret_cast<SiteObject*>(self)->site;  // the site lives on in the regions made from it
  deallocate(self);
}

const std::shared_ptr<Site>& siteIn(PyObject* self) { return *reinterpret_cast<SiteObject*>(self)->site; }

// What the site's forwards showed of writes outside their regions (sac::Site::OutsideWritesSeen):
// 0 not yet known, 1 none, 2 some (NOTE: [The recompute writes nothing outside its region]).
PyObject* outsideWrites(PyObject* self, PyObject*) {
  return PyLong_FromLong(static_cast<long>(siteIn(self)->outsideWritesSeen()));
}

// What the site's watched forwards found (sac::Site::DeadCallsSeen: 0 not yet known, 1 no call to
// skip, 2 some; NOTE: [The recompute runs only what backward needs]).
PyObject* deadCalls(PyObject* self, PyObject*) {
  return PyLong_FromLong(static_cast<long>(siteIn(self)->deadCallsSeen()));
}

// new_region_scopes() -> (forward, recompute): a new region of the site, its two scopes sharing it.
PyObject* newRegionScopes(PyObject* self, PyObject*) {
  c10::intrusive_ptr<RegionHandle> handle;
  try {
    handle = c10::make_intrusive<RegionHandle>(siteIn(self));
  } catch (...) {
    raiseTranslated();
    return nullptr;
  }
  PyObject* forward = newScope(c10::intrusive_ptr<RegionHandle>(handle).release(), ActivationKind::kForward);
  if (forward == nullptr) return nullptr;
  PyObject* recompute = newScope(handle.release(), ActivationKind::kRecompute);
  if (recompute == nullptr) {
    Py_DECREF(forward);
    return nullptr;
  }
  PyObject* scopes = PyTuple_Pack(2, forward, recompute);
  Py_DECREF(forward);
  Py_DECREF(recompute);
  return scopes;
}

// new_region() -> Region: a region of the site entered through Region.enter and exit, not scopes
// (a marker region, NOTE: [Modes above the key see only what ran]).
PyObject* newSiteRegion(PyObject* self, PyObject*) {
  return guarded([&]() -> PyObject* {
    auto handle = c10::make_intrusive<RegionHandle>(siteIn(self));
    return newRegion(handle.get());
  });
}

// new_mode_region(marker) -> handle: a mode region of the site (NOTE: [The dispatch-mode
// engine's region]), bound to the marker region; owned by the caller until
// torch.ops.sac.mode_region_release.
PyObject* newModeRegionOfSite(PyObject* self, PyObject* marker) {
  RegionHandle* marker_handle = handleOf(marker, "new_mode_region");
  if (marker_handle == nullptr) return nullptr;
  return guarded([&] { return PyLong_FromLongLong(newModeRegion(siteIn(self), marker_handle->region)); });
}

PyMethodDef site_methods[] = {
    {"outside_writes", outsideWrites, METH_NOARGS, "0 not yet known, 1 none, 2 some writes outside the regions."},
    {"dead_calls", deadCalls, METH_NOARGS, "0 not yet known, 1 no recompute call to skip, 2 some."},
    {"new_region_scopes", newRegionScopes, METH_NOARGS, "() -> (forward, recompute) of a new region."},
    {"new_region", newSiteRegion, METH_NOARGS, "() -> a new Region, entered through its enter and exit."},
    {"new_mode_region", newModeRegionOfSite, METH_O, "(marker) -> a new mode region's handle."},
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot site_slots[] = {
    {Py_tp_new, reinterpret_cast<void*>(siteNew)},
    {Py_tp_dealloc, reinterpret_cast<void*>(siteDealloc)},
    {Py_tp_methods, site_methods},
    {Py_tp_doc, const_cast<char*>("A checkpoint site (C++ sac::Site): one policy applied at one place.")},
    {0, nullptr}};

PyType_Spec site_spec = {"sac_plugin._C.Site", sizeof(SiteObject), 0, Py_TPFLAGS_DEFAULT, site_slots};

// --- Units and the hooks Python sets -------------------------------------------------------------

// unit_id(name) -> the unit's interned id + 1 (what unit_push and unit_pop take).
PyObject* unitId(PyObject* /*module*/, PyObject* name) {
  std::string unit;
  if (!toString(name, "a recompute unit's name", &unit)) return nullptr;
  return guarded([&] { return PyLong_FromLongLong(unitIdPlusOne(unit)); });
}

bool unitArgument(PyObject* value, int64_t* id_plus_one) {
  if (!toInt64(value, "a unit id", id_plus_one)) return false;
  if (!validUnitIdPlusOne(*id_plus_one)) {
    PyErr_Format(PyExc_ValueError, "sac: no recompute unit has id %lld", static_cast<long long>(*id_plus_one - 1));
    return false;
  }
  return true;
}

// unit_push(id_plus_one) -> depth: opens the unit on this thread.
PyObject* unitPush(PyObject* /*module*/, PyObject* value) {
  int64_t id_plus_one = 0;
  if (!unitArgument(value, &id_plus_one)) return nullptr;
  return guarded([&] {
    return PyLong_FromLongLong(static_cast<int64_t>(UnitStack::current().push(static_cast<UnitId>(id_plus_one - 1))));
  });
}

// unit_pop(id_plus_one, depth) -> None: closes it; refuses misnesting, changing nothing.
PyObject* unitPop(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "sac: unit_pop takes (unit id, depth), got %zd arguments", nargs);
    return nullptr;
  }
  int64_t id_plus_one = 0;
  int64_t depth = 0;
  if (!unitArgument(args[0], &id_plus_one) || !toInt64(args[1], "depth", &depth)) return nullptr;
  if (depth <= 0) {
    PyErr_Format(PyExc_ValueError, "sac: unit depth must be positive, got %lld", static_cast<long long>(depth));
    return nullptr;
  }
  return guarded([&] {
    UnitStack::current().pop(static_cast<UnitId>(id_plus_one - 1), static_cast<size_t>(depth));
    Py_RETURN_NONE;
  });
}

// Makes `value` the object a global of this file refers to (owned), releasing the previous one.
PyObject* replaceGlobal(PyObject** global, PyObject* value) {
  Py_INCREF(value);
  PyObject* previous = *global;
  *global = value;
  Py_XDECREF(previous);
  Py_RETURN_NONE;
}

// set_recompute_above_modes(function): what a recompute scope calls, with its Region, when
// dispatch modes are on as it opens.
PyObject* setRecomputeAboveModes(PyObject* /*module*/, PyObject* function) {
  return replaceGlobal(&recompute_above_modes, function);
}

// set_never_served_warning(category): the warning class NOTE: [Served, or named] is issued as.
PyObject* setNeverServedWarning(PyObject* /*module*/, PyObject* category) {
  return replaceGlobal(&never_served_warning, category);
}

PyMethodDef scope_functions[] = {
    {"unit_id", unitId, METH_O, "(name) -> the unit's id + 1."},
    {"unit_push", unitPush, METH_O, "(id_plus_one) -> depth: opens the unit on this thread."},
    {"unit_pop", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(unitPop)), METH_FASTCALL,
     "(id_plus_one, depth) -> None: closes it."},
    {"set_recompute_above_modes", setRecomputeAboveModes, METH_O,
     "(function) -> None: what a recompute calls when dispatch modes are on."},
    {"set_never_served_warning", setNeverServedWarning, METH_O,
     "(category) -> None: the warning class for kept outputs a recompute never asked for."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

PyObject* newForwardScope(c10::intrusive_ptr<RegionHandle> handle) {
  return newScope(handle.release(), ActivationKind::kForward);
}

bool addScopesPart(PyObject* module) {
  region_type = addType(module, &region_spec);
  region_scope_type = region_type != nullptr ? addType(module, &scope_spec) : nullptr;
  site_type = region_scope_type != nullptr ? addType(module, &site_spec) : nullptr;
  return site_type != nullptr && PyModule_AddFunctions(module, scope_functions) == 0;
}

}  // namespace python
}  // namespace sac
